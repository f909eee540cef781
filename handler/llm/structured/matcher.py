"""A request's grammar matcher: which tokens may come next, advanced with each accepted token.

`GrammarMatcher` wraps one llguidance matcher (a copy of the compiled grammar, `compiler.py`).
`fill_bitmask(row)` writes the allowed next tokens into one int32 row of `ceil(vocab / 32)`
words (token t allowed iff bit t % 32 of word t // 32 is set; the row must be contiguous host
memory); `accept(token)` advances past a token the engine appended; `finished` is true once the
grammar has reached its end (nothing but eos may follow), where the engine ends the request
with finish_reason "stop". A token the grammar refuses (only possible when the mask was not
applied), or the library failing on the grammar (its limits: a lexer or parser too large for
it), sets `failure`, and the engine ends that request alone with it.

Speculative decoding looks ahead: `look_ahead(token)` advances past a draft (False, and no
change, where the grammar refuses it or has ended), so that the next draft and each verified
position get the mask of their own place; `rollback(n)` takes the `n` drafts back before the
engine accepts what the verify keeps.
"""

from __future__ import annotations

from typing import Any

BITS_PER_WORD = 32


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row of an allowed-token bitmask over `vocab_size` tokens."""
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


class GrammarMatcher:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        # why this request's grammar cannot go on (None: it can): the engine ends the request
        # with it, and only that request (a grammar past the library's limits fails at its
        # first token, however well it compiled)
        self.failure: str | None = None

    def fill_bitmask(self, row: Any) -> None:
        """The allowed next tokens into `row` (a contiguous host int32 tensor of
        `bitmask_words(vocab_size)` words): every token where the grammar has failed (its row
        is sampled, and the engine then ends the request with `failure`)."""
        assert row.is_contiguous() and row.numel() == bitmask_words(self.vocab_size)
        if self.failure is None:
            try:
                size = row.numel() * row.element_size()
                self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), size)
                return
            except Exception as exc:  # the library's own limits (lexer, parser rows)
                self.failure = f"could not compute the allowed tokens: {_reason(exc)}"
        row.fill_(-1)

    def accept(self, token: int) -> None:
        """Advance past `token`; where the grammar refuses it or fails, `failure` says why."""
        if self.failure is not None:
            return
        try:
            if self._matcher.consume_token(token):
                return
            why = _first_line(self._matcher.get_error())
        except Exception as exc:
            why = _reason(exc)
        self.failure = f"the grammar refused token {token}: {why}"

    @property
    def finished(self) -> bool:
        return self._matcher.is_stopped()

    def look_ahead(self, token: int) -> bool:
        """Advance past a draft; False (and nothing changed) where the grammar has ended or
        refuses it."""
        # NOTE: checked first: a refused token put into consume_token leaves the matcher in
        # its error state for good
        if self._matcher.is_stopped() or self._matcher.validate_tokens([token]) != 1:
            return False
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused draft {token}: {self._matcher.get_error()}")
        return True

    def rollback(self, num_tokens: int) -> None:
        """Take back the last `num_tokens` tokens `look_ahead` advanced past."""
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise RuntimeError(f"the grammar matcher could not take back {num_tokens} tokens")


def _reason(exc: Exception) -> str:
    """The library's message, its first line, at most 200 characters."""
    return _first_line(str(exc)) or type(exc).__name__


def _first_line(text: str, limit: int = 200) -> str:
    """`text`'s first line, at most `limit` characters (the library's errors go on to dump its
    state and the grammar, which a client's error message need not carry)."""
    lines = str(text).strip().splitlines()
    return lines[0][:limit] if lines else ""
