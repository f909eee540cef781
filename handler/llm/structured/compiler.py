"""The compile cache of one tokenizer: `GrammarSpec` → its compiled grammar, LRU-bounded.

`GrammarCache(tokenizer, vocab_size, eos_token_ids)` builds llguidance's tokenizer once, at
`prepare()` or the first compile (its token trie over the model's whole vocabulary, the eos
ids the ones the engine stops on); the cache's key is (that tokenizer, the spec). `compiled(spec)` is the compiled grammar: a hit, or
a miss that compiles it (llguidance: the grammar parsed, its lexer built, the first token mask
computed, so a request's first mask is a lookup) and keeps it, the least recently used one
dropped past `max_entries`. `matcher(spec)` is a fresh per-request matcher, a copy of the
compiled one. A spec that does not compile is an `InvalidGuide` (a `BadRequest`, 400) naming
what it is, the request fields that send it (`param`: the first) and, on one line, what the
library found wrong; nothing is cached for it. The boolean schema `true` is any JSON value;
`false`, which nothing matches, does not compile.

`preload(specs)` compiles a list of specs ahead of requests (the init's and the restore's
`grammars` stage): they count as compiled, not as misses, so `stats()` tells a request that
found its grammar ready (a hit) from one that compiled it (a miss). `stats()` is
{"hits", "misses", "preloaded", "entries", "compile_s"} (compile_s: every compile's seconds,
the preloaded ones' included).

NOTE: llguidance cannot serialize a compiled grammar: a snapshot carries the specs and the
restore compiles them again in its `grammars` stage, before the first request (a process
image keeps the compiled grammars themselves). Thread-safe: front-door threads check requests
while the engine loop makes matchers.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from snapfn.handler.llm.structured.matcher import GrammarMatcher
from snapfn.handler.llm.structured.spec import GrammarSpec, InvalidGuide
from snapfn.snapshot.errors import BadRequest, one_line

DEFAULT_MAX_ENTRIES = 256
ANY_JSON_OBJECT = '{"type":"object"}'
ANY_JSON = "{}"  # the boolean schema `true`, as an object llguidance can add its options to
# JSON as `json.dumps` writes it (", " and ": ", no other whitespace); a schema's own
# "x-guidance" options override this (llguidance's JSON docs)
JSON_DEFAULTS = {"whitespace_flexible": False}
LIBRARY_FORMATS = {  # spec kind → llguidance.grammar_from's format
    "regex": "regex",
    "grammar": "grammar",  # Lark, or llama.cpp's GBNF
    "choice": "choice",
}
# spec kind → the request fields that send it, which its compile error names (`param`: the
# first). A JSON schema is one spec by either spelling, so which one was sent is not known.
FIELDS = {
    "json_schema": ("response_format", "guided_json"),
    "json_object": ("response_format",),
    "regex": ("guided_regex",),
    "grammar": ("guided_grammar",),
    "choice": ("guided_choice",),
}
# llguidance's stop reasons at the first token (its message is then the parser's state dump)
STOP_REASONS = {
    "NoExtensionBias": "no output can match it (e.g. a rule or $ref that only refers to itself)",
    "LexerTooComplex": "its lexer is too complex (e.g. a regex with a large repeat count)",
}
MAX_REASON_CHARS = 300


class GrammarCache:
    """Compiled grammars of one tokenizer, by spec (see the module docstring)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        max_entries: int = DEFAULT_MAX_ENTRIES,
    ) -> None:
        self._source = tokenizer
        self._eos = sorted(eos_token_ids)
        self._tokenizer = None  # llguidance's, built by `prepare`
        self.vocab_size = vocab_size
        self.max_entries = max_entries
        self._compiled: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = self._misses = self._preloaded = 0
        self._compile_s = 0.0

    def prepare(self) -> dict[str, Any]:
        """Build llguidance's tokenizer now (a stage's figures: how long)."""
        start = time.perf_counter()
        self._library_tokenizer()
        return {"seconds_tokenizer": round(time.perf_counter() - start, 4)}

    def _library_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = _llguidance().LLTokenizer(
                    self._source.backend_json(),
                    n_vocab=self.vocab_size,
                    eos_token=self._eos or None,
                )
            return self._tokenizer

    def compiled(self, spec: GrammarSpec) -> Any:
        """`spec`'s compiled grammar (an llguidance matcher at its start), compiled on a miss."""
        with self._lock:
            found = self._compiled.get(spec)
            if found is not None:
                self._compiled.move_to_end(spec)
                self._hits += 1
                return found
            self._misses += 1
        return self._compile_and_keep(spec)

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A fresh matcher of `spec` for one request."""
        return GrammarMatcher(self.compiled(spec).deep_copy(), self.vocab_size)

    def warm_device_picks(self, spec: GrammarSpec, device: Any) -> float:
        """Seconds to run a structured request's pick once on `device`, greedy and sampled,
        over dummy logits, with matchers of `spec` (compiled by `preload`; counted neither as a
        hit nor as a miss): the mask's and the sampler's kernels load here, at start-up, not on
        the first structured request."""
        import torch

        # NOTE: imported here: the sampler imports this package
        from snapfn.handler.llm.engine.request import Request, SamplingParams
        from snapfn.handler.llm.engine.sampler import make_generator, sample

        start, rows = time.perf_counter(), []
        for params in (
            SamplingParams(guide=spec),
            SamplingParams(temperature=1.0, top_p=0.9, seed=0, guide=spec),
        ):
            req = Request([0], params)
            with self._lock:
                req.matcher = GrammarMatcher(self._compiled[spec].deep_copy(), self.vocab_size)
            req.generator = make_generator(params.seed)
            rows.append(req)
        sample(torch.zeros((len(rows), self.vocab_size), device=device), rows)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        return round(time.perf_counter() - start, 4)

    def preload(self, specs: Iterable[GrammarSpec]) -> dict[str, Any]:
        """Compile `specs` now (a stage's figures: how many, how long)."""
        start, count = time.perf_counter(), 0
        for spec in specs:
            with self._lock:
                if spec in self._compiled:
                    continue
                self._preloaded += 1
            self._compile_and_keep(spec)
            count += 1
        return {"compiled": count, "seconds_compile": round(time.perf_counter() - start, 4)}

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "hits": self._hits,
                "misses": self._misses,
                "preloaded": self._preloaded,
                "entries": len(self._compiled),
                "compile_s": round(self._compile_s, 6),
            }

    def _compile_and_keep(self, spec: GrammarSpec) -> Any:
        start = time.perf_counter()
        compiled = self._compile(spec)
        with self._lock:
            self._compile_s += time.perf_counter() - start
            self._compiled[spec] = compiled
            self._compiled.move_to_end(spec)
            while len(self._compiled) > self.max_entries:
                self._compiled.popitem(last=False)
        return compiled

    def _compile(self, spec: GrammarSpec) -> Any:
        llguidance = _llguidance()

        if spec.kind == "json_schema" and spec.text == "false":
            raise _not_compiled(spec, "the schema is false, which no output matches")
        try:
            if spec.kind in ("json_schema", "json_object"):
                schema = ANY_JSON_OBJECT if spec.kind == "json_object" else spec.text
                schema = ANY_JSON if schema == "true" else schema
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    schema, defaults=JSON_DEFAULTS
                )
            else:
                grammar = llguidance.grammar_from(LIBRARY_FORMATS[spec.kind], spec.text)
        except ValueError as exc:
            raise _not_compiled(spec, str(exc)) from None
        compiled = llguidance.LLMatcher(self._library_tokenizer(), grammar, log_level=0)
        if not compiled.is_error():
            compiled.compute_bitmask()  # the start state's mask, shared by every copy
        if compiled.is_error():
            raise _not_compiled(spec, compiled.get_error())
        return compiled


