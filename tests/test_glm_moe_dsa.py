"""GLM-5 (`glm_moe_dsa`) parity with Hugging Face transformers, FP8, MTP loading and expert parallel.

The tiny model keeps `index_topk=5` against prompts of 20+ tokens, so DSA really drops keys
(checked: the dense model's logits differ), and routes 2 of 8 experts in 2 groups.
"""

from __future__ import annotations

import pytest
import torch

from snapfn.handler.llm.build import EngineOptions, build_model
from snapfn.handler.llm.config import ModelConfig
from snapfn.handler.llm.engine.batch import ForwardBatch
from snapfn.handler.llm.kernels import get_backend
from snapfn.handler.llm.kernels.torch_ref import (
    causal_attention,
    pick_causal_topk,
    select_topk,
    topk_mask,
)
from snapfn.handler.llm.models.base import ConcatLinear
from snapfn.handler.llm.parallel import ParallelConfig
from snapfn.handler.llm.weights.checkpoint import Checkpoint
from snapfn.handler.llm.weights.loader import load_weights
from snapfn.snapshot.errors import CheckpointError

from glm_checkpoints import (
    NOT_QUANTIZED,
    TINY_GLM,
    save_tiny_glm,
    write_fp8_pair,
    write_with_mtp,
)
from parity import (
    greedy,
    hf_logits,
    hf_model,
    our_engine,
    our_prefill_logits,
    random_prompts,
)

VOCAB = TINY_GLM["vocab_size"]


@torch.inference_mode()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """`parity.hf_greedy` with an explicit attention mask: without one, `generate` takes
    `pad_token_id=0` to mean every token 0 of the prompt is padding and masks it out."""
    x = torch.tensor([ids])
    out = model.generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
        do_sample=False, pad_token_id=0, eos_token_id=None,
    )  # fmt: skip
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
    return save_tiny_glm(tmp_path_factory.mktemp("glm"), seed=0)


@pytest.fixture(scope="module")
def glm_ref_logits(glm_dir):
    (ids,) = random_prompts(VOCAB, [23])
    return ids, hf_logits(hf_model(glm_dir), ids)


@pytest.mark.parametrize("chunk", [64, 5])
def test_logits_match_transformers(glm_dir, glm_ref_logits, chunk):
    ids, ref = glm_ref_logits
    ours = our_prefill_logits(our_engine(glm_dir, page_size=4), ids, chunk)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


def test_yarn_logits_match_transformers(tmp_path):
    """YaRN scales both the rotary cos/sin and (through `mscale_all_dim`) the softmax."""
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
            "mscale_all_dim": 0.707, "original_max_position_embeddings": 128}  # fmt: skip
    model_dir = save_tiny_glm(tmp_path, seed=5, rope_parameters=rope)
    (ids,) = random_prompts(VOCAB, [23], seed=5)
    ours = our_prefill_logits(our_engine(model_dir, page_size=4), ids, 5)
    torch.testing.assert_close(ours, hf_logits(hf_model(model_dir), ids), atol=2e-4, rtol=1e-4)


def test_sparse_attention_changes_the_logits(glm_dir, glm_ref_logits):
    """Guard against a vacuous parity test: with every key kept, the logits differ."""
    from transformers import AutoModelForCausalLM

    ids, sparse = glm_ref_logits
    dense_model = AutoModelForCausalLM.from_pretrained(
        glm_dir, dtype=torch.float32, index_topk=1024
    )
    dense = hf_logits(dense_model.eval(), ids)
    assert (dense[:5] - sparse[:5]).abs().max() < 1e-5  # fewer than topk keys: nothing dropped
    assert (dense[5:] - sparse[5:]).abs().max() > 1e-2


def test_batched_greedy_matches_transformers(glm_dir):
    prompts = random_prompts(VOCAB, [3, 21, 9, 30], seed=1)
    # a small token budget forces chunked prefill interleaved with decode
    results = our_engine(glm_dir, page_size=4, max_tokens=16).generate(prompts, greedy(32))
    hf = hf_model(glm_dir)
    for prompt, result in zip(prompts, results, strict=True):
        assert list(result.token_ids) == hf_greedy(hf, prompt, 32)


def test_tied_index_scores_do_not_depend_on_chunking(tmp_path):
    """One indexer head: a query whose head weight is negative scores every key <= 0, so the
    many keys relu() zeroes tie for the top; the selection must not follow the chunking."""
    model_dir = save_tiny_glm(tmp_path, seed=3, index_n_heads=1, index_topk=3)
    engine = our_engine(model_dir, page_size=4)
    (ids,) = random_prompts(VOCAB, [24], seed=4)
    whole = our_prefill_logits(engine, ids, 64)
    for chunk in (1, 5):
        torch.testing.assert_close(
            our_prefill_logits(engine, ids, chunk), whole, atol=2e-4, rtol=1e-4
        )


