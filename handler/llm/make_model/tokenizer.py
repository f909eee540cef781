"""A synthetic byte-level tokenizer whose vocabulary has exactly `vocab_size` entries.

Ids 0-255 are the 256 bytes (id == byte value, spelled in the GPT-2 byte-to-unicode alphabet),
ids 256-260 the special tokens below, and every later id a filler `<|synthetic_{id}|>`, so any
id a random model emits decodes. There are no merges: text encodes to one token per UTF-8 byte.
Built offline, byte-identical on every run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|eot_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
)
BOS_ID, EOS_ID, EOT_ID = 256, 257, 258
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode map as a list: entry b is the printable char standing for byte b."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars, shifted = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return [chars[b] for b in range(256)]


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """The tokenizer; `vocab_size` must be at least `MIN_VOCAB_SIZE`."""
    assert vocab_size >= MIN_VOCAB_SIZE, vocab_size
    tokens = byte_alphabet() + list(SPECIAL_TOKENS)
    tokens += [f"<|synthetic_{i}|>" for i in range(len(tokens), vocab_size)]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    bos = SPECIAL_TOKENS[0]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, BOS_ID)]
    )
    # Already in the vocab, so they keep their ids; this marks them special (never split).
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    assert tokenizer.get_vocab_size(with_added_tokens=True) == vocab_size
    return tokenizer


def tokenizer_config(model_max_length: int) -> dict[str, Any]:
    added = {
        str(BOS_ID + i): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, token in enumerate(SPECIAL_TOKENS)
    }
    return {
        "added_tokens_decoder": added,
        "bos_token": SPECIAL_TOKENS[0],
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": SPECIAL_TOKENS[EOS_ID - BOS_ID],
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": model_max_length,
        # Explicit, so classes with their own defaults (transformers forces Qwen2Tokenizer on
        # qwen2) add no `<|endoftext|>` beyond vocab_size.
        "pad_token": SPECIAL_TOKENS[EOS_ID - BOS_ID],
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def write_tokenizer(out_dir: Path, vocab_size: int, model_max_length: int) -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` (chat template included) to `out_dir`."""
    build_tokenizer(vocab_size).save(str(out_dir / "tokenizer.json"), pretty=True)
    config = json.dumps(tokenizer_config(model_max_length), indent=2, ensure_ascii=False)
    (out_dir / "tokenizer_config.json").write_text(config + "\n")
