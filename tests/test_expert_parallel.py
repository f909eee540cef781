"""Expert parallel: two ranks, each holding half of the routed experts, generate the same greedy
tokens as one rank holding them all — on CPU over gloo, and on two GPUs over NCCL (the path used
where DeepEP is not installed; skipped on machines with fewer than two GPUs).

Both exchanges (`models/expert_exchange.py`): "replicated" (both ranks run the same prompts)
and "all_to_all" (each rank runs its own prompts, one rank finishing early or having none, and
gets what one rank alone gives for them)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ranks import join_group, run_ranks

from snapfn.handler.llm.build import EngineOptions, build_engine
from snapfn.handler.llm.engine.engine import SchedulerConfig
from snapfn.handler.llm.engine.request import SamplingParams
from snapfn.handler.llm.make_model.build import make_model
from snapfn.handler.llm.parallel import ParallelConfig
from snapfn.snapshot.errors import BadRequest

PROMPTS = [[5, 17, 3, 9, 12, 40, 7, 2], [30, 1, 4], [8, 8, 21, 6, 19, 23, 2, 9, 10, 11]]


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
    return make_model("glm-tiny", tmp_path_factory.mktemp("ep") / "glm", dtype="bf16", seed=11)


# all_to_all: what each rank runs, (prompts, max_new_tokens) per rank, scenario by scenario
RANK_WORK = {
    "uneven": [(PROMPTS[:2], 8), (PROMPTS[2:], 3)],  # rank 1 finishes first, then idles
    "one_idle": [(PROMPTS, 6), ([], 6)],  # rank 1 has no requests at all
}


def generate(
    model_dir: Path,
    parallel: ParallelConfig,
    device: str = "cpu",
    prompts: list[list[int]] = PROMPTS,
    max_new_tokens: int = 8,
    backend: str = "auto",
    dtype: str = "float32",
) -> list[dict]:
    opts = EngineOptions(
        device=device,
        dtype=dtype,
        backend=backend,
        num_pages=64,
        parallel=parallel,
        scheduler=SchedulerConfig(page_size=4, max_num_batched_tokens=256),
    )
    engine = build_engine(model_dir, opts).engine
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    results = engine.generate(prompts, params)
    return [{"tokens": list(r.token_ids), "logprobs": list(r.logprobs)} for r in results]


def _rank(
    rank: int,
    world: int,
    port: int,
    model_dir: str,
    out_dir: str,
    cuda: bool,
    dispatch: str,
    dtype: str = "float32",
) -> None:
    device = f"cuda:{rank}" if cuda else "cpu"
    if dispatch == "deepep" and not cuda:  # DeepEP's contract over gloo (fake_deep_ep.py)
        import fake_deep_ep

        sys.modules["deep_ep"] = fake_deep_ep
    join_group(rank, world, port, cuda)
    try:
        parallel = ParallelConfig(ep_size=world, ep_rank=rank, ep_dispatch=dispatch)
        if dispatch == "replicated":
            result = generate(Path(model_dir), parallel, device)
        else:
            result = {
                name: generate(Path(model_dir), parallel, device, *work[rank], dtype=dtype)
                for name, work in RANK_WORK.items()
            }
            opts = EngineOptions(device, dtype=dtype, num_pages=16, parallel=parallel)
            engine = build_engine(Path(model_dir), opts).engine
            try:
                engine.capture_graphs([1], 64)
            except BadRequest as e:
                result["graphs"] = str(e)
            if dispatch == "deepep":
                result["buffers"] = sys.modules["deep_ep"].Buffer.created
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _triton_rank(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    """An all_to_all rank on the triton backend, its kernels interpreted on the CPU."""
    os.environ["TRITON_INTERPRET"] = "1"  # NOTE: before this process first imports triton
    join_group(rank, world, port)
    try:
        parallel = ParallelConfig(ep_size=world, ep_rank=rank, ep_dispatch="all_to_all")
        prompts, max_new = RANK_WORK["uneven"][rank]
        result = generate(Path(model_dir), parallel, "cpu", prompts, max_new, backend="triton")
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_all_to_all_ranks_on_the_triton_kernels_generate_what_one_rank_does(glm_dir, tmp_path):
    """The MoE kernels (`triton.moe`: one token's GEMVs, the sorted-pair tiles) on the rows an
    exchange dispatched, whose other ids belong to other ranks, and a rank that got none."""
    run_ranks(_triton_rank, 2, str(glm_dir), str(tmp_path))
    for r in range(2):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        _assert_same(got, generate(glm_dir, ParallelConfig(), "cpu", *RANK_WORK["uneven"][r]))


@pytest.mark.parametrize("dispatch", ["replicated", "all_to_all"])
def test_two_expert_parallel_ranks_generate_what_one_rank_does(glm_dir, tmp_path, dispatch):
    _check_two_ranks(glm_dir, tmp_path, cuda=False, dispatch=dispatch)


def test_deepep_ranks_generate_what_all_to_all_ranks_do(glm_dir, tmp_path):
    """`DeepEPExchange` against `fake_deep_ep`, DeepEP's contract over gloo."""
    _check_deepep(glm_dir, tmp_path, cuda=False)


def test_deepep_refuses_float32_rows():
    import fake_deep_ep

    from snapfn.handler.llm.models.expert_exchange import DeepEPExchange

    parallel = ParallelConfig(ep_size=2, ep_rank=0, ep_dispatch="deepep")
    exchange = DeepEPExchange(parallel, 8, fake_deep_ep)
    x, ids, weights = torch.zeros(3, 16), torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, 2)
    with pytest.raises(BadRequest, match="'deepep' moves bf16 rows .* not torch.float32"):
        exchange(x, ids, weights, lambda *a: pytest.fail("experts ran"))