def _as_sets(picked: torch.Tensor) -> list[set[int]]:
    return [{i for i in row if i >= 0} | ({-1} if -1 in row else set()) for row in picked.tolist()]


def _tied_keys_cache():
    cache = torch.zeros(2, 4, 2)  # [pages, page_size, index_head_dim]
    keys = torch.tensor([[0.0, 1]] * 5 + [[1.0, 0]] + [[0.0, 1]] * 2)  # scores 0 0 0 0 0 1 0 0
    prefill = ForwardBatch.build([[0] * 8], [0], [[1, 0]], 4, "cpu", prompt_lens=[8])
    get_backend("torch").store_kv(cache, keys, prefill)
    q, w = torch.tensor([[[1.0, 0]]]).expand(8, 1, 2), torch.ones(8, 1)
    return cache, prefill, q, w


def test_the_stable_pick_pads_short_rows_and_keeps_earliest_ties():
    """The GPU's rule (`torch.topk` on CUDA; the Triton kernels' oracle): earlier keys first."""
    scores = torch.tensor([0.0] * 5 + [1.0] + [0.0] * 2)
    causal = torch.arange(8)[None, :] <= torch.arange(8)[:, None]
    picked = pick_causal_topk(scores.expand(8, 8).masked_fill(~causal, -torch.inf), 0, 3)
    short, ties, one = [{0, -1}, {0, 1, -1}], [{0, 1, 2}] * 3, [{5, 0, 1}] * 3
    assert _as_sets(picked) == short + ties + one
    decode = select_topk(scores.expand(2, 8).clone(), torch.tensor([8, 2]), 3)
    assert _as_sets(decode) == [one[0], short[1]]


def test_dsa_topk_on_a_cpu_breaks_ties_as_transformers_and_not_by_chunk():
    """On a CPU the torch backend picks what `torch.topk` picks over the row transformers'
    forward scores: a prompt position's row padded to the prompt's length, a generated one's
    keys so far; a prompt's tail chunk picks what the whole prompt picks."""
    backend = get_backend("torch")
    cache, prefill, q, w = _tied_keys_cache()
    picked = backend.dsa_topk(q, w, cache, prefill, topk=3, scale=1.0)
    scores = torch.tensor([0.0] * 5 + [1.0] + [0.0] * 2)
    for i, row in enumerate(picked.tolist()):
        hf_row = scores.masked_fill(torch.arange(8) > i, -torch.inf)  # [P], -inf after i
        want = {k for k in hf_row.topk(3).indices.tolist() if k <= i}
        assert {k for k in row if k >= 0} == want and row.count(-1) == 3 - len(want)
    tail = ForwardBatch.build([[0] * 3], [5], [[1, 0]], 4, "cpu", prompt_lens=[8])
    assert torch.equal(backend.dsa_topk(q[5:], w[5:], cache, tail, topk=3, scale=1.0), picked[5:])
    # generated positions (a prompt of 4): each a decode step's row, the keys so far
    decode = ForwardBatch.build([[0], [0]], [7, 4], [[1, 0], [1, 0]], 4, "cpu", prompt_lens=[4, 4])
    got = backend.dsa_topk(q[:2], w[:2], cache, decode, topk=3, scale=1.0)
    for row, n in zip(got.tolist(), (8, 5), strict=True):
        assert set(row) == set(scores[:n].topk(3).indices.tolist())


@pytest.mark.parametrize(("heads", "topk"), [(1, 2), (2, 3), (4, 4)])
def test_greedy_with_tied_index_scores_matches_transformers(tmp_path, heads, topk):
    """Few indexer heads: relu ties many keys at 0 at the cut, which `torch.topk` on a CPU
    breaks by its row's length; generations longer than `index_topk` then depend on it."""
    model_dir = save_tiny_glm(tmp_path, seed=5, index_n_heads=heads, index_topk=topk)
    prompts = random_prompts(VOCAB, [5, 17], seed=heads)
    results = our_engine(model_dir, page_size=4, max_tokens=8).generate(prompts, greedy(16))
    hf = hf_model(model_dir)
    for prompt, result in zip(prompts, results, strict=True):
        assert list(result.token_ids) == hf_greedy(hf, prompt, 16)


