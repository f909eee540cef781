"""Sharding rules: tp slices reassemble, ep owns each expert once, FP8 scales follow weights."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from snapfn.handler.llm.parallel import ParallelConfig
from snapfn.handler.llm.weights.quant import dequantize_fp8_block, quantize_fp8_block
from snapfn.handler.llm.weights.sharding import (
    Placement,
    expert_index,
    local_expert_range,
    placement_for,
    shard_slice_bounds,
    shard_tensor,
    validate_head_split,
)
from snapfn.snapshot.errors import BadRequest, CheckpointError, UnsupportedModel

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB_SIZE = 8, 4, 2, 2, 12, 16
NUM_EXPERTS, MOE_FFN = 4, 6


def llama_tensors(num_layers: int = 2) -> dict[str, torch.Tensor]:
    """Random tensors under every llama-family name (qwen2 biases and qwen3 q/k norms included)."""
    shapes = {"model.embed_tokens.weight": (VOCAB_SIZE, HIDDEN), "model.norm.weight": (HIDDEN,)}
    shapes["lm_head.weight"] = (VOCAB_SIZE, HIDDEN)
    for i in range(num_layers):
        p = f"model.layers.{i}."
        for proj, out in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
            shapes[p + f"self_attn.{proj}_proj.weight"] = (out * HEAD_DIM, HIDDEN)
            shapes[p + f"self_attn.{proj}_proj.bias"] = (out * HEAD_DIM,)
        shapes[p + "self_attn.o_proj.weight"] = (HIDDEN, HEADS * HEAD_DIM)
        shapes[p + "self_attn.q_norm.weight"] = (HEAD_DIM,)
        shapes[p + "self_attn.k_norm.weight"] = (HEAD_DIM,)
        shapes[p + "mlp.gate_proj.weight"] = (FFN, HIDDEN)
        shapes[p + "mlp.up_proj.weight"] = (FFN, HIDDEN)
        shapes[p + "mlp.down_proj.weight"] = (HIDDEN, FFN)
        shapes[p + "input_layernorm.weight"] = (HIDDEN,)
        shapes[p + "post_attention_layernorm.weight"] = (HIDDEN,)
    return {name: torch.randn(shape) for name, shape in shapes.items()}


def glm_layer_shapes(p: str, moe: bool) -> dict[str, tuple[int, ...]]:
    q_lora, kv_lora, qk_head, v_head, rope = 6, 4, 6, 4, 2
    shapes = {
        p + "input_layernorm.weight": (HIDDEN,),
        p + "post_attention_layernorm.weight": (HIDDEN,),
        p + "self_attn.q_a_proj.weight": (q_lora, HIDDEN),
        p + "self_attn.q_a_layernorm.weight": (q_lora,),
        p + "self_attn.q_b_proj.weight": (HEADS * qk_head, q_lora),
        p + "self_attn.kv_a_proj_with_mqa.weight": (kv_lora + rope, HIDDEN),
        p + "self_attn.kv_a_layernorm.weight": (kv_lora,),
        p + "self_attn.kv_b_proj.weight": (HEADS * (qk_head - rope + v_head), kv_lora),
        p + "self_attn.o_proj.weight": (HIDDEN, HEADS * v_head),
        p + "self_attn.indexer.wq_b.weight": (2 * 4, q_lora),
        p + "self_attn.indexer.wk.weight": (4, HIDDEN),
        p + "self_attn.indexer.k_norm.weight": (4,),
        p + "self_attn.indexer.k_norm.bias": (4,),
        p + "self_attn.indexer.weights_proj.weight": (2, HIDDEN),
    }
    if not moe:
        for proj, shape in (
            ("gate", (FFN, HIDDEN)),
            ("up", (FFN, HIDDEN)),
            ("down", (HIDDEN, FFN)),
        ):
            shapes[p + f"mlp.{proj}_proj.weight"] = shape
        return shapes
    shapes[p + "mlp.gate.weight"] = (NUM_EXPERTS, HIDDEN)
    shapes[p + "mlp.gate.e_score_correction_bias"] = (NUM_EXPERTS,)
    for owner in [f"experts.{e}" for e in range(NUM_EXPERTS)] + ["shared_experts"]:
        shapes[p + f"mlp.{owner}.gate_proj.weight"] = (MOE_FFN, HIDDEN)
        shapes[p + f"mlp.{owner}.up_proj.weight"] = (MOE_FFN, HIDDEN)
        shapes[p + f"mlp.{owner}.down_proj.weight"] = (HIDDEN, MOE_FFN)
    return shapes


def glm_tensors() -> dict[str, torch.Tensor]:
    """Layer 0 dense, layer 1 MoE, layer 2 the MTP layer (MoE plus its extras)."""
    shapes = {"model.embed_tokens.weight": (VOCAB_SIZE, HIDDEN), "model.norm.weight": (HIDDEN,)}
    shapes["lm_head.weight"] = (VOCAB_SIZE, HIDDEN)
    shapes |= glm_layer_shapes("model.layers.0.", moe=False)
    shapes |= glm_layer_shapes("model.layers.1.", moe=True)
    shapes |= glm_layer_shapes("model.layers.2.", moe=True)
    mtp = "model.layers.2."
    shapes |= {mtp + "enorm.weight": (HIDDEN,), mtp + "hnorm.weight": (HIDDEN,)}
    shapes |= {
        mtp + "eh_proj.weight": (HIDDEN, 2 * HIDDEN),
        mtp + "shared_head.norm.weight": (HIDDEN,),
    }
    return {name: torch.randn(shape) for name, shape in shapes.items()}


def reassemble(name: str, parts: list[torch.Tensor], placement: Placement) -> torch.Tensor:
    if placement.kind == "replicated":
        assert all(torch.equal(parts[0], part) for part in parts)
        return parts[0]
    return torch.cat(parts, dim=placement.dim)


@pytest.mark.parametrize(("arch", "make"), [("llama", llama_tensors), ("glm_moe_dsa", glm_tensors)])
def test_tp2_slices_reassemble_to_full_tensor(arch, make):
    for name, full in make().items():
        placement = placement_for(arch, name)
        parts = [
            shard_tensor(name, full, placement, ParallelConfig(tp_size=2, tp_rank=r))
            for r in (0, 1)
        ]
        if placement.kind != "replicated":
            assert parts[0].shape[placement.dim] == full.shape[placement.dim] // 2, name
        assert torch.equal(reassemble(name, parts, placement), full), name


def test_placements_follow_the_documented_rules():
    expect = {
        "model.layers.0.self_attn.k_proj.weight": ("llama", "kv"),
        "model.layers.0.self_attn.v_proj.bias": ("qwen2", "kv"),
        "model.layers.0.self_attn.q_proj.bias": ("qwen2", "column"),
        "model.layers.0.self_attn.o_proj.weight": ("llama", "row"),
        "model.layers.0.mlp.down_proj.weight": ("qwen3", "row"),
        "model.layers.0.self_attn.q_norm.weight": ("qwen3", "replicated"),
        "lm_head.weight": ("llama", "vocab"),
        "model.layers.3.self_attn.q_b_proj.weight": ("glm_moe_dsa", "column"),
        "model.layers.3.self_attn.kv_b_proj.weight": ("glm_moe_dsa", "column"),
        "model.layers.3.self_attn.kv_a_proj_with_mqa.weight": ("glm_moe_dsa", "replicated"),
        "model.layers.3.self_attn.indexer.wq_b.weight": ("glm_moe_dsa", "replicated"),
        "model.layers.3.mlp.gate.weight": ("glm_moe_dsa", "replicated"),
        "model.layers.3.mlp.gate_proj.weight": ("glm_moe_dsa", "column"),
        "model.layers.3.mlp.experts.7.down_proj.weight": ("glm_moe_dsa", "expert"),
        "model.layers.3.mlp.experts.7.down_proj.weight_scale_inv": ("glm_moe_dsa", "expert"),
    }
    for name, (arch, kind) in expect.items():
        assert placement_for(arch, name).kind == kind, name


def test_ep2_owns_every_expert_exactly_once_and_whole():
    tensors = {n: t for n, t in glm_tensors().items() if expert_index(n) is not None}
    owners: dict[str, list[int]] = {name: [] for name in tensors}
    for ep_rank in (0, 1):
        parallel = ParallelConfig(tp_size=2, tp_rank=1, ep_size=2, ep_rank=ep_rank)
        for name, full in tensors.items():
            placement = placement_for("glm_moe_dsa", name)
            local = shard_tensor(name, full, placement, parallel, num_experts=NUM_EXPERTS)
            if local is not None:
                owners[name].append(ep_rank)
                assert torch.equal(local, full), f"{name}: experts are not tp-split when ep > 1"
                assert expert_index(name) in local_expert_range(NUM_EXPERTS, parallel)
    assert all(len(ranks) == 1 for ranks in owners.values()), owners
    assert {expert_index(n) for n, r in owners.items() if r == [0]} == {0, 1}
    assert {expert_index(n) for n, r in owners.items() if r == [1]} == {2, 3}


def test_local_expert_range_is_contiguous_and_refuses_uneven():
    ranges = [local_expert_range(8, ParallelConfig(ep_size=4, ep_rank=r)) for r in range(4)]
    assert [list(r) for r in ranges] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(UnsupportedModel, match="6 experts"):
        local_expert_range(6, ParallelConfig(ep_size=4))


def fp8_glm_weights() -> dict[str, torch.Tensor]:
    p = "model.layers.1."
    shapes = {
        p + "self_attn.q_b_proj.weight": (512, 256),
        p + "self_attn.o_proj.weight": (256, 512),
        p + "self_attn.q_a_proj.weight": (200, 256),  # replicated: partial edge block is fine
        p + "mlp.experts.0.gate_proj.weight": (256, 384),
        p + "mlp.experts.0.down_proj.weight": (384, 256),
    }
    return {name: torch.randn(shape) for name, shape in shapes.items()}


def test_fp8_scale_slices_follow_their_weight():
    for name, dense in fp8_glm_weights().items():
        q, scale = quantize_fp8_block(dense)
        scale_name = name + "_scale_inv"
        placement = placement_for("glm_moe_dsa", scale_name)
        full_deq = dequantize_fp8_block(q, scale, torch.float32)
        scale_parts = []
        for rank in (0, 1):
            parallel = ParallelConfig(tp_size=2, tp_rank=rank)
            q_local = shard_tensor(name, q, placement, parallel)
            s_local = shard_tensor(scale_name, scale, placement, parallel, weight_shape=q.shape)
            s_inferred = shard_tensor(scale_name, scale, placement, parallel)
            assert torch.equal(s_local, s_inferred), scale_name
            bounds = shard_slice_bounds(q.shape, placement, parallel, name=name)
            deq_local = dequantize_fp8_block(q_local, s_local, torch.float32)
            assert torch.equal(deq_local, full_deq[bounds]), name
            scale_parts.append(s_local)
        assert torch.equal(reassemble(scale_name, scale_parts, placement), scale), scale_name


def test_fp8_scale_of_another_ranks_expert_is_skipped():
    name = "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"
    scale = torch.rand(2, 3)
    placement = placement_for("glm_moe_dsa", name)
    mine = ParallelConfig(ep_size=2, ep_rank=1)
    assert shard_tensor(name, scale, placement, ParallelConfig(ep_size=2), num_experts=4) is None
    assert torch.equal(shard_tensor(name, scale, placement, mine, num_experts=4), scale)


def test_fp8_misaligned_split_is_refused_naming_the_tensor():
    name = "model.layers.0.self_attn.q_b_proj.weight"
    q, scale = quantize_fp8_block(torch.randn(384, 128))  # 192 rows per rank: not on 128 blocks
    placement = placement_for("glm_moe_dsa", name)
    parallel = ParallelConfig(tp_size=2)
    with pytest.raises(UnsupportedModel, match=r"q_b_proj\.weight.*384.*192.*128"):
        shard_tensor(name, q, placement, parallel)
    with pytest.raises(UnsupportedModel, match=r"q_b_proj\.weight_scale_inv.*size 3"):
        shard_tensor(name + "_scale_inv", scale, placement, parallel)
    with pytest.raises(UnsupportedModel, match=r"q_b_proj\.weight.*384"):
        shard_tensor(name + "_scale_inv", scale, placement, parallel, weight_shape=q.shape)
    # the same split of a dense (bf16) tensor is fine
    assert shard_tensor(name, torch.randn(384, 128), placement, parallel).shape == (192, 128)


def test_fp8_partial_edge_block_is_checked_against_the_weight():
    name = "model.layers.0.self_attn.o_proj.weight"
    q, scale = quantize_fp8_block(torch.randn(64, 300))  # grid 1x3 divides by 3, weight 100s do not
    placement = placement_for("glm_moe_dsa", name)
    with pytest.raises(UnsupportedModel, match=r"o_proj\.weight.*300"):
        shard_tensor(
            name + "_scale_inv", scale, placement, ParallelConfig(tp_size=3), weight_shape=q.shape
        )
    with pytest.raises(CheckpointError, match="scale shape"):
        shard_tensor(
            name + "_scale_inv", scale, placement, ParallelConfig(), weight_shape=(64, 600)
        )


def test_indivisible_split_is_refused_naming_the_tensor():
    name = "model.layers.1.mlp.gate_proj.weight"
    placement = placement_for("llama", name)
    with pytest.raises(
        UnsupportedModel, match=r"layers\.1\.mlp\.gate_proj\.weight.*size 12.*tp_size=5"
    ):
        shard_tensor(name, torch.randn(FFN, HIDDEN), placement, ParallelConfig(tp_size=5))


def test_unknown_names_and_architectures_are_refused():
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.mystery\.weight"):
        placement_for("llama", "model.layers.0.mlp.mystery.weight")
    with pytest.raises(CheckpointError, match="q_b_proj"):
        placement_for("llama", "model.layers.0.self_attn.q_b_proj.weight")  # MLA name, llama arch
    with pytest.raises(CheckpointError, match="gate_projection"):
        placement_for("glm_moe_dsa", "model.layers.0.mlp.gate_projection.weight")
    with pytest.raises(UnsupportedModel, match="gpt2"):
        placement_for("gpt2", "lm_head.weight")


def test_parallel_config_and_heads_are_validated():
    with pytest.raises(BadRequest, match="tp_rank=2"):
        ParallelConfig(tp_size=2, tp_rank=2)
    with pytest.raises(BadRequest, match="ep_size=0"):
        ParallelConfig(ep_size=0)
    with pytest.raises(BadRequest, match="ep_dispatch='nccl': choose one of replicated, all_to_"):
        ParallelConfig(ep_size=2, ep_dispatch="nccl")
    validate_head_split(HEADS, KV_HEADS, ParallelConfig(tp_size=2))
    validate_head_split(HEADS, KV_HEADS, ParallelConfig(tp_size=4))  # k/v heads replicated
    with pytest.raises(UnsupportedModel, match="num_key_value_heads=3 and tp_size=2"):
        validate_head_split(HEADS, 3, ParallelConfig(tp_size=2))


def test_slice_bounds_read_only_the_rank_slice_from_safetensors(tmp_path):
    tensors = llama_tensors(num_layers=1)
    q, scale = quantize_fp8_block(torch.randn(256, 512))
    tensors["model.layers.0.mlp.down_proj.weight"] = q
    tensors["model.layers.0.mlp.down_proj.weight_scale_inv"] = scale
    path = tmp_path / "model.safetensors"
    save_file(tensors, path)
    parallel = ParallelConfig(tp_size=2, tp_rank=1)
    with safe_open(path, framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            lazy = f.get_slice(name)
            placement = placement_for("llama", name)
            fp8 = lazy.get_dtype() == "F8_E4M3"
            bounds = shard_slice_bounds(lazy.get_shape(), placement, parallel, name=name, fp8=fp8)
            expected = shard_tensor(name, tensors[name], placement, parallel)
            assert torch.equal(lazy[bounds].float(), expected.float()), name
