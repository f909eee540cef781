"""The OpenAI-compatible API: `/v1/completions` and `/v1/chat/completions`.

request.py   what a validated request is, and the strict readers every field goes through
params.py    the fields completions and chat share: model, sampling, stop, streaming, `n`
parse.py     a JSON body → a `GenerationRequest` → engine inputs
shapes.py    the response wire format: bodies, streamed chunks, usage, logprobs, errors
"""
