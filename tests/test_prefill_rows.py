"""Short steps that are not decode steps replayed through the decode graphs, a row a token
(`Engine._replay_rows`): the tokens and logprobs of the eager prefill.

Capture needs CUDA; here `EagerDecodeGraphs` is the real `DecodeGraphs` (its static buffers,
host mirror, padding rows and buckets) whose "graph" runs the model eagerly over those buffers
when replayed, so what a replay reads is exactly what a captured graph would read. Each case
runs the same requests through an engine with such graphs and one without, and compares.
The GPU run of the same path: tests/test_gpu.py, with captured graphs.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from snapfn.handler.llm.build import EngineOptions, build_engine
from snapfn.handler.llm.engine import engine as engine_module
from snapfn.handler.llm.engine.engine import SchedulerConfig
from snapfn.handler.llm.engine.graphs import DecodeGraphs
from snapfn.handler.llm.engine.request import SamplingParams

from glm_checkpoints import TINY_GLM, save_tiny_glm
from parity import greedy, our_engine, random_prompts


class EagerDecodeGraphs(DecodeGraphs):
    """`DecodeGraphs` whose buckets' graphs are eager runs over the static buffers."""

    def _capture_bucket(self, n: int, error_mode: str) -> None:
        batch = self._batches[n] = self._static_batch(n)

        def run() -> None:
            self._outputs[n] = self._run(batch, n)

        self._graphs[n] = SimpleNamespace(replay=run)


def with_graphs(engine, buckets=(1, 2, 4, 8, 16, 32), max_seq_len=256, on_first_use=False):
    graphs = EagerDecodeGraphs(engine.model, engine.kv, list(buckets), max_seq_len)
    graphs.capture_on_first_use()
    if not on_first_use:  # every bucket now, as an init does (`capture` waits for CUDA)
        for n in graphs.buckets:
            graphs._capture_bucket(n, "global")
    engine.graphs = graphs
    engine.overlap_decode = False  # overlapped landing has its own tests (test_in_flight.py)
    return graphs.stats


def _close(got, want, abs_tol=1e-4):
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=abs_tol)


@pytest.fixture(scope="module")
def tiny_glm_dir(tmp_path_factory):
    return save_tiny_glm(tmp_path_factory.mktemp("rows") / "glm", seed=3)


@pytest.mark.parametrize("tokens", [2048, 8])
def test_short_prefills_replay_as_rows_and_give_the_eager_tokens(tiny_llama_dir, tokens):
    """Whole prompts of up to the largest bucket, and (8 tokens a step) chunks of longer ones
    at later positions, beside other requests' decode rows."""
    prompts = random_prompts(256, [3, 9, 1, 30, 14], seed=41)
    want = our_engine(tiny_llama_dir, max_tokens=tokens, prefix_caching=False).generate(
        prompts, greedy(10)
    )
    engine = our_engine(tiny_llama_dir, max_tokens=tokens, prefix_caching=False)
    stats = with_graphs(engine)
    for prompt in prompts:  # one at a time: each prompt's prefill is a step of its own
        _close(engine.generate([prompt], greedy(10)), [want[prompts.index(prompt)]])
    # (a one-token prompt is a decode step: the plain replay)
    assert stats.prefill_replays >= len(prompts) - 1 and stats.eager_fallbacks == 0
    replays = stats.prefill_replays
    _close(engine.generate(prompts, greedy(10)), want)  # together: 57 tokens, or chunks of 8
    assert (stats.prefill_replays > replays) == (tokens == 8)
    assert engine.scheduler.num_available_pages() == engine.kv.num_pages


def test_a_prefix_hit_prefills_the_rest_as_rows(tiny_llama_dir):
    (shared,) = random_prompts(256, [16], seed=42)
    tails = random_prompts(256, [3, 5], seed=43)
    prompts = [shared + t for t in tails]
    want = [our_engine(tiny_llama_dir).generate([p], greedy(6))[0] for p in prompts]
    engine = our_engine(tiny_llama_dir)
    stats = with_graphs(engine)
    got = [engine.generate([p], greedy(6))[0] for p in prompts]
    _close(got, want)
    assert engine.prefix_cache_stats()["hit_tokens"] == 16  # the second prefilled 5 rows
    assert stats.prefill_replays == 2


def _first_output(engine, prompt, params):
    rid = engine.add_request(prompt, params)
    outputs = []
    while engine.has_work():
        outputs += [o for o in engine.step() if o.request_id == rid]
    return outputs[0]


def test_prompt_logprobs_come_from_every_row(tiny_llama_dir):
    (prompt,) = random_prompts(256, [12], seed=44)
    params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    want = _first_output(our_engine(tiny_llama_dir), prompt, params)
    engine = our_engine(tiny_llama_dir)
    stats = with_graphs(engine)
    got = _first_output(engine, prompt, params)
    assert stats.prefill_replays == 1
    assert got.new_token_ids == want.new_token_ids
    assert len(got.prompt_logprobs) == len(want.prompt_logprobs) == 12
    assert got.prompt_logprobs[0] is None and want.prompt_logprobs[0] is None
    assert got.prompt_logprobs[1:] == pytest.approx(want.prompt_logprobs[1:], abs=1e-4)
    assert [[t for t, _ in top] for top in got.prompt_top_logprobs[1:]] == [
        [t for t, _ in top] for top in want.prompt_top_logprobs[1:]
    ]


