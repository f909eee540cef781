"""Tensor parallel on CPU ranks over gloo: two and four ranks, each holding its share of every
layer's heads and columns and of the vocabulary, generate what one rank does — on tiny
checkpoints written by transformers (llama with llama3 RoPE, qwen2 with q/k/v biases, qwen3 with
q/k norms and tied embeddings, GLM-5's `glm_moe_dsa`, alone and with expert parallel), k/v heads
split or (fewer of them than ranks) replicated. `snapfn generate --tp-size 2` starts its own
ranks and prints what one rank prints; a rank killed mid-run takes the group down."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch.distributed as dist
from ranks import join_group, run_ranks

from snapfn.handler.llm.build import EngineOptions, build_engine
from snapfn.handler.llm.engine.engine import SchedulerConfig
from snapfn.handler.llm.engine.request import SamplingParams
from snapfn.handler.llm.parallel import ParallelConfig
from snapfn.handler.llm.ranks import rank_layout
from snapfn.handler.llm.weights.sharding import (
    KV_HEADS,
    local_kv_heads,
    shard_slice_bounds,
    validate_head_split,
)
from snapfn.snapshot.errors import BadRequest, UnsupportedModel

from glm_checkpoints import save_tiny_glm

PROMPTS = [[5, 17, 3, 9, 12, 40, 7, 2], [30, 1, 4], [8, 8, 21, 6, 19, 23, 2, 9, 10, 11]]
SAMPLED = SamplingParams(max_new_tokens=6, temperature=0.9, top_k=20, ignore_eos=True)


def generate(model_dir: Path, parallel: ParallelConfig, sampled: bool = False, k: int = 0) -> dict:
    opts = EngineOptions(
        device="cpu",
        dtype="float32",
        num_pages=64,
        parallel=parallel,
        scheduler=SchedulerConfig(page_size=4, max_num_batched_tokens=256, speculative_tokens=k),
    )
    engine = build_engine(model_dir, opts).engine
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    results = engine.generate(PROMPTS, SAMPLED if sampled else params)
    runs = [{"tokens": list(r.token_ids), "logprobs": list(r.logprobs)} for r in results]
    vocab_rows = engine.model.model.embed_tokens.num_embeddings
    return {"runs": runs, "vocab_rows": vocab_rows, "speculative": engine.spec_stats()}


def _rank(rank: int, world: int, port: int, model_dir: str, out: str, tp: int, ep: int) -> None:
    join_group(rank, world, port)
    try:
        parallel = rank_layout(tp, ep, rank, "replicated")
        result = {"greedy": generate(Path(model_dir), parallel)}
        result["sampled"] = generate(Path(model_dir), parallel, sampled=True)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _check_ranks(model_dir: Path, tmp_path: Path, tp: int, ep: int = 1) -> None:
    run_ranks(_rank, tp * ep, str(model_dir), str(tmp_path), tp, ep)
    one = generate(model_dir, ParallelConfig())
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(tp * ep)]
    for got in ranks:
        assert got["greedy"]["vocab_rows"] == -(-one["vocab_rows"] // tp)  # its share only
        for mine, theirs in zip(got["greedy"]["runs"], one["runs"], strict=True):
            assert mine["tokens"] == theirs["tokens"]
            for a, b in zip(mine["logprobs"], theirs["logprobs"], strict=True):
                assert abs(a - b) < 1e-4, (a, b)
        # a sampled draw is rank 0's everywhere, so the ranks' requests stay together
        tokens = [r["tokens"] for r in got["sampled"]["runs"]]
        assert tokens == [r["tokens"] for r in ranks[0]["sampled"]["runs"]]


@pytest.fixture(scope="module")
def odd_llama_dir(tmp_path_factory):
    """transformers' own test sizes: a vocabulary of 99 (no split divides it) and one k/v
    head (multi-query attention: replicated on every rank)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import save_tiny

    return save_tiny(
        tmp_path_factory, "odd", 4, LlamaConfig, LlamaForCausalLM,
        vocab_size=99, num_key_value_heads=1, intermediate_size=64, tie_word_embeddings=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
    return save_tiny_glm(tmp_path_factory.mktemp("tp") / "glm", seed=3)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_two_tensor_parallel_ranks_generate_what_one_rank_does(fixture, request, tmp_path):
    _check_ranks(request.getfixturevalue(fixture), tmp_path, tp=2)


@pytest.mark.parametrize("tp", [2, 4])
def test_a_vocabulary_no_split_divides_and_one_kv_head(odd_llama_dir, tmp_path, tp):
    """99 tokens over 2 or 4 ranks: blocks of 50 or 25, the last short and zero-padded (its
    padding's logits dropped); the single k/v head on every rank."""
    _check_ranks(odd_llama_dir, tmp_path, tp=tp)


@pytest.mark.slow
def test_four_ranks_replicate_the_two_kv_heads(tiny_llama_dir, tmp_path):
    """4 q heads and 2 k/v heads over 4 ranks: each rank holds one q head and the k/v head it
    reads (`local_kv_heads`)."""
    _check_ranks(tiny_llama_dir, tmp_path, tp=4)


def test_glm_moe_dsa_at_tp_2_generates_what_one_rank_does(glm_dir, tmp_path):
    """MLA's heads split (q_b, kv_b, o_proj), its low-rank inputs and the DSA indexer
    replicated, each routed expert's intermediate columns split across the ranks."""
    _check_ranks(glm_dir, tmp_path, tp=2)


def _speculating_rank(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    join_group(rank, world, port)
    try:
        parallel = rank_layout(world, 1, rank, "replicated")
        result = {"greedy": generate(Path(model_dir), parallel, k=2)}
        result["sampled"] = generate(Path(model_dir), parallel, sampled=True, k=2)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_glm_moe_dsa_at_tp_2_speculates_what_one_rank_decodes(glm_dir, tmp_path):
    """MTP speculative decoding on two ranks (the MTP layer split as the others are): greedy
    requests draft and give one plain rank's tokens; sampled ones, not drafted there (a draw
    is each rank's own), stay together on rank 0's draws."""
    from glm_checkpoints import write_with_mtp

    model = tmp_path / "mtp"
    write_with_mtp(glm_dir, model)
    run_ranks(_speculating_rank, 2, str(model), str(tmp_path))
    one = generate(model, ParallelConfig())
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for got in ranks:
        for mine, theirs in zip(got["greedy"]["runs"], one["runs"], strict=True):
            assert mine["tokens"] == theirs["tokens"]
            for a, b in zip(mine["logprobs"], theirs["logprobs"], strict=True):
                assert abs(a - b) < 1e-4, (a, b)
        assert got["greedy"]["speculative"]["draft_tokens"] > 0
        assert got["sampled"]["speculative"]["draft_tokens"] == 0
        tokens = [r["tokens"] for r in got["sampled"]["runs"]]
        assert tokens == [r["tokens"] for r in ranks[0]["sampled"]["runs"]]
    assert ranks[0]["greedy"]["speculative"] == ranks[1]["greedy"]["speculative"]


@pytest.mark.slow
def test_glm_moe_dsa_at_tp_2_times_ep_2_generates_what_one_rank_does(glm_dir, tmp_path):
    """Four ranks: attention and dense layers split over each tp pair, the routed experts over
    each ep pair (whole experts, their shares all-reduced within the ep group)."""
    _check_ranks(glm_dir, tmp_path, tp=2, ep=2)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "glm_dir"])
