"""The OpenAI-compatible API: `/v1/completions` and `/v1/chat/completions` (and vLLM's
`/tokenize` and `/detokenize`).

schema.py    the request bodies as pydantic models: validation, errors, and their JSON schema
request.py   what a validated request is, and `ApiError` (no pydantic: the activator imports it)
params.py    the fields completions and chat share: model, sampling, stop, streaming, `n`
parse.py     a JSON body → a `GenerationRequest` → engine inputs
shapes.py    the response wire format: bodies, streamed chunks, usage, logprobs, errors
tokenization.py  `/tokenize` and `/detokenize`: their bodies in, their answers out
"""
