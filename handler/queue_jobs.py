"""Queue jobs: the wire format of one job message, its work in the runtime, its result document.

A job is one SQS message whose body is JSON:

    {"id": "job-42",                        # required, [A-Za-z0-9._:-]{1,128}: the idempotency key
     # exactly one of:
     "prompt": "text" | "prompts": ["text", ...]           # tokenized with the model's tokenizer
       | "prompt_ids": [1, 2, 3] | [[1, 2], [3, 4], ...]    # token ids, one or many prompts
       | "messages": [{"role": "user", "content": "..."}]  # one chat, through the chat template
       | "event": {...},                                   # --function targets: handler(event, ctx)
     "params": {"max_tokens": 64, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": null,
                "stop": "..." | ["...", ...], "ignore_eos": false, "logprobs": false},
     "result": {"s3": "s3://bucket/key.json"}     # that exact key
             | {"s3": "s3://bucket/prefix/"}      # a prefix: key = prefix + id + ".json"
             | {"queue_url": "https://…/replies"}}  # one reply message (FIFO: deduplicated by id)

The result document is canonical JSON (sorted keys, no whitespace) and a pure function of the
job and the model (no timestamps, no worker names), so a redelivered job yields the same bytes:

    {"id": "job-42", "status": "ok", "outputs": [{"index": 0, "text": "...", "token_ids": [...],
      "finish_reason": "length" | "stop", "prompt_tokens": 5, "completion_tokens": 64,
      "logprobs"?: [...]}, ...]}                                       # prompt jobs
    {"id": "job-42", "status": "ok", "output": <the function's JSON result>}   # event jobs

Sampling (temperature > 0) without a seed uses a seed derived from the job id and prompt index,
so a redelivered job samples the same tokens on the same model and hardware.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from snapfn.snapshot.errors import BadRequest

from .llm.engine.request import SamplingParams

JOB_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
MAX_PROMPTS_PER_JOB = 256
PROMPT_FIELDS = ("prompt", "prompts", "prompt_ids", "messages", "event")
PARAM_TYPES: dict[str, tuple[type, ...]] = {
    "max_tokens": (int,),
    "max_new_tokens": (int,),
    "temperature": (int, float),
    "top_p": (int, float),
    "top_k": (int,),
    "seed": (int, type(None)),
    "stop": (str, list),
    "ignore_eos": (bool,),
    "logprobs": (bool,),
}
JOB_FIELDS = frozenset({"id", *PROMPT_FIELDS, "params", "result", "metadata"})  # metadata: ignored
Prompt = str | tuple[int, ...] | tuple[dict[str, Any], ...]  # text, token ids, or one chat
Log = Callable[[str], None]


def stderr_log(line: str) -> None:
    print(f"[snapfn worker] {line}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class S3Result:
    bucket: str
    key: str


@dataclass(frozen=True)
class ReplyQueue:
    queue_url: str


@dataclass(frozen=True)
class Job:
    """One parsed job. Either `prompts` (LLM targets) or `event` (function targets) is set."""

    id: str
    prompts: tuple[Prompt, ...]
    event: dict[str, Any] | None
    params: SamplingParams
    include_logprobs: bool
    result: S3Result | ReplyQueue

    def sampling(self, index: int) -> SamplingParams:
        """Parameters for prompt `index`: sampling without a seed gets one derived from the id."""
        if self.params.greedy or self.params.seed is not None:
            return self.params
        digest = hashlib.sha256(f"{self.id}/{index}".encode()).digest()
        seed = int.from_bytes(digest[:8], "big") % 2**63
        return replace(self.params, seed=seed)


def parse_job(body: str) -> Job:
    """Parse and validate a message body; raises BadRequest saying what to fix."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"message body is not JSON ({exc})") from exc
    _check(isinstance(data, dict), "a job is a JSON object")
    job_id = data.get("id")
    _check(
        isinstance(job_id, str) and JOB_ID.fullmatch(job_id) is not None,
        "'id' must be a string of 1-128 characters from [A-Za-z0-9._:-]",
    )
    unknown = sorted(set(data) - JOB_FIELDS)
    _check(not unknown, f"unknown fields {unknown}; a job has {sorted(JOB_FIELDS)}")
    given = [f for f in PROMPT_FIELDS if f in data]
    _check(
        len(given) == 1, f"give exactly one of {', '.join(PROMPT_FIELDS)} (got {given or 'none'})"
    )
    raw_params = data.get("params", {})
    _check(isinstance(raw_params, dict), "'params' must be an object")
    event = data.get("event")
    _check(given[0] != "event" or isinstance(event, dict), "'event' must be a JSON object")
    return Job(
        id=job_id,
        prompts=() if event is not None else _parse_prompts(given[0], data[given[0]]),
        event=event,
        params=_parse_params(raw_params),
        include_logprobs=bool(raw_params.get("logprobs", False)),
        result=_parse_result(data.get("result"), job_id),
    )


