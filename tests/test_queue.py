"""The SQS batch worker against a real local endpoint (moto in server mode, boto3 unmodified).

Workers run in process (a thread running `QueueWorker.run`) or as `snapfn worker`
subprocesses (to SIGKILL / SIGTERM them), on a `WorkerRuntime` serving
the tiny llama with a tokenizer, or a slow function for the heartbeat and drain cases.
Covers `queue/worker.py`, `queue/inflight.py`, `queue/runner.py` and `queue/results.py`
(the wire format alone: `test_queue_jobs.py`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest

from snapfn.handler.function.runtime import WorkerRuntime
from snapfn.handler.function.target import ServeTarget
from snapfn.handler.llm.engine.request import SamplingParams
from snapfn.handler.llm.init_config import InitConfig
from snapfn.handler.queue.cli import queue_region
from snapfn.handler.queue.jobs import parse_job
from snapfn.handler.queue.results import ResultStore, encode_document
from snapfn.handler.queue.runner import JobRunner, handle_sqs_batch
from snapfn.handler.queue.worker import QueueConfig, QueueWorker
from snapfn.snapshot.errors import BadRequest
from snapfn.snapshot.stages import Readiness

from moto_server import FAKE_AWS_ENV, fake_aws, make_queue, queue_counts, wait_for
from parity import our_engine

KV_CACHE_BYTES = 16 << 20


def slow_handler(event: dict, context) -> dict:
    """A function target for the heartbeat and drain tests: sleeps as long as asked."""
    time.sleep(event["sleep_s"])
    return {"slept_s": event["sleep_s"]}


# ---- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def aws():
    with fake_aws() as server:
        yield server


def started(target: ServeTarget) -> WorkerRuntime:
    runtime = WorkerRuntime(target)
    runtime.start(background=False)
    assert runtime.wait_ready(60) is Readiness.UP, runtime.readiness.reason
    return runtime


@pytest.fixture(scope="module")
def llm_runtime(llama_with_tokenizer, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    config = InitConfig(kv_cache_bytes_cpu=KV_CACHE_BYTES, cache_dir=cache)
    runtime = started(ServeTarget(model_dir=llama_with_tokenizer, init_config=config))
    yield runtime
    runtime.close()


@pytest.fixture(scope="module")
def slow_runtime():
    target = ServeTarget(
        kind="function", function="test_queue:slow_handler", function_dir=Path(__file__).parent
    )
    runtime = started(target)
    yield runtime
    runtime.close()


@pytest.fixture(scope="module")
def reference(llama_with_tokenizer, llm_runtime):
    """Greedy token ids from `Engine.generate` (a separate engine): (prompts, n) -> [ids, …]."""
    engine = our_engine(llama_with_tokenizer)
    tokenizer = llm_runtime.llm.tokenizer

    def greedy(prompts: list[str | list[int]], n: int) -> list[list[int]]:
        ids = [tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
        return [list(r.token_ids) for r in engine.generate(ids, SamplingParams(max_new_tokens=n))]

    return greedy


@pytest.fixture
def names():
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def sqs(aws):
    return aws.client("sqs")


@pytest.fixture
def s3(aws):
    return aws.client("s3")


@pytest.fixture
def bucket(s3, names):
    s3.create_bucket(Bucket=names)
    s3.put_bucket_versioning(Bucket=names, VersioningConfiguration={"Status": "Enabled"})
    return names


# ---- helpers ----------------------------------------------------------------------------------
def send_job(sqs, queue_url: str, job_id: str, result: dict, **fields) -> None:
    sqs.send_message(
        QueueUrl=queue_url, MessageBody=json.dumps({"id": job_id, **fields, "result": result})
    )


def read_result(s3, bucket: str, key: str) -> dict | None:
    try:
        return json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    except s3.exceptions.NoSuchKey:
        return None


def num_versions(s3, bucket: str, key: str) -> int:
    return len(s3.list_object_versions(Bucket=bucket, Prefix=key).get("Versions", []))


def worker_config(queue_url: str, **overrides) -> QueueConfig:
    values = {
        "wait_time_s": 1,
        "visibility_timeout_s": 5,
        "retry_delay_s": 0,
        "drain_timeout_s": 10,
    }
    return QueueConfig(queue_url=queue_url, **{**values, **overrides})


@contextmanager
def running_worker(aws, runtime, config: QueueConfig, sqs=None, logs: list | None = None):
    """A QueueWorker on a thread for the duration of the block; stopped and joined after."""
    logs = [] if logs is None else logs
    sqs = sqs or aws.client("sqs")
    runner = JobRunner(runtime, ResultStore(aws.client("s3"), aws.client("sqs")), log=logs.append)
    worker = QueueWorker(config, runner, sqs, log=logs.append)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        worker.stop()
        thread.join(30)
        assert not thread.is_alive(), logs


def worker_process(aws, queue_url: str, model_dir: Path, cache: Path, *args: str):
    env = {
        **os.environ,
        **FAKE_AWS_ENV,
        "SNAPFN_KV_CACHE_BYTES_CPU": str(KV_CACHE_BYTES),
        "SNAPFN_CACHE_DIR": str(cache),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, "-m", "snapfn.handler.cli", "worker", "--queue-url", queue_url]
    cmd += ["--endpoint-url", aws.endpoint_url, "--model", str(model_dir), *args]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    return proc, lines


# ---- results ----------------------------------------------------------------------------------
def test_first_written_result_wins(aws, s3, bucket):
    store = ResultStore(s3, aws.client("sqs"))
    job = parse_job(json.dumps({"id": "j", "prompt": "x", "result": {"s3": f"s3://{bucket}/r/"}}))
    assert not store.already_written(job)
    assert store.write(job, b'{"first": 1}') is True
    assert store.write(job, b'{"second": 2}') is False
    assert store.already_written(job)
    assert read_result(s3, bucket, "r/j.json") == {"first": 1}
    assert num_versions(s3, bucket, "r/j.json") == 1


def test_s3_results_equal_engine_greedy_and_jobs_batch_together(
    aws, sqs, s3, bucket, names, llm_runtime, reference
):
    queue_url, _ = make_queue(sqs, names)
    jobs = {
        "one": {"prompt": "hello world", "params": {"max_tokens": 12}},
        "two": {"prompts": ["hello", "world wide"], "params": {"max_tokens": 8}},
        "ids": {"prompt_ids": [[1, 2, 3], [40, 50]], "params": {"max_tokens": 6, "logprobs": True}},
    }
    for job_id, fields in jobs.items():
        send_job(sqs, queue_url, job_id, {"s3": f"s3://{bucket}/out/"}, **fields)
    steps_before = llm_runtime.llm.stats.steps
    with running_worker(aws, llm_runtime, worker_config(queue_url)):
        wait_for(lambda: all(read_result(s3, bucket, f"out/{j}.json") for j in jobs), 30, "results")
        wait_for(lambda: queue_counts(sqs, queue_url) == (0, 0), 10, "messages deleted")
    # 5 prompts of 6-12 tokens share engine steps: one after another they would take 40
    assert llm_runtime.llm.stats.steps - steps_before < 30
    for job_id, fields in jobs.items():
        doc = read_result(s3, bucket, f"out/{job_id}.json")
        prompts = fields.get("prompts") or fields.get("prompt_ids") or [fields["prompt"]]
        n = fields["params"]["max_tokens"]
        assert doc["id"] == job_id and doc["status"] == "ok"
        assert [o["token_ids"] for o in doc["outputs"]] == reference(prompts, n)
        assert all(o["completion_tokens"] == n for o in doc["outputs"])
        assert all(("logprobs" in o) == (job_id == "ids") for o in doc["outputs"])


def test_reply_queue_gets_one_result_even_for_a_duplicated_job(
    aws, sqs, names, llm_runtime, reference
):
    queue_url, _ = make_queue(sqs, names)
    reply_url = sqs.create_queue(
        QueueName=f"{names}-replies.fifo", Attributes={"FifoQueue": "true"}
    )["QueueUrl"]
    for _ in range(2):  # the producer sent the same job twice
        send_job(
            sqs, queue_url, "r1", {"queue_url": reply_url}, prompt="hello", params={"max_tokens": 7}
        )
    with running_worker(aws, llm_runtime, worker_config(queue_url)):
        wait_for(lambda: queue_counts(sqs, queue_url) == (0, 0), 30, "both messages deleted")
    replies = sqs.receive_message(
        QueueUrl=reply_url, MaxNumberOfMessages=10, WaitTimeSeconds=1, MessageAttributeNames=["All"]
    )["Messages"]
    assert len(replies) == 1
    doc = json.loads(replies[0]["Body"])
    assert replies[0]["MessageAttributes"]["job_id"]["StringValue"] == "r1"
    assert doc["outputs"][0]["token_ids"] == reference(["hello"], 7)[0]
    assert replies[0]["Body"].encode() == encode_document(doc)  # canonical bytes


# ---- at-least-once delivery, exactly-once results ---------------------------------------------
class DeleteNothing:
    """An SQS client whose deletes are lost, as if the worker died right after writing."""

    def __init__(self, sqs) -> None:
        self._sqs = sqs

    def delete_message(self, **kwargs) -> None:
        return None

    def __getattr__(self, name):
        return getattr(self._sqs, name)


def test_redelivered_job_is_deleted_without_a_second_write(
    aws, sqs, s3, bucket, names, llm_runtime
):
    queue_url, _ = make_queue(sqs, names)
    send_job(
        sqs,
        queue_url,
        "again",
        {"s3": f"s3://{bucket}/again.json"},
        prompt="hello",
        params={"max_tokens": 5},
    )
    config = worker_config(queue_url, visibility_timeout_s=2)
    with running_worker(aws, llm_runtime, config, sqs=DeleteNothing(sqs)):
        wait_for(lambda: read_result(s3, bucket, "again.json"), 20, "first result")
    assert queue_counts(sqs, queue_url) == (0, 1)  # written but never deleted
    logs: list[str] = []
    with running_worker(aws, llm_runtime, config, logs=logs):  # a fresh worker: no local memory
        wait_for(lambda: queue_counts(sqs, queue_url) == (0, 0), 20, "redelivery deleted")
    assert any("already written" in line for line in logs), logs
    assert num_versions(s3, bucket, "again.json") == 1


@pytest.mark.slow
def test_worker_killed_mid_batch_loses_no_job_and_duplicates_none(
    aws, sqs, s3, bucket, names, llm_runtime, llama_with_tokenizer, reference, tmp_path
):
    queue_url, _ = make_queue(sqs, names)
    prompts = [f"hello {'world ' * i}" for i in range(6)]
    for i, prompt in enumerate(prompts):
        send_job(
            sqs,
            queue_url,
            f"k{i}",
            {"s3": f"s3://{bucket}/k/"},
            prompt=prompt,
            params={"max_tokens": 200},
        )
    proc, lines = worker_process(
        aws,
        queue_url,
        llama_with_tokenizer,
        tmp_path,
        "--wait-time-s",
        "1",
        "--visibility-timeout-s",
        "2",
    )
    try:
        wait_for(
            lambda: any("holding 6 messages" in line for line in lines), 60, f"held jobs: {lines}"
        )
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    keys = [f"k/k{i}.json" for i in range(6)]
    assert not all(read_result(s3, bucket, k) for k in keys), (
        "killed too late: nothing was in flight"
    )
    with running_worker(aws, llm_runtime, worker_config(queue_url, visibility_timeout_s=2)):
        wait_for(lambda: queue_counts(sqs, queue_url) == (0, 0), 60, "every job finished")
    expected = reference(prompts, 200)
    for key, token_ids in zip(keys, expected, strict=True):
        assert num_versions(s3, bucket, key) == 1
        assert read_result(s3, bucket, key)["outputs"][0]["token_ids"] == token_ids


# ---- failures -----------------------------------------------------------------------------------
def test_poison_messages_reach_the_dlq_after_max_receive_count(
    aws, sqs, s3, bucket, names, llm_runtime
):
    queue_url, dlq_url = make_queue(sqs, names, max_receive_count=2)
    good = {"s3": f"s3://{bucket}/good.json"}
    sqs.send_message(QueueUrl=queue_url, MessageBody="{not json")
    sqs.send_message(QueueUrl=queue_url, MessageBody=json.dumps({"id": "noprompt", "result": good}))
    send_job(
        sqs, queue_url, "badids", {"s3": f"s3://{bucket}/bad/"}, prompt_ids=[10**6]
    )  # refused by the engine
    send_job(sqs, queue_url, "nobucket", {"s3": f"s3://{names}-missing/x.json"}, prompt="hello")
    send_job(sqs, queue_url, "good", good, prompt="hello", params={"max_tokens": 3})
    logs: list[str] = []
    with running_worker(aws, llm_runtime, worker_config(queue_url), logs=logs):
        wait_for(
            lambda: queue_counts(sqs, dlq_url)[0] == 4,
            30,
            lambda: (
                f"4 in the DLQ: {queue_counts(sqs, dlq_url)} {queue_counts(sqs, queue_url)} {logs}"
            ),
        )
        wait_for(lambda: queue_counts(sqs, queue_url) == (0, 0), 10, "source queue empty")
    dead = sqs.receive_message(QueueUrl=dlq_url, MaxNumberOfMessages=10)["Messages"]
    ids = sorted(
        json.loads(m["Body"]).get("id", "?") if m["Body"].startswith('{"') else "?" for m in dead
    )
    assert ids == ["?", "badids", "nobucket", "noprompt"]
    assert read_result(s3, bucket, "good.json")["id"] == "good"


@pytest.mark.slow
@pytest.mark.parametrize("heartbeat", [True, False])
def test_job_longer_than_visibility_timeout_survives_by_heartbeat(
    aws, sqs, s3, bucket, names, slow_runtime, monkeypatch, heartbeat
):
    queue_url, _ = make_queue(sqs, names)
    send_job(sqs, queue_url, "slow", {"s3": f"s3://{bucket}/slow.json"}, event={"sleep_s": 4.5})
    if not heartbeat:  # the control: without it, a rival consumer gets the job mid-run
        monkeypatch.setattr(QueueWorker, "_extend", lambda self, messages: None)
    config = worker_config(queue_url, visibility_timeout_s=2, max_in_flight=1)
    stolen = []
    with running_worker(aws, slow_runtime, config) as worker:
        wait_for(lambda: worker.num_held == 1, 10, "the job held")
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline and not stolen:  # a rival consumer polls meanwhile
            stolen += sqs.receive_message(QueueUrl=queue_url, WaitTimeSeconds=1).get("Messages", [])
        wait_for(lambda: read_result(s3, bucket, "slow.json"), 10, "the slow result")
    assert bool(stolen) is not heartbeat
    assert read_result(s3, bucket, "slow.json")["output"] == {"slept_s": 4.5}
    if heartbeat:
        assert queue_counts(sqs, queue_url) == (0, 0)


# ---- stopping -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_sigterm_drains_held_jobs_and_exits_0(
    aws, sqs, s3, bucket, names, llama_with_tokenizer, tmp_path
):
    queue_url, _ = make_queue(sqs, names)
    for i in range(4):
        send_job(
            sqs,
            queue_url,
            f"d{i}",
            {"s3": f"s3://{bucket}/d/"},
            prompt="hello",
            params={"max_tokens": 200},
        )
    proc, lines = worker_process(aws, queue_url, llama_with_tokenizer, tmp_path)  # 20 s long polls
    try:
        wait_for(
            lambda: any("holding 4 messages" in line for line in lines), 60, f"held jobs: {lines}"
        )
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        assert proc.wait(timeout=30) == 0, lines
    finally:
        proc.kill()
    assert time.monotonic() - t0 < 15  # did not wait out the 20 s long poll
    assert all(read_result(s3, bucket, f"d/d{i}.json") for i in range(4))
    assert queue_counts(sqs, queue_url) == (0, 0), "".join(lines)


@pytest.mark.slow
def test_a_worker_over_two_tensor_parallel_ranks_answers_like_one_rank(
    aws, sqs, s3, bucket, names, llama_with_tokenizer, reference, tmp_path
):
    """`snapfn worker --tp-size 2`: rank 0 takes the jobs, rank 1 follows its steps; SIGTERM
    drains and stops both."""
    queue_url, _ = make_queue(sqs, names)
    jobs = {"a": "hello world", "b": "the quick brown fox", "c": "a"}
    for job_id, prompt in jobs.items():
        send_job(sqs, queue_url, job_id, {"s3": f"s3://{bucket}/tp/"}, prompt=prompt,
                 params={"max_tokens": 8})  # fmt: skip
    proc, lines = worker_process(
        aws, queue_url, llama_with_tokenizer, tmp_path, "--wait-time-s", "1", "--tp-size", "2"
    )
    try:
        done = lambda: all(read_result(s3, bucket, f"tp/{j}.json") for j in jobs)  # noqa: E731
        wait_for(done, 120, f"results: {lines}")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, lines
    finally:
        proc.kill()
    for job_id, prompt in jobs.items():
        doc = read_result(s3, bucket, f"tp/{job_id}.json")
        assert [o["token_ids"] for o in doc["outputs"]] == reference([prompt], 8)
    assert any("starting ranks 1-1 of 2" in line for line in lines), lines


def test_drain_timeout_gives_unfinished_jobs_back_at_once(
    aws, sqs, s3, bucket, names, slow_runtime
):
    queue_url, _ = make_queue(sqs, names)
    send_job(sqs, queue_url, "late", {"s3": f"s3://{bucket}/late.json"}, event={"sleep_s": 1.5})
    config = worker_config(queue_url, visibility_timeout_s=60, drain_timeout_s=0.1)
    with running_worker(aws, slow_runtime, config) as worker:
        wait_for(lambda: worker.num_held == 1, 10, "the job held")
    back = sqs.receive_message(QueueUrl=queue_url, WaitTimeSeconds=1).get("Messages", [])
    assert [json.loads(m["Body"])["id"] for m in back] == ["late"]  # not after 60 s: now
    time.sleep(2.0)  # the abandoned invocation ends; its result must not be written
    assert read_result(s3, bucket, "late.json") is None


def test_receive_errors_are_retried_not_fatal(aws, llm_runtime):
    missing = f"{aws.endpoint_url}/123456789012/no-such-queue"
    logs: list[str] = []
    with running_worker(aws, llm_runtime, worker_config(missing), logs=logs):
        wait_for(lambda: any("receive failed" in line for line in logs), 10, "a receive error")
    assert any("cannot read the queue's attributes" in line for line in logs)


def test_config_refuses_bad_values_and_finds_the_region():
    with pytest.raises(BadRequest, match="wait_time_s"):
        QueueConfig(queue_url="u", wait_time_s=21).validate()
    with pytest.raises(BadRequest, match="heartbeat_s"):
        QueueConfig(queue_url="u", visibility_timeout_s=2, heartbeat_s=3).validate()
    assert queue_region("https://sqs.eu-west-1.amazonaws.com/1/q") == "eu-west-1"
    assert queue_region("http://127.0.0.1:5000/123456789012/q") is None


# ---- the Lambda-style path ----------------------------------------------------------------------
def test_handle_sqs_batch_reports_only_failed_items(aws, s3, bucket, llm_runtime, reference):
    runner = JobRunner(llm_runtime, ResultStore(s3, aws.client("sqs")), log=lambda line: None)
    target = {"s3": f"s3://{bucket}/lambda/"}
    s3.put_object(Bucket=bucket, Key="lambda/done.json", Body=b"{}")

    def record(message_id: str, body: str) -> dict:
        return {
            "messageId": message_id,
            "receiptHandle": "rh",
            "body": body,
            "attributes": {"ApproximateReceiveCount": "1"},
        }

    event = {
        "Records": [
            record(
                "m1",
                json.dumps(
                    {"id": "ok", "prompt": "hello", "params": {"max_tokens": 4}, "result": target}
                ),
            ),
            record("m2", "{broken"),
            record("m3", json.dumps({"id": "done", "prompt": "hello", "result": target})),
            record(
                "m4",
                json.dumps(
                    {"id": "ok", "prompt": "hello", "params": {"max_tokens": 4}, "result": target}
                ),
            ),
            record("m5", json.dumps({"id": "far", "prompt_ids": [1] * 4000, "result": target})),
        ]
    }

    class Context:
        def get_remaining_time_in_millis(self) -> int:
            return 30_000

    requests_before = llm_runtime.llm.stats.requests
    assert handle_sqs_batch(event, Context(), runner=runner) == {
        "batchItemFailures": [{"itemIdentifier": "m2"}, {"itemIdentifier": "m5"}]
    }
    doc = read_result(s3, bucket, "lambda/ok.json")
    assert doc["outputs"][0]["token_ids"] == reference(["hello"], 4)[0]
    assert num_versions(s3, bucket, "lambda/ok.json") == 1
    assert read_result(s3, bucket, "lambda/done.json") == {}
    assert llm_runtime.llm.stats.requests - requests_before == 1  # "ok" once; "done" skipped