@pytest.mark.parametrize("sparse", [False, True])
def test_absorbed_mla_decode_equals_attention_over_expanded_latents(sparse):
    """The decode path folds kv_b into the query and the output; the prefill path expands every
    latent to per-head keys and values. One request's decode query must get the same output
    either way (dense, and restricted to a top-k selection)."""
    g = torch.Generator().manual_seed(8)
    heads, nope, rope, v_dim, rank, page = 3, 8, 4, 6, 16, 4
    seq_lens, width = [11, 5], 3  # tokens cached per request; page-table width
    cache = torch.randn(7, page, rank + rope, generator=g)
    kv_b = torch.randn(heads * (nope + v_dim), rank, generator=g) / rank**0.5
    q = torch.randn(2, heads, nope + rope, generator=g)
    pages = [[4, 1, 6], [2, 5]]
    batch = ForwardBatch.build([[0], [0]], [s - 1 for s in seq_lens], pages, page, "cpu")
    topk = torch.tensor([[0, 3, 10, 7], [4, 1, -1, -1]], dtype=torch.int32) if sparse else None
    backend = get_backend("torch")
    got = backend.mla_attention(q, cache, kv_b, None, batch, 0.3, topk)
    prefill_math = get_backend("torch")
    for b, seq_len in enumerate(seq_lens):
        latent = prefill_math.gather_seq(cache, batch, b)  # [L, R + Dr]
        k, v = prefill_math._expand_latent(latent, kv_b, None, q.shape)
        mask = None if topk is None else topk_mask(topk[b : b + 1], seq_len)
        want = causal_attention(q[b : b + 1], k, v, seq_len - 1, 0.3, mask)
        torch.testing.assert_close(got[b : b + 1], want, atol=1e-5, rtol=1e-5)
    assert batch.page_table.shape[1] == width


def test_fp8_checkpoint_matches_dequantized_weights(glm_dir, tmp_path):
    fp8_dir, dequant_dir = write_fp8_pair(glm_dir, tmp_path / "fp8", tmp_path / "dequant")
    engine = our_engine(fp8_dir, page_size=4)
    attn = engine.model.model.layers[1].self_attn
    assert attn.kv_b_proj.weight.dtype == torch.float8_e4m3fn
    assert engine.model.model.layers[1].mlp.experts.gate.dtype == torch.float8_e4m3fn
    assert engine.model.model.layers[0].self_attn.indexer.weights_proj.weight.dtype == torch.float32
    # q_a | kv_a | wk stacked in one FP8 weight, each part on its own 128-row scale blocks, the
    # rows between them zero (the tiny parts end inside a block)
    fused = engine.model.model.layers[0].self_attn.fused_qkv_a_proj
    spans = list(fused.part_spans.values())
    assert fused.weight.dtype == torch.float8_e4m3fn and len(spans) == 3
    assert all(first % 128 == 0 for first, _ in spans), spans
    padding = [slice(stop, nxt) for (_, stop), (nxt, _) in zip(spans, spans[1:], strict=False)]
    assert any(gap.stop > gap.start for gap in padding), spans
    assert all(not fused.weight[gap].float().any() for gap in padding)
    assert fused.weight_scale_inv.shape[0] == fused.weight.shape[0] // 128
    # so are q_b | wq_b, which read the normed query latent (the norm inside their GEMV)
    fused = engine.model.model.layers[0].self_attn.fused_q_b_proj
    assert fused.weight.dtype == torch.float8_e4m3fn
    assert list(fused.part_spans) == ["q_b_proj", "indexer.wq_b"]
    assert list(engine.model.model.layers[1].self_attn.fused_q_b_proj.part_spans) == ["q_b_proj"]
    (ids,) = random_prompts(VOCAB, [22], seed=2)
    ours = our_prefill_logits(engine, ids, 5)
    torch.testing.assert_close(ours, hf_logits(hf_model(dequant_dir), ids), atol=2e-4, rtol=1e-4)


def test_fp8_attention_with_a_16_bit_indexer_keeps_the_parts_apart(glm_dir, tmp_path):
    """An indexer left out of FP8 cannot share the attention's FP8 weights: its `wk` and
    `wq_b` run beside them (`ConcatLinear`), and the logits still match."""
    keep = ("indexer.wk", "indexer.wq_b")
    fp8_dir, dequant_dir = write_fp8_pair(
        glm_dir, tmp_path / "fp8", tmp_path / "dequant", NOT_QUANTIZED + keep
    )
    engine = our_engine(fp8_dir, page_size=4)
    attn = engine.model.model.layers[0].self_attn
    for fused, part in (
        (attn.fused_qkv_a_proj, "indexer.wk"),
        (attn.fused_q_b_proj, "indexer.wq_b"),
    ):
        assert isinstance(fused, ConcatLinear) and part in fused.part_spans
        assert fused.parts[ConcatLinear.key(part)].weight.dtype == torch.float32
    assert attn.fused_q_b_proj.parts["q_b_proj"].weight.dtype == torch.float8_e4m3fn
    (ids,) = random_prompts(VOCAB, [22], seed=2)
    ours = our_prefill_logits(engine, ids, 5)
    torch.testing.assert_close(ours, hf_logits(hf_model(dequant_dir), ids), atol=2e-4, rtol=1e-4)