def _parse_prompts(field: str, value: Any) -> tuple[Prompt, ...]:
    if field == "prompt":
        _check(isinstance(value, str) and value != "", "'prompt' must be a non-empty string")
        return (value,)
    if field == "messages":
        _check(
            isinstance(value, list) and value and all(isinstance(m, dict) for m in value),
            "'messages' must be a non-empty list of {role, content} objects",
        )
        return (tuple(value),)
    if field == "prompt_ids" and isinstance(value, list) and value and _is_ids(value):
        return (tuple(value),)
    _check(isinstance(value, list) and 0 < len(value) <= MAX_PROMPTS_PER_JOB, _count_hint(field))
    if field == "prompts":
        _check(all(isinstance(p, str) and p for p in value), "'prompts' must be non-empty strings")
        return tuple(value)
    _check(all(isinstance(p, list) and p and _is_ids(p) for p in value), _ids_hint())
    return tuple(tuple(p) for p in value)


def _is_ids(value: list) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _count_hint(field: str) -> str:
    return f"'{field}' must be a list of 1-{MAX_PROMPTS_PER_JOB} prompts"


def _ids_hint() -> str:
    return "'prompt_ids' must be a list of token ids, or a list of such lists"


def _parse_params(raw: dict[str, Any]) -> SamplingParams:
    unknown = sorted(set(raw) - set(PARAM_TYPES))
    _check(not unknown, f"unknown params {unknown}; known: {sorted(PARAM_TYPES)}")
    for name, value in raw.items():
        ok = isinstance(value, PARAM_TYPES[name]) and (
            name in ("ignore_eos", "logprobs") or not isinstance(value, bool)
        )
        _check(ok, f"params.{name} has the wrong type ({type(value).__name__})")
    _check(not {"max_tokens", "max_new_tokens"} <= set(raw), "give max_tokens or max_new_tokens")
    stop = raw.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    _check(all(isinstance(s, str) for s in stop), "params.stop must be a string or strings")
    defaults = SamplingParams()
    return SamplingParams(
        max_new_tokens=raw.get("max_tokens", raw.get("max_new_tokens", defaults.max_new_tokens)),
        temperature=float(raw.get("temperature", defaults.temperature)),
        top_k=raw.get("top_k", defaults.top_k),
        top_p=float(raw.get("top_p", defaults.top_p)),
        seed=raw.get("seed"),
        stop=tuple(stop),
        ignore_eos=raw.get("ignore_eos", defaults.ignore_eos),
    ).validate()