def test_deepep_without_deep_ep_says_how_to_get_it(glm_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # import deep_ep raises ImportError
    with pytest.raises(BadRequest, match="ep_dispatch='deepep' needs DeepEP"):
        generate(glm_dir, ParallelConfig(ep_size=2, ep_rank=0, ep_dispatch="deepep"))


NO_DEEP_EP = importlib.util.find_spec("deep_ep") is None


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL between them)")
@pytest.mark.parametrize("dispatch", ["replicated", "all_to_all"])
def test_two_ranks_on_two_gpus_over_nccl_generate_what_one_gpu_does(glm_dir, tmp_path, dispatch):
    _check_two_ranks(glm_dir, tmp_path, cuda=True, dispatch=dispatch)


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NVLink between them)"
)
@pytest.mark.skipif(NO_DEEP_EP, reason="DeepEP (deep_ep) is not installed")
def test_deepep_on_two_gpus_generates_what_all_to_all_does(glm_dir, tmp_path):
    _check_deepep(glm_dir, tmp_path, cuda=True)


def _check_deepep(glm_dir: Path, tmp_path: Path, cuda: bool) -> None:
    """Two bf16 ranks (DeepEP moves bf16 rows) with `deepep` against two with `all_to_all`:
    the same arithmetic (each rank's experts summed there, the ranks' sums added in float32,
    rounded once), so the same tokens; in both, the scenarios of `RANK_WORK`."""
    for dispatch in ("all_to_all", "deepep"):
        (tmp_path / dispatch).mkdir()
        run_ranks(_rank, 2, str(glm_dir), str(tmp_path / dispatch), cuda, dispatch, "bfloat16")
    for r in range(2):
        want, got = (
            json.loads((tmp_path / d / f"rank{r}.json").read_text())
            for d in ("all_to_all", "deepep")
        )
        for name in RANK_WORK:
            _assert_same(got[name], want[name], logprob_atol=1e-2)  # bf16: row order may vary
        assert "a CUDA graph cannot hold" in got["graphs"]
        # one buffer a model, its MoE layers sharing it: the two engines that generated (the
        # graph one never ran a forward); a buffer a layer would be 6 or more
        assert got["buffers"] == 2, got["buffers"]


def _check_two_ranks(glm_dir: Path, tmp_path: Path, cuda: bool, dispatch: str) -> None:
    device = "cuda:0" if cuda else "cpu"
    run_ranks(_rank, 2, str(glm_dir), str(tmp_path), cuda, dispatch)
    for r in range(2):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        if dispatch == "replicated":
            _assert_same(got, generate(glm_dir, ParallelConfig(), device))
            continue
        for name, work in RANK_WORK.items():
            _assert_same(got[name], generate(glm_dir, ParallelConfig(), device, *work[r]))
        assert "a CUDA graph cannot hold" in got["graphs"]  # refused before any capture


def _assert_same(got: list[dict], want: list[dict], logprob_atol: float = 1e-4) -> None:
    assert len(got) == len(want)
    for mine, theirs in zip(got, want, strict=True):
        assert mine["tokens"] == theirs["tokens"]
        diffs = [abs(a - b) for a, b in zip(mine["logprobs"], theirs["logprobs"], strict=True)]
        assert max(diffs, default=0.0) < logprob_atol, diffs  # the experts' sum in another order


def test_expert_parallel_without_a_process_group_says_what_is_missing(glm_dir):
    assert not dist.is_initialized()
    with pytest.raises(BadRequest, match="needs torch.distributed initialised"):
        generate(glm_dir, ParallelConfig(ep_size=2, ep_rank=0))