def test_the_moe_model_with_its_indexer_replays_rows_the_same(tiny_glm_dir):
    """GLM's absorbed attention and DSA indexer run their decode path for every row."""
    prompts = random_prompts(TINY_GLM["vocab_size"], [5, 13, 2], seed=45)
    want = our_engine(tiny_glm_dir).generate(prompts, greedy(8))
    engine = our_engine(tiny_glm_dir)
    stats = with_graphs(engine)
    _close([engine.generate([p], greedy(8))[0] for p in prompts], want)
    assert stats.prefill_replays == len(prompts)


def test_long_steps_and_long_contexts_stay_eager(tiny_llama_dir, monkeypatch):
    prompts = random_prompts(256, [40, 6], seed=46)
    engine = our_engine(tiny_llama_dir)
    stats = with_graphs(engine)  # largest bucket 32: the 40 tokens run eagerly
    engine.generate(prompts[:1], greedy(2))
    assert stats.prefill_replays == 0 and stats.replays == 1  # its one decode step
    # rows that would read more context than the budget: eager
    monkeypatch.setattr(engine_module, "ROW_CONTEXT_TOKENS", 20)
    engine.generate(prompts[1:], greedy(2))  # 6 rows reading 1 + ... + 6 = 21 tokens
    assert stats.prefill_replays == 0
    monkeypatch.setattr(engine_module, "ROW_CONTEXT_TOKENS", 21)
    engine.generate(prompts[1:], greedy(2))
    assert stats.prefill_replays == 1


def test_the_setting_turns_rows_off(tiny_llama_dir):
    opts = EngineOptions(
        dtype="float32",
        num_pages=64,
        scheduler=SchedulerConfig(page_size=4, prefill_graph_tokens=0),
    )
    engine = build_engine(tiny_llama_dir, opts).engine
    stats = with_graphs(engine)
    engine.generate(random_prompts(256, [5], seed=47), greedy(3))
    assert stats.prefill_replays == 0 and stats.replays == 2


def test_rows_read_their_own_page_tables_across_requests(tiny_llama_dir):
    """Two requests prefilled in one step (9 tokens, bucket 16): each row's page table is its
    request's, and the step's logits are rows 3 and 8 of the replay's."""
    prompts = random_prompts(256, [4, 5], seed=48)
    want = our_engine(tiny_llama_dir).generate(prompts, greedy(5))
    engine = our_engine(tiny_llama_dir)
    stats = with_graphs(engine)
    got = engine.generate(prompts, greedy(5))
    _close(got, want)
    assert stats.prefill_replays == 1


def test_an_uncaptured_bucket_runs_its_rows_eagerly_without_capturing(tiny_llama_dir):
    """Graphs captured on first use (a tier-0 restore): a capture costs more than the eager
    prefill it would replace, so a prefill whose bucket is not captured runs the same padded
    rows eagerly (`DecodeGraphs.run_uncaptured`), giving what the init's replay gives: the
    same logprobs, bit for bit, as an engine whose buckets are all captured."""
    prompts = random_prompts(256, [6, 2, 3], seed=49)
    captured = our_engine(tiny_llama_dir)
    with_graphs(captured)
    want = [captured.generate([p], greedy(4))[0] for p in prompts]
    engine = our_engine(tiny_llama_dir)
    stats = with_graphs(engine, on_first_use=True)
    got = [engine.generate([p], greedy(4))[0] for p in prompts[:2]]
    assert stats.prefill_replays == 0 and stats.captured_on_first_use == [1]
    engine.generate(random_prompts(256, [5, 5], seed=50), greedy(2))  # a decode of 2 rows
    assert stats.captured_on_first_use == [1, 2]
    got.append(engine.generate(prompts[2:], greedy(4))[0])  # 3 rows: bucket 4, uncaptured
    assert stats.prefill_replays == 0 and stats.captured_on_first_use == [1, 2]
    got[1] = engine.generate(prompts[1:2], greedy(4))[0]  # 2 rows: bucket 2, captured
    assert stats.prefill_replays == 1
    for a, b in zip(got, want, strict=True):
        assert (a.token_ids, a.logprobs) == (b.token_ids, b.logprobs)
    eager = [our_engine(tiny_llama_dir).generate([p], greedy(4))[0] for p in prompts]
    _close(got, eager)


def test_the_bench_times_short_prompts_eager_and_as_rows(tiny_llama_dir):
    from argparse import Namespace

    from snapfn.handler.llm.bench.child import _short_prefill_figures

    engine = our_engine(tiny_llama_dir)
    stats = with_graphs(engine, buckets=(1, 8, 32))
    figures = _short_prefill_figures(engine, Namespace(device="cpu"))
    assert [f["tokens"] for f in figures] == [8, 32, 64]
    assert all(f["eager_ms"] > 0 for f in figures)
    assert [f["x"] > 0 for f in figures if "rows_ms" in f] == [True, True]  # 64: no bucket
    assert stats.prefill_replays == 8  # 4 runs each of 8 and 32 rows
    assert engine.prefill_graph_tokens == 64  # back on after the eager runs
