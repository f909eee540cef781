"""Configurations transformers writes or reads that snapfn must read as transformers does:
logits against transformers on the same checkpoint, for config.json keys read one way by
transformers and easily read another (rope dicts, per-family bias rules, aliases, tied heads
that are not tied, windows no layer uses), and the refusals that remain, in one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from snapfn.handler.llm.config import ModelConfig
from snapfn.snapshot.errors import UnsupportedModel

from conftest import TINY
from parity import hf_logits, hf_model, our_engine, our_prefill_logits, random_prompts

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
}


def _families():
    import transformers as T

    return {
        "llama": (T.LlamaConfig, T.LlamaForCausalLM),
        "mistral": (T.MistralConfig, T.MistralForCausalLM),
        "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM),
        "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM),
    }


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every weight at unit scale (a freshly initialised model's are small, which hides wrong
    rope or bias handling in tiny logits)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(
                torch.randn(p.shape, generator=g) * (1.0 if p.dim() == 1 else p.shape[-1] ** -0.5)
            )


def _save(path, family, seed=0, edit=None, **config):
    config_cls, model_cls = _families()[family]
    base = TINY | {"max_position_embeddings": 512, "intermediate_size": 96}
    torch.manual_seed(seed)
    model = model_cls(config_cls(**(base | config))).eval()
    _randomize(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    if edit is not None:
        raw = json.loads((path / "config.json").read_text())
        edit(raw)
        (path / "config.json").write_text(json.dumps(raw))
    return path


def _tied_with_its_own_head(raw):
    raw["tie_word_embeddings"] = True  # transformers: "will NOT tie", lm_head.weight differs


def _scaling_and_parameters(raw):
    # both in one file: transformers reads rope_scaling whole, rope_parameters unread
    raw["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}


def _llama3_without_original(raw):
    # a 4.x-style dict: transformers takes max_position_embeddings as the original length
    raw.pop("rope_parameters", None)
    raw["rope_theta"] = 500000.0
    raw["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    }


CASES = {
    "yarn attention_factor": ("llama", {"rope_parameters": YARN | {"attention_factor": 0.7}}),
    "yarn truncate false": ("llama", {"rope_parameters": YARN | {"truncate": False}}),
    "qwen3 yarn attention_factor": (
        "qwen3",
        {"rope_parameters": YARN | {"attention_factor": 1.3}, "head_dim": 32},
    ),
    "llama3 without its original length": ("llama", {"edit": _llama3_without_original}),
    "rope_scaling beside rope_parameters": ("llama", {"edit": _scaling_and_parameters}),
    "dynamic rope within the model length": (
        "llama",
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
    ),
    "hidden_act swish": ("llama", {"hidden_act": "swish"}),
    "tied embeddings, yet a head of its own": (
        "llama",
        {"tie_word_embeddings": False, "edit": _tied_with_its_own_head},
    ),
    "qwen2 attention_bias false (q/k/v biased all the same)": (
        "qwen2",
        {"edit": lambda raw: raw.update(attention_bias=False)},
    ),
    "mistral attention_bias true (no biases all the same)": (
        "mistral",
        {"sliding_window": None, "edit": lambda raw: raw.update(attention_bias=True)},
    ),
    "llama mlp_bias": ("llama", {"mlp_bias": True}),
    "qwen2 mlp_bias true (its MLP is never biased)": ("qwen2", {"mlp_bias": True}),
    "qwen3 window on, but no layer slides": (
        "qwen3",
        {
            "use_sliding_window": True,
            "sliding_window": 8,
            "layer_types": ["full_attention", "full_attention"],
        },
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
    family, config = CASES[case]
    config = dict(config)
    model_dir = _save(tmp_path / "m", family, edit=config.pop("edit", None), **config)
    (ids,) = random_prompts(256, [23], seed=7)
    ours = our_prefill_logits(our_engine(model_dir), ids, 64)
    ref = hf_logits(hf_model(model_dir), ids)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


def test_a_window_that_slides_somewhere_still_caps_the_context(tmp_path):
    model_dir = _save(
        tmp_path / "m",
        "qwen3",
        use_sliding_window=True,
        sliding_window=8,
        layer_types=["full_attention", "sliding_attention"],
    )
    assert our_engine(model_dir).max_model_len == 8
    raw = json.loads((model_dir / "config.json").read_text())
    del raw["layer_types"]
    raw["max_window_layers"] = 2  # transformers: layers from the second on would slide
    assert ModelConfig.from_hf(raw).sliding_window is None
    raw["max_window_layers"] = 1
    assert ModelConfig.from_hf(raw).sliding_window == 8


def test_experts_saved_fused_are_refused_naming_the_fix(tmp_path):
    from safetensors.torch import load_file, save_file

    from glm_checkpoints import save_tiny_glm

    model_dir = save_tiny_glm(tmp_path / "glm", seed=1)
    (shard,) = sorted(model_dir.glob("*.safetensors"))
    tensors = load_file(shard)
    ups = sorted(n for n in tensors if n.endswith("experts.0.up_proj.weight"))
    layer = ups[0].removesuffix(".0.up_proj.weight")
    tensors[f"{layer}.down_proj"] = torch.zeros(2, 2, 2)
    save_file(tensors, shard)
    with pytest.raises(UnsupportedModel, match="save_original_format=True"):
        our_engine(model_dir)


def test_generation_config_eos_ends_a_folder_without_a_tokenizer(tiny_llama_dir, tmp_path):
    from snapfn.handler.llm.engine.request import SamplingParams

    from parity import greedy

    model_dir = shutil.copytree(tiny_llama_dir, tmp_path / "m")
    assert not (model_dir / "tokenizer.json").exists()
    (prompt,) = random_prompts(256, [5], seed=8)
    free = our_engine(model_dir).generate([prompt], greedy(6))[0].token_ids
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [free[2]]}))
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    (result,) = our_engine(model_dir).generate([prompt], params)
    assert result.token_ids == free[:3] and result.finish_reason == "stop"


def test_an_eos_id_that_is_not_a_token_id_is_refused(tiny_llama_dir, tmp_path):
    from snapfn.snapshot.errors import CheckpointError

    model_dir = shutil.copytree(tiny_llama_dir, tmp_path / "m")
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": ["2"]}))
    with pytest.raises(CheckpointError, match="eos_token_id"):
        our_engine(model_dir)


def _save_base_model(path, family, **config):
    """`_save` of the family's base model (`LlamaModel`…): no head, and no `model.` before its
    tensors' names."""
    import transformers as T

    config_cls, model_cls = _families()[family]
    base_cls = getattr(T, model_cls.__name__.replace("ForCausalLM", "Model"))
    torch.manual_seed(0)
    model = base_cls(config_cls(**(TINY | {"intermediate_size": 96} | config))).eval()
    _randomize(model, 0)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_base_model_checkpoint_loads_with_its_head_tied(family, tmp_path):
    # transformers' AutoModelForCausalLM reads it under `model.` (base_model_prefix), the head
    # tied to the embedding
    model_dir = _save_base_model(tmp_path / "m", family, tie_word_embeddings=True)
    (ids,) = random_prompts(256, [23], seed=7)
    ours = our_prefill_logits(our_engine(model_dir), ids, 64)
    ref = hf_logits(hf_model(model_dir), ids)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


def test_a_base_model_checkpoint_without_a_head_to_tie_is_refused_naming_it(tmp_path):
    from snapfn.snapshot.errors import CheckpointError

    # transformers would initialise the head at random
    model_dir = _save_base_model(tmp_path / "m", "llama", tie_word_embeddings=False)
    with pytest.raises(CheckpointError, match=r"not filled by the checkpoint: lm_head\.weight$"):
        our_engine(model_dir)


@pytest.mark.parametrize(
    "family, config, window",
    [
        # Mistral's modeling slides wherever sliding_window is set: use_sliding_window is Qwen's
        ("mistral", {"sliding_window": 8, "use_sliding_window": False}, 8),
        # Llama's has no window, whatever config.json holds
        ("llama", {"sliding_window": 8}, None),
    ],
)
def test_the_window_is_the_one_transformers_modeling_applies(family, config, window, tmp_path):
    engine = our_engine(_save(tmp_path / "m", family, **config))
    assert engine.model.config.sliding_window == window
    assert engine.max_model_len == (window or 512)
