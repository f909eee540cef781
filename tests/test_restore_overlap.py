"""What a tier-0 restore runs beside its stages. The KV pool and warmup while the weights
stream (`InitConfig.restore_overlap`, recipes/function.py): the same answer as the restore in
turn, its stages in their order, and a stream that fails after the warmup began still refused.
The weights file read into the page cache from the restore's start
(`InitConfig.restore_read_ahead`, snapshot/runtime.py): read where it was dropped, skipped
where resident, off when switched off, the answer the same. Decode graphs captured by their
first decode steps (`InitConfig.restore_graphs_on_first_use`, engine/graphs.py): the bits of
the graphs captured before ready."""

from __future__ import annotations

import platform

import pytest
import torch

from snapfn.handler.llm.init_config import InitConfig
from snapfn.handler.llm.recipes.function import LLMFunction
from snapfn.snapshot.runtime import init_and_snapshot, restore

OVERLAPPED = ["kv_pool", "start_stream", "warmup", "stream_weights", "capture_graphs"]


def config(tmp_path, overlap: bool) -> InitConfig:
    return InitConfig(
        page_size=4,
        max_num_batched_tokens=64,
        kv_cache_bytes_cpu=1 << 20,
        cache_dir=tmp_path / "cache",
        restore_overlap=overlap,
    )


@pytest.fixture(scope="module")
def made(llama_with_tokenizer, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("overlap")
    init_and_snapshot(LLMFunction(config(tmp, False), llama_with_tokenizer), tmp / "snap", log=None)
    return llama_with_tokenizer, tmp / "snap"


def restored(made, tmp_path, overlap: bool):
    model_dir, snap = made
    return restore(lambda: LLMFunction(config(tmp_path, overlap), model_dir), snap, log=None)


def test_the_overlapped_restore_answers_as_the_restore_in_turn(made, tmp_path):
    plain, plain_startup = restored(made, tmp_path / "a", overlap=False)
    fn, startup = restored(made, tmp_path / "b", overlap=True)
    assert startup.tier == "portable" and not startup.fallbacks
    names = [s.name for s in startup.stages]
    assert names[names.index("kv_pool") : names.index("capture_graphs") + 1] == OVERLAPPED
    assert startup.stage("start_stream").figures["overlapped_with"] == "warmup"
    assert startup.stage("stream_weights").figures["num_bytes"] > 0
    assert "start_stream" not in [s.name for s in plain_startup.stages]
    assert fn.health == plain.health  # the replay check passed on both: the init's token
    prompt = fn.engine.tokenizer.encode("Hello there")
    from parity import greedy

    (got,) = fn.engine.generate([prompt], greedy(8))
    (want,) = plain.engine.generate([prompt], greedy(8))
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
    fn.release()
    plain.release()


def test_a_switch_interval_holds_while_the_stream_runs_and_is_set_back(made, tmp_path, monkeypatch):
    """`restore_switch_interval_us`: Python's thread switch interval while the weights stream
    beside the warmup, Python's own again once the stream is joined, or the restore fails."""
    import sys

    from snapfn.handler.llm.recipes import function

    seen: list[float] = []
    stream = function.LLMFunction._stream_weights

    def recorded(self):
        seen.append(sys.getswitchinterval())
        return stream(self)

    monkeypatch.setattr(function.LLMFunction, "_stream_weights", recorded)
    before = sys.getswitchinterval()
    model_dir, snap = made
    fast = InitConfig(**{**vars(config(tmp_path, True)), "restore_switch_interval_us": 250})
    fn, startup = restore(lambda: LLMFunction(fast, model_dir), snap, log=None)
    assert startup.tier == "portable" and not startup.fallbacks
    assert seen == [pytest.approx(250e-6)] and sys.getswitchinterval() == before
    assert startup.stage("start_stream").figures["switch_interval_us"] == 250
    fn.release()

    def failing(self, figures):
        raise RuntimeError("warmup failed")

    monkeypatch.setattr(function.LLMFunction, "stage_warmup", failing)
    with pytest.raises(Exception):  # noqa: B017 - how the restore reports it is not the point
        restore(lambda: LLMFunction(fast, model_dir), snap, log=None)
    assert sys.getswitchinterval() == before


def test_stray_bits_in_the_parameters_before_the_stream_leave_no_trace(made, tmp_path, monkeypatch):
    """The parameters' memory holds whatever was there before the stream fills it (here NaN, as
    reused memory can): the warmup beside the stream computes from it, and the KV pages it
    writes must not poison a later request (a masked attention read of a NaN page is NaN)."""
    import threading

    from snapfn.handler.llm.recipes import function

    build, warm = function.LLMFunction.stage_build_model, function.LLMFunction.stage_warmup
    stream, warmed = function.LLMFunction._stream_weights, threading.Event()

    def build_over_stray_bits(self, figures, folder):
        build(self, figures, folder)
        with torch.no_grad():
            for param in self.model.parameters():
                param.fill_(float("nan"))

    def warm_then_let_the_stream_go(self, figures):
        try:
            warm(self, figures)
        finally:
            warmed.set()

    def stream_after_the_warmup(self):  # the slowest stream: none of it before the warmup ends
        warmed.wait(60)
        return stream(self)

    plain, _ = restored(made, tmp_path / "a", overlap=False)
    monkeypatch.setattr(function.LLMFunction, "stage_build_model", build_over_stray_bits)
    monkeypatch.setattr(function.LLMFunction, "stage_warmup", warm_then_let_the_stream_go)
    monkeypatch.setattr(function.LLMFunction, "_stream_weights", stream_after_the_warmup)
    fn, startup = restored(made, tmp_path / "b", overlap=True)
    assert startup.tier == "portable" and not startup.fallbacks
    from parity import greedy, random_prompts

    prompts = random_prompts(256, [5, 13, 9], seed=21)
    got = fn.engine.generate(prompts, greedy(12))
    want = plain.engine.generate(prompts, greedy(12))
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.logprobs for r in got] == [r.logprobs for r in want]
    fn.release()
    plain.release()