def test_building_a_model_draws_no_random_numbers(fixture, request):
    """Parameters are made empty for the loader or the stream to fill: nothing initialises
    them (nn.Embedding's own init drew a normal over the whole table, seconds for an 8B)."""
    import torch

    from snapfn.handler.llm.build import build_model
    from snapfn.handler.llm.config import ModelConfig

    config = ModelConfig.from_dir(request.getfixturevalue(fixture))
    before = torch.get_rng_state()
    model = build_model(config, EngineOptions(device="cpu", dtype="float32"))
    assert torch.equal(torch.get_rng_state(), before)
    embedding = model.model.embed_tokens
    assert embedding.weight.shape == (embedding.num_embeddings, config.hidden_size)
    assert not embedding.weight.requires_grad


def test_the_rank_layout_puts_tp_ranks_side_by_side():
    layouts = [rank_layout(2, 2, r, "replicated") for r in range(4)]
    assert [(p.ep_rank, p.tp_rank) for p in layouts] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_kv_heads_split_whole_or_replicate_and_other_counts_are_refused():
    assert [local_kv_heads(8, tp) for tp in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]
    with pytest.raises(UnsupportedModel, match="neither divides the other"):
        local_kv_heads(6, 4)
    with pytest.raises(UnsupportedModel, match="num_attention_heads=6 does not divide"):
        validate_head_split(6, 2, ParallelConfig(tp_size=4))
    # 2 k/v heads of 16 rows over 4 ranks: ranks 0, 1 hold head 0, ranks 2, 3 head 1
    rows = [
        shard_slice_bounds(
            (32, 64), KV_HEADS, ParallelConfig(tp_size=4, tp_rank=r), name="k", num_kv_heads=2
        )[0]
        for r in range(4)
    ]
    assert [(s.start, s.stop) for s in rows] == [(0, 16), (0, 16), (16, 32), (16, 32)]