def _parse_result(value: Any, job_id: str) -> S3Result | ReplyQueue:
    _check(
        isinstance(value, dict) and len(value) == 1 and set(value) <= {"s3", "queue_url"},
        '\'result\' must be {"s3": "s3://bucket/key"} or {"queue_url": "..."}',
    )
    if "queue_url" in value:
        _check(isinstance(value["queue_url"], str) and value["queue_url"], "bad result.queue_url")
        return ReplyQueue(value["queue_url"])
    uri = value["s3"]
    _check(isinstance(uri, str) and uri.startswith("s3://"), "result.s3 must be s3://bucket/key")
    bucket, _, key = uri[len("s3://") :].partition("/")
    _check(bucket != "", "result.s3 names no bucket")
    if key == "" or key.endswith("/"):
        key = f"{key}{job_id}.json"
    return S3Result(bucket, key)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise BadRequest(message)


# ---- a job's work in the runtime ---------------------------------------------------------------
class RunningJob:
    """A started job. `collect()` waits for it and returns its result document."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.abandoned = False

    def collect(self, deadline: float) -> dict[str, Any]:
        raise NotImplementedError

    def abandon(self) -> None:
        """Give the job up (drain, shutdown): its result must not be written."""
        self.abandoned = True


class PromptJob(RunningJob):
    """Every prompt of the job already submitted to the LLMService (batched with other jobs)."""

    def __init__(self, job: Job, streams: list) -> None:
        super().__init__(job)
        self.streams = streams

    def collect(self, deadline: float) -> dict[str, Any]:
        try:
            results = [s.result(max(0.0, deadline - time.monotonic())) for s in self.streams]
        except BaseException:
            self.abandon()
            raise
        outputs = [_output(i, r, self.job.include_logprobs) for i, r in enumerate(results)]
        return {"id": self.job.id, "status": "ok", "outputs": outputs}

    def abandon(self) -> None:
        super().abandon()
        for stream in self.streams:
            stream.cancel()


class EventJob(RunningJob):
    """A function event, invoked when collected (in the collecting thread)."""

    def __init__(self, job: Job, runtime: Any) -> None:
        super().__init__(job)
        self.runtime = runtime

    def collect(self, deadline: float) -> dict[str, Any]:
        timeout_s = max(0.001, deadline - time.monotonic())  # the Context needs a positive one
        output = self.runtime.invoke(self.job.event, timeout_s=timeout_s, request_id=self.job.id)
        return {"id": self.job.id, "status": "ok", "output": output}


def start_job(job: Job, runtime: Any) -> RunningJob:
    """Submit the job's prompts now (so held jobs batch together); BadRequest if it cannot run."""
    if job.event is not None:
        return EventJob(job, runtime)
    llm = getattr(runtime, "llm", None)
    if llm is None:
        raise BadRequest("this worker runs a function: send the job's input as 'event'")
    prompt_ids = [_encode(llm.tokenizer, p) for p in job.prompts]
    streams: list = []
    try:
        for index, ids in enumerate(prompt_ids):
            streams.append(llm.submit(ids, job.sampling(index)))
    except BaseException:
        for stream in streams:
            stream.cancel()
        raise
    return PromptJob(job, streams)


def _encode(tokenizer: Any, prompt: Prompt) -> list[int]:
    if isinstance(prompt, str):
        _check(tokenizer is not None, "this model has no tokenizer: send 'prompt_ids'")
        return tokenizer.encode(prompt)
    if prompt and isinstance(prompt[0], dict):
        _check(tokenizer is not None, "this model has no tokenizer: send 'prompt_ids'")
        text = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    return list(prompt)


def _output(index: int, result: Any, include_logprobs: bool) -> dict[str, Any]:
    out = {
        "index": index,
        "text": result.text,
        "token_ids": list(result.token_ids),
        "finish_reason": result.finish_reason,
        "prompt_tokens": len(result.prompt_ids),
        "completion_tokens": len(result.token_ids),
    }
    if include_logprobs:
        out["logprobs"] = list(result.logprobs)
    return out


def encode_document(document: dict[str, Any]) -> bytes:
    """Canonical bytes of a result document (equal documents give equal bytes)."""
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