def _not_compiled(spec: GrammarSpec, why: str) -> InvalidGuide:
    """A 400 naming the request fields that send `spec`, with llguidance's reason on one line."""
    fields = FIELDS[spec.kind]
    named = " or ".join(f"'{field}'" for field in fields)
    message = f"{named}: {spec.describe()} does not compile: {_reason(why)}"
    return InvalidGuide(message, fields[0])


def _reason(message: str) -> str:
    """llguidance's message cut to its first line that says something: a stop reason in words
    (its parser state dump dropped); a parse error with the line that names its cause."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return "llguidance gave no reason"
    first = STOP_REASONS.get(lines[0], lines[0])
    cause = next((line for line in lines[1:] if line.startswith("error:")), None)
    if cause is not None and first.endswith(":"):
        first = f"{first} {cause.removeprefix('error:').strip()}"
    return one_line(first)[:MAX_REASON_CHARS]


def _llguidance() -> Any:
    """The llguidance module, or BadRequest saying how to install it.

    NOTE: imported here, not at module level: only a structured request (or a configured spec)
    needs it, and a machine without it serves every other request."""
    try:
        import llguidance
    except ImportError as exc:
        raise BadRequest(
            f"structured output needs the llguidance package, which does not import here "
            f"({exc}); pip install llguidance"
        ) from None
    return llguidance
