"""Shared fixtures: tiny random Hugging Face checkpoints written with `save_pretrained`."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

# NOTE: tiny models on a 2-core CI machine run several times faster on one thread, and tests
# that run subprocesses or zygotes compete for the cores.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def criu_config():
    """A criu that dumps and restores here (root + criu 4.x), or the test skips with its reason."""
    from snapfn.snapshot.process.criu import CriuConfig, check

    config = CriuConfig.from_env(os.environ)
    result = check(config)
    if not result.ok:
        pytest.skip(f"criu cannot run here: {result.reason}")
    print(f"\n{result.reason}")
    return config


@pytest.fixture(scope="module")
def tests_on_pythonpath():
    """Process-snapshot workers are fresh interpreters: they import tests' hosts via PYTHONPATH."""
    here = str(Path(__file__).parent)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
        yield


# what the tiny llama-family parity checkpoints share
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    eos_token_id=None,
    bos_token_id=None,
    dtype="float32",
)


def save_tiny(tmp_path_factory, name: str, seed: int, config_cls, model_cls, **config):
    """Write a random tiny checkpoint with `save_pretrained` and return its folder."""
    torch.manual_seed(seed)
    model = model_cls(config_cls(**(TINY | config))).eval()
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    llama3_rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    return save_tiny(
        tmp_path_factory,
        "llama",
        0,
        LlamaConfig,
        LlamaForCausalLM,
        intermediate_size=128,
        rope_parameters=llama3_rope,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return save_tiny(
        tmp_path_factory,
        "qwen3",
        1,
        Qwen3Config,
        Qwen3ForCausalLM,
        intermediate_size=96,
        head_dim=32,
        tie_word_embeddings=True,
    )


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return save_tiny(
        tmp_path_factory,
        "qwen2",
        2,
        Qwen2Config,
        Qwen2ForCausalLM,
        intermediate_size=96,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory):
    """Mistral with a sliding window (transformers' default config has one): the engine serves
    at most the window's tokens, where windowed attention is full attention."""
    from transformers import MistralConfig, MistralForCausalLM

    return save_tiny(
        tmp_path_factory,
        "mistral",
        3,
        MistralConfig,
        MistralForCausalLM,
        intermediate_size=96,
        sliding_window=96,
    )


@pytest.fixture(scope="session")
def tiny_llama_bias_dir(tmp_path_factory):
    """Llama with `attention_bias` (q, k, v and o_proj biased) and `mlp_bias` (gate, up and
    down biased), one KV head, tied embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return save_tiny(
        tmp_path_factory,
        "llama-bias",
        4,
        LlamaConfig,
        LlamaForCausalLM,
        intermediate_size=96,
        num_key_value_heads=1,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
    )


@pytest.fixture(scope="session")
def llama_with_tokenizer(tiny_llama_dir, tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = shutil.copytree(tiny_llama_dir, tmp_path_factory.mktemp("tok") / "m")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=256, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["hello world"], trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text("{}")
    return d


@pytest.fixture(scope="session")
def embedded_snapshot(tmp_path_factory):
    """A real tier-0 snapshot of the embedded model, made once (the S3 store and cache tests)."""
    from snapfn.handler.llm.embedded import embedded_model_dir
    from snapfn.handler.llm.init_config import InitConfig
    from snapfn.handler.llm.recipes.function import LLMFunction
    from snapfn.snapshot.runtime import init_and_snapshot

    tmp = tmp_path_factory.mktemp("embedded")
    config = InitConfig(max_num_batched_tokens=64, kv_cache_bytes_cpu=1 << 20, cache_dir=tmp / "c")
    init_and_snapshot(LLMFunction(config, embedded_model_dir()), tmp / "embedded", log=None)
    return tmp / "embedded"