def test_a_stream_that_fails_is_refused_and_the_named_model_answers(made, tmp_path):
    model_dir, snap = made
    copy = tmp_path / "snap"
    import shutil

    shutil.copytree(snap, copy)
    weights = copy / "weights" / "rank0.bin"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a bit in the middle of the weights: found by the stream
    weights.write_bytes(bytes(data))
    fn, startup = restore(lambda: LLMFunction(config(tmp_path, True), model_dir), copy, log=None)
    assert startup.tier == "cold (fallback)"
    (fallback,) = startup.fallbacks
    assert fallback["step"] == "stream_weights" and "chunk" in fallback["reason"]
    fn.release()


def test_several_ranks_and_a_dropped_plan_restore_in_turn(tmp_path):
    fn = LLMFunction(config(tmp_path, True), None)
    assert fn._overlaps_stream()
    assert not LLMFunction(config(tmp_path, False), None)._overlaps_stream()
    fn.world_size = 2  # the ranks meet in collectives after they agree
    assert not fn._overlaps_stream()
    fn = LLMFunction(config(tmp_path, True), None)
    fn.cache_drift = "another GPU"  # its plan is measured again, with the weights in
    assert not fn._overlaps_stream()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)")
def test_on_cuda_the_overlapped_restore_gives_the_same_bits(llama_with_tokenizer, tmp_path):
    """The warmup runs kernels over parameters the stream is still filling (zeroed first); the
    restored engine's logits are the restore in turn's all the same."""
    from dataclasses import replace

    from parity import greedy

    def cuda(overlap: bool) -> InitConfig:
        return replace(config(tmp_path, overlap), device="cuda")

    init_and_snapshot(LLMFunction(cuda(False), llama_with_tokenizer), tmp_path / "snap", log=None)
    out = {}
    for overlap in (False, True):
        fn, startup = restore(
            lambda o=overlap: LLMFunction(cuda(o), llama_with_tokenizer),
            tmp_path / "snap",
            log=None,
        )
        assert startup.tier == "portable" and not startup.fallbacks
        prompt = fn.engine.tokenizer.encode("Hello there")
        (result,) = fn.engine.generate([prompt], greedy(8))
        out[overlap] = (result.token_ids, result.logprobs, fn.health)
        fn.release()
    assert out[True] == out[False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)")
def test_on_cuda_graphs_captured_on_first_use_give_the_same_bits(llama_with_tokenizer, tmp_path):
    from dataclasses import replace

    from parity import greedy

    base = replace(config(tmp_path, False), device="cuda", graph_max_batch=4)
    init_and_snapshot(LLMFunction(base, llama_with_tokenizer), tmp_path / "snap", log=None)
    out = {}
    for late in (False, True):
        cfg = replace(base, restore_graphs_on_first_use=late)
        fn, startup = restore(
            lambda c=cfg: LLMFunction(c, llama_with_tokenizer), tmp_path / "snap", log=None
        )
        assert startup.tier == "portable" and not startup.fallbacks
        capture = startup.stage("capture_graphs").figures
        assert ("captured" in capture) == late and capture["compiled_files"] == 0
        prompts = [fn.engine.tokenizer.encode(t) for t in ("Hello there", "A", "Once upon")]
        first = fn.engine.generate(prompts[:1], greedy(8))
        every = fn.engine.generate(prompts, greedy(8))
        stats = fn.graph_stats
        assert stats.eager_fallbacks == 0 and stats.replays > 0
        if late:
            assert stats.captured_on_first_use[:2] == [1, 4]
        out[late] = [(r.token_ids, r.logprobs) for r in (*first, *every)], fn.health
        fn.release()
    assert out[True] == out[False]


def test_the_weights_file_is_read_ahead_where_the_page_cache_dropped_it(made, tmp_path):
    from dataclasses import replace

    from snapfn.snapshot.portable.pagecache import drop, residency

    model_dir, snap = made
    weights = snap / "weights" / "rank0.bin"
    runs = {}
    for name, ahead, dropped in (
        ("cold", True, True),
        ("idle", True, True),
        ("warm", True, False),
        ("off", False, True),
    ):
        if dropped and not drop([weights]):
            pytest.skip("posix_fadvise(DONTNEED) is ignored on this filesystem")
        cfg = replace(config(tmp_path / name, False), restore_read_ahead=ahead)
        if name == "idle":
            cfg = replace(cfg, restore_read_ahead_priority="idle")
        fn, startup = restore(lambda c=cfg: LLMFunction(c, model_dir), snap, log=None)
        assert startup.tier == "portable" and not startup.fallbacks
        runs[name] = (startup.info.get("read_ahead"), fn.health)
        fn.release()
    assert runs["cold"][0]["read_bytes"] <= weights.stat().st_size
    assert "io_class" not in runs["cold"][0]
    if platform.machine() in ("x86_64", "aarch64"):  # the idle class asked for and given
        assert runs["idle"][0]["io_class"] == "idle"
    assert runs["warm"][0] == {"skipped": "100% resident already"}
    assert runs["off"][0] is None
    health = {name: run[1] for name, run in runs.items()}
    assert len({repr(h) for h in health.values()}) == 1, health  # the init's token, each time
    assert residency([weights]).fraction >= 0.99