def test_attention_biases_keep_wk_apart_and_match(tmp_path):
    """With `attention_bias`, `q_a` and `kv_a` carry biases that the indexer's `wk` lacks, so
    `wk` runs apart; `q_b` and `wq_b` have none either way and stay stacked."""
    model_dir = save_tiny_glm(tmp_path / "bias", seed=4, attention_bias=True)
    engine = our_engine(model_dir, page_size=4)
    attn = engine.model.model.layers[0].self_attn
    assert "indexer.wk" not in attn.fused_qkv_a_proj.part_spans and hasattr(attn.indexer, "wk")
    assert list(attn.fused_q_b_proj.part_spans) == ["q_b_proj", "indexer.wq_b"]
    assert attn.fused_q_b_proj.bias is None
    (ids,) = random_prompts(VOCAB, [22], seed=2)
    ours = our_prefill_logits(engine, ids, 5)
    torch.testing.assert_close(ours, hf_logits(hf_model(model_dir), ids), atol=2e-4, rtol=1e-4)


def test_mtp_layer_is_loaded(glm_dir, tmp_path):
    mtp = write_with_mtp(glm_dir, tmp_path / "mtp")
    engine = our_engine(tmp_path / "mtp", page_size=4)
    layer = engine.model.mtp[0]
    assert torch.equal(layer.eh_proj.weight, mtp["model.layers.4.eh_proj.weight"])
    assert torch.equal(layer.shared_head.norm.weight, mtp["model.layers.4.shared_head.norm.weight"])
    assert torch.equal(
        layer.mlp.experts.down[6], mtp["model.layers.4.mlp.experts.6.down_proj.weight"]
    )
    wk = mtp["model.layers.4.self_attn.indexer.wk.weight"]
    fused = layer.self_attn.fused_qkv_a_proj  # wk's rows of the stacked input projections
    first, stop = fused.part_spans["indexer.wk"]
    assert torch.equal(fused.weight[first:stop], wk)
    # the MTP layer is not run: the main model's logits are unchanged
    (ids,) = random_prompts(VOCAB, [9], seed=3)
    plain = our_prefill_logits(our_engine(glm_dir), ids, 4)
    torch.testing.assert_close(our_prefill_logits(engine, ids, 4), plain, atol=0, rtol=0)


def test_step_weights_count_the_experts_a_step_routes_to_and_skip_mtp(glm_dir, tmp_path):
    from snapfn.handler.llm.engine.memory import step_weights

    write_with_mtp(glm_dir, tmp_path / "mtp")
    model = our_engine(tmp_path / "mtp", page_size=4).model
    moe = model.config.moe
    share = moe.num_experts_per_tok / moe.n_routed_experts
    sizes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    experts = sum(b for n, b in sizes.items() if ".mlp.experts." in n and n.startswith("model."))
    dense = (
        sum(b for n, b in sizes.items() if n.startswith(("model.", "lm_head")) and "embed" not in n)
        - experts
    )
    assert any(n.startswith("mtp.") for n in sizes) and experts > 0
    for batch in (1, 3, 1000):
        read, _ = step_weights(model, batch)
        assert abs(read - (dense + experts * (1 - (1 - share) ** batch))) <= 1
    assert step_weights(model, 1000)[0] == dense + experts  # every expert, no MTP, no embedding


def test_missing_mtp_tensor_fails_coverage(glm_dir, tmp_path):
    write_with_mtp(glm_dir, tmp_path / "mtp", drop=("model.layers.4.enorm.weight",))
    with pytest.raises(CheckpointError, match=r"not filled.*mtp\.0\.enorm\.weight"):
        our_engine(tmp_path / "mtp")


def test_mtp_tensors_without_mtp_config_are_refused(glm_dir, tmp_path):
    import json

    write_with_mtp(glm_dir, tmp_path / "mtp")
    config_path = tmp_path / "mtp" / "config.json"
    config_path.write_text(
        json.dumps({**json.loads(config_path.read_text()), "num_nextn_predict_layers": 0})
    )
    with pytest.raises(CheckpointError, match=r"does not use.*model\.layers\.4\."):
        our_engine(tmp_path / "mtp")


