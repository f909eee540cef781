"""The embedded default model: Hugging Face layout, size budget, and that it writes English."""

from __future__ import annotations

import json
import re

import pytest
import torch

from snapfn.handler.llm.embedded import embedded_model_dir

LAYOUT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
MAX_FOLDER_BYTES = 20 * 1024 * 1024


@pytest.fixture(scope="module")
def model_and_tokenizer():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = embedded_model_dir()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def test_folder_has_hf_layout():
    model_dir = embedded_model_dir()
    missing = [name for name in LAYOUT_FILES if not (model_dir / name).is_file()]
    assert not missing, f"missing {missing} in {model_dir}"


def test_folder_is_small():
    total_bytes = sum(p.stat().st_size for p in embedded_model_dir().rglob("*") if p.is_file())
    assert total_bytes < MAX_FOLDER_BYTES


def test_tokenizer_config_names_special_tokens_and_template():
    config = json.loads((embedded_model_dir() / "tokenizer_config.json").read_text())
    assert config["bos_token"] and config["eos_token"]
    assert "messages" in config["chat_template"]
    generation = json.loads((embedded_model_dir() / "generation_config.json").read_text())
    assert generation["eos_token_id"] is not None


def test_vocab_matches_tokenizer(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    assert model.config.vocab_size == len(tokenizer)
    assert model.get_input_embeddings().weight.shape[0] == len(tokenizer)


def test_greedy_generation_is_english(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    inputs = tokenizer("HAMLET:\n", return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    text = tokenizer.decode(output[0, inputs.input_ids.shape[1] :], skip_special_tokens=True)
    letters_or_spaces = sum(ch.isascii() and (ch.isalpha() or ch.isspace()) for ch in text)
    assert len(text) >= 40 and letters_or_spaces / len(text) > 0.8, repr(text)
    words = re.findall(r"[a-z]+", text.lower())
    common = {"the", "and", "i", "to", "of", "a", "you", "my", "that", "is", "not", "me", "with"}
    assert len(words) >= 8 and common & set(words), repr(text)


def test_chat_template_ends_with_assistant_turn(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    messages = [{"role": "user", "content": "Who is there?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    ids = torch.tensor([ids])
    assert ids[0, 0].item() == tokenizer.bos_token_id
    assert tokenizer.decode(ids[0]).endswith("<|assistant|>\n")
    output = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16)
    assert output.shape[1] > ids.shape[1]