def test_an_engine_without_its_ranks_says_what_it_needs(tiny_llama_dir):
    opts = EngineOptions(device="cpu", num_pages=8, parallel=ParallelConfig(tp_size=2))
    engine = build_engine(tiny_llama_dir, opts).engine  # loads one rank's share
    with pytest.raises(BadRequest, match="tp_size=2 x ep_size=1 needs torch.distributed"):
        engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=1))


def _generate_cli(model_dir: Path, *extra: str, **popen) -> subprocess.Popen:
    argv = [sys.executable, "-m", "snapfn.handler.cli", "generate", "--model", str(model_dir)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return subprocess.Popen(
        [*argv, "--prompt-ids", "5,17,3,9", "--json", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        **popen,
    )


def test_generate_starts_its_own_ranks_and_prints_what_one_rank_does(tiny_llama_dir):
    runs = {}
    for tp in ("1", "2"):
        proc = _generate_cli(tiny_llama_dir, "--max-new-tokens", "8", "--tp-size", tp)
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        runs[tp] = json.loads(out)
    assert runs["2"]["token_ids"] == runs["1"]["token_ids"]
    assert "starting ranks 1-1 of 2" in err and "(tp 2)" in err


def test_a_rank_that_dies_takes_the_group_down(tiny_llama_dir):
    proc = _generate_cli(
        tiny_llama_dir, "--max-new-tokens", "400", "--ignore-eos", "--tp-size", "2"
    )
    try:
        deadline, child = time.monotonic() + 120, None
        while child is None and time.monotonic() < deadline:
            kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            child = int(kids[0]) if kids else None
            time.sleep(0.2)
        assert child is not None, "rank 1 never started"
        time.sleep(3)  # into the generation
        os.kill(child, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode in (1, 2), err[-2000:]  # RankFailed (2), or the watch's exit (1)
    assert f"rank 1 exited with status {-signal.SIGKILL}: the group is down" in err
    assert "Traceback" not in err


def test_the_vocabulary_splits_in_blocks_the_last_short_or_empty():
    from snapfn.handler.llm.weights.sharding import vocab_split

    assert [vocab_split(99, 4, r) for r in range(4)] == [
        (0, 25, 25), (25, 25, 25), (50, 25, 25), (75, 24, 25)
    ]  # fmt: skip
    assert [vocab_split(5, 4, r)[:2] for r in range(4)] == [(0, 2), (2, 2), (4, 1), (5, 0)]


def test_groups_made_in_a_destroyed_world_are_not_handed_to_a_new_one(tmp_path):
    """The groups' caches are keyed by the world's `id`, which a new world can take once the
    old one is gone (a rank 0 that leaves its group and starts another in the same process):
    an entry made in another world object is made again."""
    from snapfn.handler.llm.models import tensor_parallel

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:

        class Destroyed:  # a world gone, whose id this one took
            pass

        world = dist.group.WORLD
        cache = {(1, 1, id(world)): (weakref.ref(Destroyed()), "a destroyed world's groups")}
        assert tensor_parallel._made_once(cache, (1, 1), lambda: "this world's") == "this world's"
        assert tensor_parallel._made_once(cache, (1, 1), lambda: "made twice") == "this world's"
    finally:
        dist.destroy_process_group()
