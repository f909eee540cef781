"""`snapfn make-model`: synthetic checkpoints load in transformers, byte for byte reproducible."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from snapfn.handler.llm.make_model import build as build_module
from snapfn.handler.llm.make_model.build import make_model
from snapfn.handler.llm.make_model.cli import add_arguments, run
from snapfn.handler.llm.make_model.hf_layout import (
    DTYPE_BYTES,
    checkpoint_bytes,
    storage_units,
    tensor_specs,
)
from snapfn.handler.llm.make_model.presets import PRESETS, list_presets
from snapfn.handler.llm.weights.quant import dequantize_fp8_block, scale_shape
from snapfn.snapshot.errors import BadRequest

TINY_PRESETS = ["tiny", "qwen3-tiny", "qwen2-tiny", "glm-tiny", "glm-small", "glm-route"]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """make(preset, dtype, **kw) -> model dir, each combination written once per module."""
    cache: dict[tuple, Path] = {}

    def make(preset: str, dtype: str = "bf16", **kwargs) -> Path:
        key = (preset, dtype, tuple(sorted(kwargs.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(preset) / "model"
            cache[key] = make_model(preset, out, dtype=dtype, **kwargs)
        return cache[key]

    return make


def read_headers(model_dir: Path) -> dict[str, tuple[str, dict]]:
    """name -> (shard file name, header entry), read straight from the shard bytes."""
    found = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        header.pop("__metadata__")
        found.update({name: (path.name, entry) for name, entry in header.items()})
    return found


def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    return tensors


def mtp_prefix(model_dir: Path) -> str:
    config = json.loads((model_dir / "config.json").read_text())
    return f"model.layers.{config['num_hidden_layers']}."


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_tiny_preset_loads_in_transformers_with_finite_logits(made, preset):
    from transformers import AutoModelForCausalLM

    model_dir = made(preset)
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"]
    # Only the MTP layer is left over (transformers ignores model.layers.78.* by name only).
    assert all(k.startswith(mtp_prefix(model_dir)) for k in info["unexpected_keys"])
    assert model.dtype == torch.bfloat16
    on_disk = read_tensors(model_dir)["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(model.state_dict()["model.layers.0.mlp.down_proj.weight"], on_disk)

    input_ids = torch.randint(
        0, PRESETS[preset].vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        logits = model(input_ids).logits.float()
    assert torch.isfinite(logits).all()
    assert logits.std() > 0.05
    assert len(set(logits[0].argmax(-1).tolist())) > 3  # not one token everywhere


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_tensor_names_and_shapes_match_transformers_save_pretrained(made, preset, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = made(preset)
    reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    reference.save_pretrained(tmp_path)
    expected = {name: entry["shape"] for name, (_, entry) in read_headers(tmp_path).items()}
    ours = {name: entry["shape"] for name, (_, entry) in read_headers(model_dir).items()}
    mtp = {name for name in ours if name.startswith(mtp_prefix(model_dir))}
    assert {k: v for k, v in ours.items() if k not in mtp} == expected
    if preset.startswith("glm"):
        assert {"eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight"} <= {
            name.removeprefix(mtp_prefix(model_dir)) for name in mtp
        }


def test_glm_indexer_only_on_full_layers_and_mtp(made):
    model_dir = made("glm-tiny")
    config = json.loads((model_dir / "config.json").read_text())
    names = read_headers(model_dir)
    assert config["indexer_types"] == ["full", "shared", "full", "shared"]
    assert config["num_nextn_predict_layers"] == 1
    for layer, kind in enumerate([*config["indexer_types"], "full"]):  # the MTP layer is full
        has_indexer = f"model.layers.{layer}.self_attn.indexer.wk.weight" in names
        assert has_indexer == (kind == "full")
    assert "model.layers.0.mlp.gate_proj.weight" in names  # first_k_dense_replace = 1
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names
    assert names["model.layers.4.eh_proj.weight"][1]["shape"] == [64, 128]


def test_glm_fp8_writes_block_scales_and_modules_to_not_convert(made):
    from transformers.quantizers.quantizers_utils import should_convert_module

    model_dir = made("glm-tiny", "fp8")
    config = json.loads((model_dir / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["fmt"] == "e4m3"
    assert qc["activation_scheme"] == "dynamic" and qc["weight_block_size"] == [128, 128]
    skipped = qc["modules_to_not_convert"]
    assert "lm_head" in skipped and "model.embed_tokens" in skipped and "mlp.gate" in skipped
    for module in ("self_attn.indexer.weights_proj", "eh_proj", "mlp.gate", "input_layernorm"):
        assert not should_convert_module(f"model.layers.4.{module}", skipped), module
    assert should_convert_module("model.layers.4.mlp.shared_experts.gate_proj", skipped)

    headers = read_headers(model_dir)
    dtypes = {name: entry["dtype"] for name, (_, entry) in headers.items()}
    for name, (_, entry) in headers.items():
        if entry["dtype"] == "F8_E4M3":
            scale = headers[f"{name}_scale_inv"][1]
            assert scale["dtype"] == "F32"
            assert tuple(scale["shape"]) == scale_shape(tuple(entry["shape"]))
        is_linear_weight = name.endswith(".weight") and len(entry["shape"]) == 2
        if is_linear_weight and "embed_tokens" not in name:
            module = name.removesuffix(".weight")
            # transformers would leave exactly our unquantized linears alone
            assert should_convert_module(module, qc["modules_to_not_convert"]) == (
                entry["dtype"] == "F8_E4M3"
            ), name
    assert headers["model.layers.1.self_attn.q_b_proj.weight_scale_inv"][1]["shape"] == [2, 1]
    assert dtypes["model.layers.1.mlp.gate.weight"] == "F32"
    assert dtypes["model.layers.1.mlp.gate.e_score_correction_bias"] == "F32"
    assert dtypes["model.layers.0.self_attn.indexer.weights_proj.weight"] == "BF16"
    assert dtypes["model.layers.4.eh_proj.weight"] == "BF16"
    assert dtypes["model.layers.0.self_attn.indexer.wq_b.weight"] == "F8_E4M3"
    assert dtypes["model.layers.4.mlp.experts.3.up_proj.weight"] == "F8_E4M3"


def test_fp8_dequantizes_to_the_bf16_checkpoint_of_the_same_seed(made):
    fp8, bf16 = read_tensors(made("glm-tiny", "fp8")), read_tensors(made("glm-tiny"))
    quantized = [name for name, t in fp8.items() if t.dtype == torch.float8_e4m3fn]
    assert len(quantized) > 100
    for name in quantized:
        weight = dequantize_fp8_block(fp8[name], fp8[f"{name}_scale_inv"], torch.float32)
        reference = bf16[name].float()
        assert (weight - reference).abs().max() <= 0.07 * reference.abs().max(), name
    assert set(bf16) == {name for name in fp8 if not name.endswith("_scale_inv")}


def test_llama_fp8_dequantized_runs_in_transformers(made):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = made("tiny", "fp8")
    stored = read_tensors(model_dir)
    state = {
        name: dequantize_fp8_block(t, stored[f"{name}_scale_inv"], torch.bfloat16)
        if t.dtype == torch.float8_e4m3fn
        else t
        for name, t in stored.items()
        if not name.endswith("_scale_inv")
    }
    config = AutoConfig.from_pretrained(model_dir)
    del config.quantization_config  # dequantized by hand: accelerate is not installed here
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        logits = model(torch.arange(16).unsqueeze(0)).logits
    assert torch.isfinite(logits).all() and logits.float().std() > 0.05


def test_same_seed_gives_byte_identical_files(tmp_path):
    first = make_model("glm-tiny", tmp_path / "a", dtype="fp8", seed=7)
    second = make_model("glm-tiny", tmp_path / "b", dtype="fp8", seed=7)
    other = make_model("glm-tiny", tmp_path / "c", dtype="fp8", seed=8)
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir())
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert (first / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()
    assert (first / "config.json").read_bytes() == (other / "config.json").read_bytes()


def test_multi_shard_index_is_consistent(made):
    model_dir = made("tiny", max_shard_bytes=64 << 10)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    headers = read_headers(model_dir)
    shards = sorted(p.name for p in model_dir.glob("*.safetensors"))
    assert len(shards) > 2 and not (model_dir / "model.safetensors").exists()
    assert all(re.fullmatch(rf"model-\d{{5}}-of-{len(shards):05d}\.safetensors", s) for s in shards)
    assert index["weight_map"] == {name: shard for name, (shard, _) in headers.items()}
    sizes = [e["data_offsets"][1] - e["data_offsets"][0] for _, e in headers.values()]
    assert (
        index["metadata"]["total_size"] == sum(sizes) == checkpoint_bytes(PRESETS["tiny"], "bf16")
    )
    single = read_tensors(made("tiny"))
    sharded = read_tensors(model_dir)
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[name], sharded[name]) for name in single)


def test_shards_are_aligned_and_open_with_safe_open(made):
    model_dir = made("glm-tiny", "fp8", max_shard_bytes=256 << 10)
    for path in model_dir.glob("*.safetensors"):
        raw = path.read_bytes()
        (length,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + length])
        header.pop("__metadata__")
        assert length % 8 == 0
        ends = sorted(tuple(e["data_offsets"]) for e in header.values())
        assert ends[0][0] == 0 and ends[-1][1] == len(raw) - 8 - length  # no gap, no tail
        assert all(a[1] == b[0] for a, b in zip(ends, ends[1:], strict=False))
        for entry in header.values():
            assert entry["data_offsets"][0] % DTYPE_BYTES[entry["dtype"]] == 0
        with safe_open(path, "pt") as f:
            for name in f.keys():  # noqa: SIM118
                assert list(f.get_tensor(name).shape) == header[name]["shape"]


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_tokenizer_covers_exactly_vocab_size_ids(made, preset):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    model_dir = made(preset)
    vocab_size = PRESETS[preset].vocab_size
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert raw.get_vocab_size(with_added_tokens=True) == vocab_size
    assert all(raw.decode([i], skip_special_tokens=False) for i in range(vocab_size))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert len(tokenizer) == vocab_size
    text = "Grüße, 世界! <3"
    assert tokenizer.decode(tokenizer(text).input_ids, skip_special_tokens=True) == text
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    generation = json.loads((model_dir / "generation_config.json").read_text())
    eos = tokenizer.convert_tokens_to_ids(["<|end_of_text|>", "<|eot_id|>"])
    assert generation["eos_token_id"] == eos


def test_snapfn_model_config_parses_every_tiny_preset(made):
    from snapfn.handler.llm.config import ModelConfig

    for preset in TINY_PRESETS:
        config = ModelConfig.from_dir(made(preset))
        assert config.vocab_size == PRESETS[preset].vocab_size
    glm = ModelConfig.from_dir(made("glm-tiny", "fp8"))
    assert glm.num_mtp_layers == 1 and glm.quant is not None


def test_big_preset_sizes_match_the_published_models():
    # Llama-3-8B has 8,030,261,248 parameters.
    assert checkpoint_bytes(PRESETS["8b"], "bf16") == 2 * 8_030_261_248
    # GLM-5 at full depth (78 layers, 3 dense) is the "744B" model, plus its ~10B MTP layer.
    glm5 = dataclasses.replace(PRESETS["glm5-reduced"], num_layers=78, first_k_dense_replace=3)
    specs = tensor_specs(glm5, 78)
    params = sum(math.prod(s.shape) for s in specs if not s.name.startswith("model.layers.78."))
    assert 743e9 < params < 745e9

    reduced = PRESETS["glm5-reduced"]
    shapes = {s.name: s.shape for s in tensor_specs(reduced, reduced.num_layers)}
    assert shapes["model.layers.3.mlp.experts.255.down_proj.weight"] == (6144, 2048)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (12288, 6144)
    assert shapes["model.layers.4.self_attn.kv_b_proj.weight"] == (64 * (192 + 256), 512)
    assert shapes["model.layers.4.eh_proj.weight"] == (6144, 12288)
    assert "model.layers.5.input_layernorm.weight" not in shapes
    fp8_bytes = checkpoint_bytes(reduced, "fp8")
    assert fp8_bytes == 43_897_570_944  # fits one H200 (141 GB) with room for the KV cache
    scales = [e for unit in storage_units(tensor_specs(reduced, 4), "fp8") for e in unit[1:]]
    assert all(e.dtype == "F32" for e in scales)


def test_experts_override_keeps_every_other_shape_and_loads_in_transformers(made, tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = made("glm-tiny", experts=4)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["n_routed_experts"] == 4
    names = {name: entry["shape"] for name, (_, entry) in read_headers(model_dir).items()}
    full = {name: entry["shape"] for name, (_, entry) in read_headers(made("glm-tiny")).items()}
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names
    assert "model.layers.1.mlp.experts.4.down_proj.weight" not in names
    assert names["model.layers.1.mlp.gate.weight"] == [4, 64]
    kept = {k: v for k, v in full.items() if ".experts." not in k and ".mlp.gate." not in k}
    assert kept == {k: v for k, v in names.items() if k in kept}
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"]
    with pytest.raises(BadRequest, match="num_experts_per_tok"):
        make_model("glm-tiny", tmp_path / "one", experts=1)
    with pytest.raises(BadRequest, match="multiple of n_group"):
        make_model("glm-tiny", tmp_path / "odd", experts=5)
    with pytest.raises(BadRequest, match="glm_moe_dsa presets"):
        make_model("tiny", tmp_path / "dense", experts=4)


def test_failed_write_leaves_no_checkpoint_behind(tmp_path, monkeypatch):
    calls = []

    def failing_sample(spec, seed, device):
        calls.append(spec.name)
        if len(calls) > 5:
            raise RuntimeError("disk on fire")
        return torch.zeros(spec.shape)

    monkeypatch.setattr(build_module, "sample_tensor", failing_sample)
    with pytest.raises(RuntimeError, match="disk on fire"):
        make_model("tiny", tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


def test_refuses_non_empty_out_dir_unless_overwrite(made, tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(BadRequest):
        make_model("tiny", out)
    make_model("tiny", out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_cli_run_writes_the_preset_and_checks_arch(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--arch",
            "glm_moe_dsa",
            "--out",
            str(tmp_path / "m"),
            "--num-layers",
            "2",
            "--max-shard-bytes",
            "512KiB",
            "--seed",
            "3",
        ]  # fmt: skip
    )
    assert run(args) == 0
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["model_type"] == "glm_moe_dsa" and config["num_hidden_layers"] == 2
    assert (tmp_path / "m" / "model.safetensors.index.json").is_file()
    assert "model.layers.2.eh_proj.weight" in read_headers(tmp_path / "m")
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")
    with pytest.raises(BadRequest, match="not --arch llama"):
        run(
            parser.parse_args(
                ["--arch", "llama", "--preset", "glm-tiny", "--out", str(tmp_path / "x")]
            )
        )
    assert list_presets()[:3] == ["tiny", "small", "8b"]
