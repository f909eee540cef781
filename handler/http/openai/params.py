"""The fields completions and chat share: model, sampling, penalties, stop conditions, streaming.

Contract:
- `common_fields(body, limits, max_tokens)` turns a validated body (`schema.SharedFields`) into
  the keyword arguments of a `GenerationRequest` (its `params` is the engine's
  `SamplingParams`), or raises `ApiError`: a model other than `limits.model_name` is a 404
  (`model_not_found`; `model` left out is the served one); a `logit_bias` key that is not a
  token id is a 400 naming `logit_bias`.
- `check_choices(request, limits)` refuses a request asking for more than `limits.max_choices`
  choices (`n` × prompts), or whose `seed` + choices would pass 2**63.
- Structured output (`response_format` json_object / json_schema, `guided_*`) becomes the
  params' `guide` (`structured/spec.py`); a shape that cannot be one, or two at once, is a 400
  naming the field (`invalid_value`). Whether it compiles is the engine's check.
- A temperature below `MIN_TEMPERATURE` (1e-5) means greedy decoding; `top_k` -1 (vLLM's "off")
  means 0. Penalties and biases mean what the engine's `SamplingParams` says (vLLM's meaning).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from snapfn.handler.http.openai.request import ApiError, GenerationRequest, Limits
from snapfn.handler.llm.engine.request import SamplingParams
from snapfn.handler.llm.structured.spec import (
    GUIDED_FIELDS,
    GrammarSpec,
    InvalidGuide,
    spec_from_fields,
)

if TYPE_CHECKING:  # the models are pydantic's, which `parse` imports only when first used
    from snapfn.handler.http.openai.schema import SharedFields

MIN_TEMPERATURE = 1e-5  # below this, greedy (vLLM's rule)


def common_fields(body: SharedFields, limits: Limits, max_tokens: int) -> dict[str, Any]:
    """The `GenerationRequest` keyword arguments both endpoints read the same way."""
    options = body.stream_options
    if options is not None and not body.stream:  # OpenAI's rule, and vLLM's
        raise ApiError(
            "'stream_options' is only allowed with 'stream': true",
            param="stream_options",
            code="invalid_value",
        )
    return dict(
        model=check_model(body.model, limits),
        params=_sampling(body, max_tokens),
        n=body.n,
        stream=body.stream,
        include_usage=body.stream and options is not None and options.include_usage,
        return_token_ids=body.return_token_ids,
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


def check_model(model: str | None, limits: Limits) -> str:
    if model is None:
        return limits.model_name
    if model != limits.model_name:
        raise ApiError(
            f"model {model!r} does not exist here; this server serves {limits.model_name!r} "
            "(see GET /v1/models)",
            param="model",
            code="model_not_found",
            status=404,
        )
    return model


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{"token id": bias}` as (id, bias) pairs, in id order."""
    pairs = []
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit() and len(key) <= 12):
            raise ApiError(
                f"'logit_bias' keys are token ids (decimal strings), got {key[:40]!r}",
                param="logit_bias",
                code="invalid_value",
            )
        pairs.append((int(key), value))
    return tuple(sorted(pairs))


def _sampling(body: SharedFields, max_tokens: int) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=max_tokens,
        # NOTE: logits / 1e-300 overflow to inf and the sampler's NaNs would fail the whole
        # engine step (every request in it); a temperature this small is greedy anyway.
        temperature=body.temperature if body.temperature >= MIN_TEMPERATURE else 0.0,
        top_k=max(body.top_k, 0),  # -1 (vLLM's "off") = 0
        top_p=body.top_p,
        seed=body.seed,
        stop=(body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=_logit_bias(body.logit_bias),
        guide=_guide(body),
    )


def _guide(body: SharedFields) -> GrammarSpec | None:
    fields = {name: getattr(body, name) for name in GUIDED_FIELDS}
    if body.response_format is not None:
        fields["response_format"] = body.response_format.model_dump(by_alias=True)
    try:
        return spec_from_fields(fields)
    except InvalidGuide as exc:
        raise ApiError(str(exc), param=exc.param, code="invalid_value") from None
