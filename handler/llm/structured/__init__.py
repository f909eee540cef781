"""Structured output: generations held to a JSON schema, a regex, a grammar or a list of choices.

`spec.py` owns what a request carries (`GrammarSpec`, a frozen JSON-serializable value, and its
parsing from the OpenAI fields and vLLM's `guided_*` extras, each problem a 400 naming the
field); `compiler.py` the compile cache of one tokenizer (llguidance grammars, LRU-bounded, hit
and miss counters, the configured specs compiled at init and again at restore); `matcher.py` a
request's matcher (advanced with each accepted token; its end ends the request); `bitmask.py`
the allowed-token bitmasks, filled on the host per row and applied to the logits on their
device before a token is picked. `docs/structured.md` is the user's page.
"""