# ---- where results go ----------------------------------------------------------------------------
class ResultStore:
    """Writes each job's result document where the job asks, at most once per job id.

    S3: a create-only put (`If-None-Match: *`): the first write of a key wins and a later one
    gets 412 and is dropped (`write` returns False), so a key never holds two different results.
    Reply queues: one `send_message`; a FIFO reply queue deduplicates by job id within its
    5-minute window; a standard one is at-least-once (a rare duplicate is the same document).
    """

    def __init__(self, s3: Any, sqs: Any) -> None:
        self.s3 = s3
        self.sqs = sqs

    def already_written(self, job: Job) -> bool:
        """True if the job's S3 result exists (reply queues cannot be asked: False)."""
        if not isinstance(job.result, S3Result):
            return False
        try:
            self.s3.head_object(Bucket=job.result.bucket, Key=job.result.key)
        except Exception as exc:
            if _http_status(exc) == 404:
                return False
            raise
        return True

    def write(self, job: Job, body: bytes) -> bool:
        """Write durably; True if this call wrote it, False if a first result was kept."""
        if isinstance(job.result, ReplyQueue):
            self.sqs.send_message(**_reply_message(job.id, job.result.queue_url, body))
            return True
        try:
            self.s3.put_object(
                Bucket=job.result.bucket,
                Key=job.result.key,
                Body=body,
                ContentType="application/json",
                IfNoneMatch="*",
            )
        except Exception as exc:
            if _http_status(exc) == 412:  # PreconditionFailed: the first result stays
                return False
            raise
        return True


def describe(target: S3Result | ReplyQueue) -> str:
    if isinstance(target, S3Result):
        return f"s3://{target.bucket}/{target.key}"
    return target.queue_url


def _reply_message(job_id: str, queue_url: str, body: bytes) -> dict[str, Any]:
    message = {
        "QueueUrl": queue_url,
        "MessageBody": body.decode(),
        "MessageAttributes": {"job_id": {"DataType": "String", "StringValue": job_id}},
    }
    if queue_url.endswith(".fifo"):
        message["MessageGroupId"] = job_id
        message["MessageDeduplicationId"] = hashlib.sha256(job_id.encode()).hexdigest()
    return message


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status of a botocore ClientError (None for anything else)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    return response.get("ResponseMetadata", {}).get("HTTPStatusCode")


# ---- running jobs and writing results --------------------------------------------------------
class RecentJobs:
    """Ids of jobs whose results this process wrote (bounded, oldest forgotten first)."""

    def __init__(self, max_ids: int = 4096) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._max_ids = max_ids
        self._lock = threading.Lock()

    def add(self, job_id: str) -> None:
        with self._lock:
            self._ids[job_id] = None
            while len(self._ids) > self._max_ids:
                self._ids.popitem(last=False)

    def __contains__(self, job_id: str) -> bool:
        with self._lock:
            return job_id in self._ids


class JobRunner:
    """Starts jobs in a runtime and writes their results; shared by the worker and Lambda path."""

    def __init__(self, runtime: Any, store: ResultStore, log: Log = stderr_log) -> None:
        self.runtime = runtime
        self.store = store
        self.log = log
        self._written = RecentJobs()

    def is_done(self, job: Job) -> bool:
        return job.id in self._written or self.store.already_written(job)

    def start(self, job: Job) -> RunningJob:
        """Submit the job's work now (BadRequest if it cannot run here)."""
        return start_job(job, self.runtime)

    def finish(self, running: RunningJob, deadline: float) -> bool:
        """Collect the result and write it; False if the job was abandoned. Raises on failure."""
        document = running.collect(deadline)
        if running.abandoned:
            return False
        wrote = self.store.write(running.job, encode_document(document))
        self._written.add(running.job.id)
        kept = "written to" if wrote else "already in (first result kept)"
        self.log(f"job {running.job.id}: result {kept} {describe(running.job.result)}")
        return True
