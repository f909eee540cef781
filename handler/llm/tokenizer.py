"""Tokenizer, chat template, streaming detokenizer and stop-string search.

`Tokenizer.from_dir` reads a Hugging Face model folder the way transformers 5 does:
- `tokenizer.json` (required) drives encoding; its post-processor decides which special tokens
  `encode(..., add_special_tokens=True)` adds. `add_bos_token: true` in `tokenizer_config.json`
  additionally prepends bos when that post-processor does not add it (transformers 5 ignores the
  flag once a tokenizer.json exists; transformers 4's llama tokenizer honoured it).
- special tokens (`bos_token`, `eos_token`, …) from `tokenizer_config.json`, then
  `special_tokens_map.json`, each a string or an `{"content": ...}` dict.
- the chat template from `chat_template.jinja` if present, else `tokenizer_config.json`'s
  `chat_template` (a string, or a list of `{name, template}` of which "default" is used). It is
  rendered in jinja2's immutable sandbox with transformers' helpers (`raise_exception`, `tojson`,
  `strftime_now`, loop controls, `{% generation %}`), so templates from the Hub run unchanged.
  Compiling a template evaluates none of its expressions (jinja folds constant ones while
  compiling: a snapshot's `{{ 'a' * 10**10 }}` would run at load), and a `*` or `**` that would
  make a value of more than `MAX_TEMPLATE_VALUE_ITEMS` items or bits is refused as it renders.
  Render the result with `encode(prompt, add_special_tokens=False)`: the template writes bos.
- eos ids merged from `tokenizer_config.json`, `generation_config.json` and `config.json`.

`decode` never applies `clean_up_tokenization_spaces`: streamed and full text must agree.
`encode` refuses text that is not valid Unicode (a lone surrogate) with `BadRequest`.
`max_token_chars` is the most characters of text one token can stand for (the longest
vocabulary entry, added tokens included), so a text longer than `n × max_token_chars` surely
encodes to more than `n` tokens: the front door refuses such a prompt before encoding it
(`max_prompt_chars`), whatever its size. Normalizers that delete characters would make the
bound loose; none of the LLM tokenizers served has one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from tokenizers import Tokenizer as BackendTokenizer

from snapfn.snapshot.errors import BadRequest, CheckpointError

SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
REPLACEMENT_CHAR = "\ufffd"  # what decoding an incomplete UTF-8 sequence yields
SURROGATE = re.compile("[\ud800-\udfff]")  # in no valid Unicode text
# the most items (characters, list entries) one `*` of a chat template makes, and the most bits
# one `**` does: far past any prompt, far below an allocation that hurts
MAX_TEMPLATE_VALUE_ITEMS = 1 << 24
# tokenizer_config.json, special_tokens_map.json, generation_config.json, chat_template.jinja:
# the largest on the Hub hold a few MB of added tokens
MAX_CONFIG_FILE_BYTES = 64 << 20


class Tokenizer:
    """A `tokenizers` tokenizer plus the model's special tokens and chat template."""

    def __init__(
        self,
        backend: BackendTokenizer,
        special_tokens: Mapping[str, str],
        *,
        add_bos_token: bool = False,
        chat_template: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._backend = backend
        self.special_tokens = dict(special_tokens)  # e.g. {"bos_token": "<s>", ...}
        self.bos_token_id = self._optional_id("bos_token")
        self._prepend_bos = add_bos_token and not self._post_processor_adds_bos()
        self.chat_template = chat_template
        self._template = None if chat_template is None else compile_chat_template(chat_template)
        eos_id = self._optional_id("eos_token")
        own = () if eos_id is None else (eos_id,)
        self.eos_token_ids: frozenset[int] = frozenset((*own, *extra_eos_token_ids))

    @classmethod
    def from_dir(cls, model_dir: Path) -> Tokenizer:
        """Build from a Hugging Face model folder (see the module docstring for what is read)."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(
                f"{model_dir}: no tokenizer.json (only fast tokenizers are supported)"
            )
        try:
            backend = BackendTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
            raise CheckpointError(f"{path}: cannot be read by tokenizers ({exc})") from exc
        config = _read_json(model_dir / "tokenizer_config.json")
        legacy_map = _read_json(model_dir / "special_tokens_map.json")
        return cls(
            backend,
            _special_tokens(config, legacy_map),
            add_bos_token=bool(config.get("add_bos_token", False)),
            chat_template=_find_chat_template(model_dir, config),
            extra_eos_token_ids=_eos_ids_from_configs(model_dir),
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (largest id + 1)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def backend_json(self) -> str:
        """The `tokenizers` tokenizer as its tokenizer.json text (what grammar libraries read)."""
        return self._backend.to_str()

    def token_to_id(self, token: str) -> int | None:
        """The id of a token string, or None if it is not in the vocabulary."""
        return self._backend.token_to_id(token)

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token stands for (see the module docstring)."""
        vocab = self._backend.get_vocab(with_added_tokens=True)
        return max((len(token) for token in vocab), default=1) or 1

    def max_prompt_chars(self, max_tokens: int) -> int:
        """The longest text that may encode to `max_tokens` tokens or fewer."""
        return max_tokens * self.max_token_chars

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, as the post-processor (and bos) dictate."""
        if SURROGATE.search(text):
            raise BadRequest("the text holds a lone surrogate, which is not valid Unicode")
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; an incomplete trailing UTF-8 sequence decodes to U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` ([{"role", "content"}, ...]) to a prompt string, as transformers does.

        `template_kwargs` (`tools`, `enable_thinking`, …) are passed to the template. A template
        that refuses the conversation (`raise_exception`) raises `BadRequest` with its message.
        """
        if self._template is None:
            raise BadRequest("this model has no chat template: send a plain prompt instead")
        context = {**self.special_tokens, "tools": None, "documents": None, **template_kwargs}
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except jinja2.TemplateError as exc:
            raise BadRequest(f"chat template refused the conversation: {exc}") from exc
        except (ArithmeticError, TypeError, ValueError) as exc:  # `{{ 1 / 0 }}`, `10.0 ** 999`
            raise BadRequest(
                f"chat template failed on the conversation: {type(exc).__name__}: {exc}"
            ) from exc

    def _optional_id(self, key: str) -> int | None:
        token = self.special_tokens.get(key)
        if token is None:
            return None
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise CheckpointError(f"{key} {token!r} is not in tokenizer.json's vocabulary")
        return token_id

    def _post_processor_adds_bos(self) -> bool:
        probe = self._backend.encode("", add_special_tokens=True).ids
        return self.bos_token_id is None or self.bos_token_id in probe


class IncrementalDetokenizer:
    """Turns generated token ids into text one id at a time, for streaming and stop strings.

    Each `push` decodes a short window of recent ids and returns only text that is final: text
    ending in an incomplete UTF-8 sequence (U+FFFD) is held back until the next id completes it.
    `context_ids` (e.g. the prompt's last few ids) are decoded for context but never emitted, so
    tokenizers that drop a leading space at the start of a decode still stream it correctly.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        context_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(context_ids)
        self._read_offset = len(self._ids)  # ids before this are already emitted (or context)
        self._prefix_offset = max(0, self._read_offset - 6)  # window start for decoding
        self.text = ""  # all text emitted so far

    def push(self, token_id: int) -> str:
        """Add one generated id; return the newly finalized text (possibly "")."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of generation: emit whatever is held back (U+FFFD for broken bytes)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        delta = self._decode(self._ids[self._prefix_offset :])[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> int | None:
    """Earliest index in `text` where any of `stops` begins, or None.

    Only matches ending at or after `start` are looked for: pass the length the text had before
    the latest append, and each stop is searched from `start - len(stop) + 1`, so a stop that
    straddles old and new text is found without rescanning the whole generation.
    """
    found = None
    for stop in stops:
        if not stop:
            continue
        index = text.find(stop, max(0, start - len(stop) + 1))
        if index != -1 and (found is None or index < found):
            found = index
    return found


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # transformers' tojson: no HTML escaping (unlike jinja's), same keyword options
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _UnfoldedCodeGenerator(CodeGenerator):
    """jinja's compiler, evaluating no expression while it compiles (literal text aside)."""

    def _output_child_to_const(self, node: jinja2.nodes.Expr, frame: Any, finalize: Any) -> str:
        if isinstance(node, jinja2.nodes.TemplateData):
            return super()._output_child_to_const(node, frame, finalize)
        raise jinja2.nodes.Impossible()

    def visit_EvalContextModifier(self, node: jinja2.nodes.EvalContextModifier, frame: Any) -> None:
        for keyword in node.options:  # `{% autoescape EXPR %}`: EXPR evaluated as it renders
            self.writeline(f"context.eval_ctx.{keyword.key} = ")
            self.visit(keyword.value, frame)
        frame.eval_ctx.volatile = True


class _ChatTemplateSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, compiling without evaluating and bounding `*` and `**`."""

    code_generator_class = _UnfoldedCodeGenerator
    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            _check_repeat(left, right)
        elif _is_int(left) and _is_int(right) and right > 0:
            bits = right * max(abs(left).bit_length() - 1, 0)
            if bits > MAX_TEMPLATE_VALUE_ITEMS:
                raise SecurityError(f"{left} ** {right} would be a number of {bits} bits")
        return super().call_binop(context, operator, left, right)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_repeat(left: Any, right: Any) -> None:
    for seq, times in ((left, right), (right, left)):
        if isinstance(seq, str | list | tuple) and _is_int(times):
            items = len(seq) * times
            if items > MAX_TEMPLATE_VALUE_ITEMS:
                raise SecurityError(f"a repetition of {items} items is more than allowed")


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in a sandbox set up like transformers' (untrusted Hub code)."""
    env = _ChatTemplateSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        optimized=False,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise CheckpointError(f"chat template does not compile: {exc} (line {exc.lineno})") from exc


def _read_text(path: Path, max_bytes: int) -> str:
    """The UTF-8 text of the file at `path`; CheckpointError when it is larger than `max_bytes`
    (what reading it would hold in memory: a snapshot's files may be as large as they are listed)."""
    with open(path, "rb") as file:
        data = file.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise CheckpointError(f"{path}: more than the {max_bytes} bytes such a file may have")
    return data.decode("utf-8")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(_read_text(path, MAX_CONFIG_FILE_BYTES))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return value


def _token_content(value: Any) -> str | None:
    # a special token is written either as a string or as an AddedToken dict {"content": ...}
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _special_tokens(config: Mapping[str, Any], legacy_map: Mapping[str, Any]) -> dict[str, str]:
    tokens = {}
    for key in SPECIAL_TOKEN_KEYS:
        content = _token_content(config.get(key, legacy_map.get(key)))
        if content is not None:
            tokens[key] = content
    return tokens


def _find_chat_template(model_dir: Path, config: Mapping[str, Any]) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():  # transformers 5 writes it; it wins over tokenizer_config
        return _read_text(jinja_file, MAX_CONFIG_FILE_BYTES)
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    if "default" not in named:
        raise CheckpointError(
            f"{model_dir}: chat_template lists {sorted(map(str, named))} but no 'default'"
        )
    return named["default"]


def _eos_ids_from_configs(model_dir: Path) -> tuple[int, ...]:
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        value = _read_json(model_dir / name).get("eos_token_id")
        values = value if isinstance(value, list) else [] if value is None else [value]
        if not all(type(v) is int and v >= 0 for v in values):
            raise CheckpointError(
                f"{model_dir / name}: eos_token_id {value!r:.60} is not token ids"
            )
        ids.extend(values)
    return tuple(ids)


def stop_token_ids(model_dir: Path, tokenizer: Tokenizer | None) -> frozenset[int]:
    """The ids that end a generation, as transformers' `generate` takes them: generation_config's
    and config.json's `eos_token_id` and the tokenizer's eos (its `eos_token_ids`, which holds
    the configs' too); a folder without a tokenizer, the configs' alone."""
    if tokenizer is not None:
        return tokenizer.eos_token_ids
    return frozenset(_eos_ids_from_configs(Path(model_dir)))


def load_tokenizer(model_dir: Path) -> Tokenizer | None:
    """The model folder's tokenizer, or None when it has no tokenizer.json."""
    folder = Path(model_dir)
    return Tokenizer.from_dir(folder) if (folder / "tokenizer.json").is_file() else None
