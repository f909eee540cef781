"""Queue jobs: the wire format of one job message and of its result document.

A job is one SQS message whose body is JSON:

    {"id": "job-42",                        # required, [A-Za-z0-9._:-]{1,128}: the idempotency key
     # exactly one of:
     "prompt": "text" | "prompts": ["text", ...]           # tokenized with the model's tokenizer
       | "prompt_ids": [1, 2, 3] | [[1, 2], [3, 4], ...]    # token ids, one or many prompts
       | "messages": [{"role": "user", "content": "..."}]  # one chat, through the chat template
       | "event": {...},                                   # --function targets: handler(event, ctx)
     "params": {"max_tokens": 64, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": null,
                "stop": "..." | ["...", ...], "stop_token_ids": [2], "ignore_eos": false,
                "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                "logprobs": false},     # the API's ranges (SamplingParams.validate)
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

Contract: `parse_job(body)` returns a validated `Job` or raises `BadRequest` saying what to fix;
`Message` is the SQS envelope (from ReceiveMessage or a Lambda event record) carrying the body.
The job's work is `runner`'s; writing its result is `results`'.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, replace
from typing import Any

from snapfn.handler.llm.engine.request import SamplingParams
from snapfn.snapshot.errors import BadRequest

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
    "stop_token_ids": (list,),
    "ignore_eos": (bool,),
    "presence_penalty": (int, float),
    "frequency_penalty": (int, float),
    "repetition_penalty": (int, float),
    "logprobs": (bool,),
}
JOB_FIELDS = frozenset({"id", *PROMPT_FIELDS, "params", "result", "metadata"})  # metadata: ignored
Prompt = str | tuple[int, ...] | tuple[dict[str, Any], ...]  # text, token ids, or one chat


@dataclass(frozen=True)
class Message:
    """One received SQS message, from ReceiveMessage or from a Lambda SQS event record."""

    message_id: str
    receipt_handle: str
    body: str
    receive_count: int

    @classmethod
    def from_sqs(cls, raw: dict[str, Any]) -> Message:
        count = raw.get("Attributes", {}).get("ApproximateReceiveCount", "0")
        return cls(raw["MessageId"], raw["ReceiptHandle"], raw.get("Body", ""), int(count))

    @classmethod
    def from_record(cls, raw: dict[str, Any]) -> Message:
        count = raw.get("attributes", {}).get("ApproximateReceiveCount", "0")
        return cls(raw["messageId"], raw.get("receiptHandle", ""), raw.get("body", ""), int(count))


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
    except (ValueError, RecursionError) as exc:  # also: an integer too long, nesting too deep
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
            isinstance(value, list) and value != [],
            "'messages' must be a non-empty list of {role, content} objects",
        )
        for i, m in enumerate(value):
            _check(
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str),
                f"messages[{i}] must be an object with string role and content",
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
    stop_ids = raw.get("stop_token_ids", [])
    _check(_is_ids(stop_ids), "params.stop_token_ids must be a list of token ids")
    defaults = SamplingParams()
    return SamplingParams(
        max_new_tokens=raw.get("max_tokens", raw.get("max_new_tokens", defaults.max_new_tokens)),
        temperature=_float(raw, "temperature", defaults.temperature),
        top_k=raw.get("top_k", defaults.top_k),
        top_p=_float(raw, "top_p", defaults.top_p),
        seed=raw.get("seed"),
        stop=tuple(stop),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=raw.get("ignore_eos", defaults.ignore_eos),
        presence_penalty=_float(raw, "presence_penalty", defaults.presence_penalty),
        frequency_penalty=_float(raw, "frequency_penalty", defaults.frequency_penalty),
        repetition_penalty=_float(raw, "repetition_penalty", defaults.repetition_penalty),
    ).validate()


def _float(raw: dict[str, Any], name: str, default: float) -> float:
    """`raw[name]` as a float; an integer too large for one is a BadRequest, not an overflow."""
    try:
        return float(raw.get(name, default))
    except OverflowError:
        raise BadRequest(f"params.{name} is out of range (an integer too large)") from None


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
