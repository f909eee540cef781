"""The fields completions and chat share: model, sampling, stop conditions, streaming, `n`.

Contract:
- `common_fields(body, limits, max_tokens)` turns a validated body (`schema.SharedFields`) into
  the keyword arguments of a `GenerationRequest` (its `params` is the engine's
  `SamplingParams`), or raises `ApiError`: a model other than `limits.model_name` is a 404
  (`model_not_found`); penalties other than 0 and a non-empty `logit_bias` are refused
  (`unsupported`), not ignored.
- `check_choices(request, limits)` refuses a request asking for more than `limits.max_choices`
  choices (`n` × prompts), or whose `seed` + choices would pass 2**63.
- A temperature below `MIN_TEMPERATURE` (1e-5) means greedy decoding; `top_k` -1 (vLLM's "off")
  means 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from snapfn.handler.http.openai.request import ApiError, GenerationRequest, Limits, unsupported
from snapfn.handler.llm.engine.request import SamplingParams

if TYPE_CHECKING:  # the models are pydantic's, which `parse` imports only when first used
    from snapfn.handler.http.openai.schema import SharedFields

MIN_TEMPERATURE = 1e-5  # below this, greedy (vLLM's rule)


def common_fields(body: SharedFields, limits: Limits, max_tokens: int) -> dict[str, Any]:
    """The `GenerationRequest` keyword arguments both endpoints read the same way."""
    _refuse_unsupported(body)
    options = body.stream_options
    return dict(
        model=_check_model(body.model, limits),
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


def _check_model(model: str, limits: Limits) -> str:
    if model != limits.model_name:
        raise ApiError(
            f"model {model!r} does not exist here; this server serves {limits.model_name!r} "
            "(see GET /v1/models)",
            param="model",
            code="model_not_found",
            status=404,
        )
    return model


def _refuse_unsupported(body: SharedFields) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) != 0.0:
            raise unsupported(name, "penalties are not implemented; leave it 0")
    if body.logit_bias:
        raise unsupported("logit_bias", "leave it out or send {}")


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
    )