def test_expert_parallel_loads_only_local_experts(glm_dir):
    config = ModelConfig.from_dir(glm_dir)
    parallel = ParallelConfig(ep_size=2, ep_rank=1)
    model = build_model(config, EngineOptions(dtype="float32", parallel=parallel))
    ckpt = Checkpoint.open(glm_dir)
    report = load_weights(model, ckpt)
    experts = model.model.layers[2].mlp.experts
    assert experts.gate.shape[0] == 4 and experts.experts == range(4, 8)
    want = ckpt.read(["model.layers.2.mlp.experts.5.up_proj.weight"])
    assert torch.equal(experts.up[1], want["model.layers.2.mlp.experts.5.up_proj.weight"])
    # experts 0-3 of the 3 MoE layers, 3 projections each, belong to rank 0
    assert len(report.other_rank) == 3 * 4 * 3
    assert all(".experts.4." not in name for name in report.other_rank)


def test_kv_buffers_hold_latent_everywhere_and_index_keys_on_full_layers(glm_dir):
    model = build_model(ModelConfig.from_dir(glm_dir), EngineOptions(dtype="bfloat16"))
    specs = {s.name: s for s in model.kv_buffer_specs()}
    assert specs["latent"].num_layers == 4 and specs["latent"].token_shape == (32 + 8,)
    assert specs["index_k"].num_layers == 2 and specs["index_k"].token_shape == (32,)
    assert model.index_slots == (0, None, 1, None)
    # HF keeps the indexer's weights_proj and the router in float32 whatever the model dtype
    assert model.model.layers[2].self_attn.indexer.weights_proj.weight.dtype == torch.float32
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32


@pytest.mark.parametrize(
    "overrides",
    [
        {"n_shared_experts": 0},  # transformers writes the shared experts as empty tensors
        # transformers' modeling follows mlp_layer_types over first_k_dense_replace
        {"mlp_layer_types": ["dense", "dense", "sparse", "sparse"], "first_k_dense_replace": 1},
    ],
    ids=["no-shared-experts", "mlp-layer-types"],
)
def test_configurations_transformers_writes_match_it(tmp_path, overrides):
    model_dir = save_tiny_glm(tmp_path / "glm", seed=6, **overrides)
    (ids,) = random_prompts(256, [19], seed=1)
    ours = our_prefill_logits(our_engine(model_dir), ids, 64)
    torch.testing.assert_close(ours, hf_logits(hf_model(model_dir), ids), atol=2e-4, rtol=1e-4)


def test_declared_mtp_layers_without_weights_build_a_model_without_them(tmp_path):
    """transformers saves GLM without its MTP layers, whatever `num_nextn_predict_layers` says:
    the model is the main one (transformers' logits), speculation is refused in one line, and
    a snapshot of it restores the same model."""
    from snapfn.handler.llm.init_config import InitConfig
    from snapfn.handler.llm.recipes.function import LLMFunction
    from snapfn.snapshot.errors import UnsupportedModel
    from snapfn.snapshot.runtime import init_and_snapshot, restore

    model_dir = save_tiny_glm(tmp_path / "glm", seed=7, num_nextn_predict_layers=1)
    assert not any(".layers.4." in n for n in Checkpoint.open(model_dir).tensors)
    engine = our_engine(model_dir)
    assert engine.model.config.num_mtp_layers == 0 and len(engine.model.mtp) == 0
    (ids,) = random_prompts(VOCAB, [19], seed=1)
    torch.testing.assert_close(
        our_prefill_logits(engine, ids, 64),
        hf_logits(hf_model(model_dir), ids),
        atol=2e-4,
        rtol=1e-4,
    )
    with pytest.raises(UnsupportedModel, match="declares 1 .* but holds none of their weights"):
        our_engine(model_dir, speculative_tokens=2)
    config = InitConfig(page_size=4, kv_cache_bytes_cpu=1 << 20, cache_dir=tmp_path / "cache")
    cold = LLMFunction(config, model_dir)
    startup = init_and_snapshot(cold, tmp_path / "snap", log=None)
    assert startup.stage("load_weights").figures["mtp_layers"] == "1 declared, 0 in the checkpoint"
    fn, restored = restore(lambda: LLMFunction(config, model_dir), tmp_path / "snap", log=None)
    assert restored.tier == "portable" and not restored.fallbacks
    assert fn.health == cold.health and fn.model.config.num_mtp_layers == 0
