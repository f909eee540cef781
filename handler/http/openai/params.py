"""The fields completions and chat share: model, sampling, stop conditions, streaming, `n`.

Contract:
- `common_fields(body, limits, max_tokens)` reads them into the keyword arguments of a
  `GenerationRequest` (its `params` is the engine's `SamplingParams`), or raises `ApiError`.
- `check_choices(request, limits)` refuses a request asking for more than `limits.max_choices`
  choices (`n` × prompts), or whose `seed` + choices would pass 2**63.
- A temperature below `MIN_TEMPERATURE` (1e-5) means greedy decoding; `top_k` -1 (vLLM's "off")
  means 0. Penalties other than 0 and a non-empty `logit_bias` are refused, not ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from snapfn.handler.http.openai.request import (
    MISSING,
    ApiError,
    GenerationRequest,
    Limits,
    is_int,
    read_bool,
    read_field,
    read_int,
    read_number,
    unsupported,
)
from snapfn.handler.llm.engine.request import SamplingParams

MAX_STOP_STRINGS = 16
MIN_TEMPERATURE = 1e-5  # below this, greedy (vLLM's rule)
MAX_STOP_TOKEN_IDS = 64
COMMON_FIELDS = frozenset(
    {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop"}
    | {"presence_penalty", "frequency_penalty", "logit_bias", "user", "seed", "logprobs"}
    | {"top_k", "ignore_eos", "stop_token_ids", "return_token_ids"}
)


def common_fields(body: Mapping[str, Any], limits: Limits, max_tokens: int) -> dict[str, Any]:
    """The `GenerationRequest` keyword arguments both endpoints read the same way."""
    stream, include_usage = _stream_flags(body)
    _refuse_unsupported(body)
    return dict(
        model=_check_model(body, limits),
        params=_sampling(body, max_tokens),
        n=read_int(body, "n", 1, 1, 128),
        stream=stream,
        include_usage=include_usage,
        return_token_ids=read_bool(body, "return_token_ids"),
    )


def check_choices(request: GenerationRequest, limits: Limits) -> GenerationRequest:
    """`request`, if its choices (n × prompts) and seeds stay within the limits."""
    total = request.n * request.num_prompts
    if total > limits.max_choices:
        raise ApiError(
            f"this request asks for {total} choices (n × prompts); at most "
            f"{limits.max_choices} are served per request",
            param="n",
            code="out_of_range",
        )
    seed = request.params.seed
    if seed is not None and seed + total > 2**63:
        raise ApiError("'seed' + n must stay below 2**63", param="seed", code="out_of_range")
    return request


def _check_model(body: Mapping[str, Any], limits: Limits) -> str:
    model = read_field(body, "model", lambda v: isinstance(v, str), "a string", MISSING)
    if model != limits.model_name:
        raise ApiError(
            f"model {model!r} does not exist here; this server serves {limits.model_name!r} "
            "(see GET /v1/models)",
            param="model",
            code="model_not_found",
            status=404,
        )
    return model


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(
            "'stop' must be a non-empty string or a list of non-empty strings",
            param="stop",
            code="invalid_type",
        )
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(
            f"'stop' has {len(stops)} strings; at most {MAX_STOP_STRINGS} are accepted",
            param="stop",
            code="out_of_range",
        )
    return tuple(stops)


def _stop_token_ids(body: Mapping[str, Any]) -> tuple[int, ...]:
    ids = read_field(body, "stop_token_ids", lambda v: isinstance(v, list), "a list", [])
    if not all(is_int(t) and t >= 0 for t in ids) or len(ids) > MAX_STOP_TOKEN_IDS:
        raise ApiError(
            f"'stop_token_ids' must be at most {MAX_STOP_TOKEN_IDS} token ids >= 0",
            param="stop_token_ids",
            code="invalid_value",
        )
    return tuple(ids)


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        if read_number(body, name, 0.0, -2.0, 2.0) != 0.0:
            raise unsupported(name, "penalties are not implemented; leave it 0")
    bias = body.get("logit_bias")
    if bias is not None and (not isinstance(bias, dict) or bias):
        raise unsupported("logit_bias", "leave it out or send {}")
    read_field(body, "user", lambda v: isinstance(v, str), "a string", None)


def _stream_flags(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = read_bool(body, "stream")
    options = read_field(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    unknown = sorted(set(options) - {"include_usage"})
    if unknown:
        raise ApiError(
            f"unknown stream_options field {unknown[0]!r}; accepted: include_usage",
            param="stream_options",
            code="unknown_field",
        )
    return stream, read_bool(options, "include_usage") and stream


def _sampling(body: Mapping[str, Any], max_tokens: int) -> SamplingParams:
    top_k = read_int(body, "top_k", 0, -1)
    seed = read_int(body, "seed", None, 0, 2**63 - 1)
    temperature = read_number(body, "temperature", 1.0, 0.0, 2.0)
    params = SamplingParams(
        max_new_tokens=max_tokens,
        # NOTE: logits / 1e-300 overflow to inf and the sampler's NaNs would fail the whole
        # engine step (every request in it); a temperature this small is greedy anyway.
        temperature=temperature if temperature >= MIN_TEMPERATURE else 0.0,
        top_k=max(top_k, 0),  # -1 (vLLM's "off") = 0
        top_p=read_number(body, "top_p", 1.0, 0.0, 1.0),
        seed=seed,
        stop=_stop(body),
        stop_token_ids=_stop_token_ids(body),
        ignore_eos=read_bool(body, "ignore_eos"),
    )
    if params.top_p == 0.0:
        raise ApiError(
            "'top_p' must be > 0 (use temperature 0 for greedy decoding)",
            param="top_p",
            code="out_of_range",
        )
    return params
