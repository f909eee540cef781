"""The all-to-all exchange alone (`models/expert_exchange.py`), on two gloo ranks: each rank's
tokens come back with the sum over all their experts, wherever those live, in float32 and in
bf16 (whose messages carry the ids and weights as float32 bits), and with a rank that sends
nothing. The experts are a stand-in whose output says which experts ran on which rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ranks import join_group, run_ranks

from snapfn.handler.llm.models.expert_exchange import AllToAllExchange, make_exchange
from snapfn.handler.llm.parallel import ParallelConfig

NUM_EXPERTS, TOPK, HIDDEN = 8, 3, 16
TOKENS = {"float32": (5, 7), "bfloat16": (6, 3), "one_sends_nothing": (4, 0)}  # per rank


def stand_in_experts(first: int, count: int):
    """`backend.moe`'s contract for experts `[first, first + count)`: each row's weighted sum
    over those of its experts held here, expert e scaling the row by e + 1."""

    def experts(x, topk_ids, topk_weights):
        local = (topk_ids >= first) & (topk_ids < first + count)
        factor = ((topk_ids + 1) * topk_weights * local).sum(dim=1, keepdim=True)  # [T, 1]
        return (x.float() * factor).to(x.dtype)

    return experts


def inputs(case: str, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + len(case))
    tokens = TOKENS[case][rank]
    dtype = torch.bfloat16 if case == "bfloat16" else torch.float32
    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    rows = [torch.randperm(NUM_EXPERTS, generator=gen)[:TOPK] for _ in range(tokens)]
    ids = torch.stack(rows) if rows else torch.zeros(0, TOPK, dtype=torch.int64)
    weights = torch.rand(tokens, TOPK, generator=gen)
    return x, ids, weights


def _rank(rank: int, world: int, port: int, out_dir: str) -> None:
    join_group(rank, world, port)
    try:
        parallel = ParallelConfig(ep_size=2, ep_rank=rank, ep_dispatch="all_to_all")
        exchange = make_exchange(parallel, NUM_EXPERTS)
        assert isinstance(exchange, AllToAllExchange) and exchange.lockstep
        per_rank = NUM_EXPERTS // 2
        mine = stand_in_experts(rank * per_rank, per_rank)
        result = {}
        for case in TOKENS:
            x, ids, weights = inputs(case, rank)
            out = exchange(x, ids, weights, mine)
            result[case] = {"dtype": str(out.dtype), "shape": list(out.shape)}
            result[case]["out"] = out.float().tolist()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_all_to_all_returns_each_token_summed_over_all_its_experts(tmp_path):
    run_ranks(_rank, 2, str(tmp_path), timeout_s=120)
    every_expert = stand_in_experts(0, NUM_EXPERTS)
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for case in TOKENS:
            x, ids, weights = inputs(case, rank)
            want = every_expert(x, ids, weights)
            assert got[case]["dtype"] == str(x.dtype) and got[case]["shape"] == list(x.shape)
            # bf16: each rank's sum is rounded once before the combine adds them in float32
            tol = 2e-2 if x.dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(
                torch.tensor(got[case]["out"]).reshape(x.shape), want.float(), rtol=tol, atol=tol
            )


def test_ep_size_one_needs_no_exchange_and_tp_with_ep_is_replicated_only():
    from snapfn.handler.llm.models.expert_exchange import ReplicatedExchange
    from snapfn.snapshot.errors import BadRequest

    assert make_exchange(ParallelConfig(), NUM_EXPERTS) is None
    tp_ep = ParallelConfig(tp_size=2, ep_size=2)
    assert isinstance(make_exchange(tp_ep, NUM_EXPERTS), ReplicatedExchange)
    for dispatch in ("all_to_all", "deepep"):
        with pytest.raises(BadRequest, match="tensor parallel runs every token on every rank"):
            make_exchange(ParallelConfig(tp_size=2, ep_size=2, ep_dispatch=dispatch), NUM_EXPERTS)
