"""MTP speculative decoding (`engine/speculative.py`) on tiny GLM-5 checkpoints with MTP layers.

Random MTP weights rarely draft the model's next token, so beyond the real MTP drafter some
tests draft with an oracle (the plain engine's tokens, wrong at set places): verification then
keeps runs of drafts, ends requests inside them and leaves rejected drafts' KV behind.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from snapfn.handler.llm.bench.mtp import known_drafts
from snapfn.handler.llm.build import EngineOptions, build_engine
from snapfn.handler.llm.engine import speculative
from snapfn.handler.llm.engine.batch import ForwardBatch
from snapfn.handler.llm.engine.engine import SchedulerConfig
from snapfn.handler.llm.engine.request import Request, SamplingParams
from snapfn.handler.llm.engine.speculative import accept_sampled, verify_request
from snapfn.handler.llm.init_config import InitConfig
from snapfn.snapshot.errors import UnsupportedModel

from glm_checkpoints import TINY_GLM, save_tiny_glm, write_with_mtp
from parity import greedy, random_prompts

VOCAB = TINY_GLM["vocab_size"]
PROMPTS = [3, 21, 9, 30, 14]


@pytest.fixture(scope="module")
def glm_dirs(tmp_path_factory):
    """(without MTP, with one MTP layer) of the tiny model, and of a 3-layer one."""
    root = tmp_path_factory.mktemp("spec")
    plain = save_tiny_glm(root / "plain", seed=0)
    write_with_mtp(plain, root / "mtp")
    three = save_tiny_glm(
        root / "plain3", seed=2, num_hidden_layers=3, indexer_types=["full", "shared", "full"]
    )
    write_with_mtp(three, root / "mtp3")
    return {"plain": plain, "mtp": root / "mtp", "mtp3": root / "mtp3"}


def engine(model_dir, k=0, tokens=2048, num_pages=256, page_size=4, **sched):
    opts = EngineOptions(
        dtype="float32",
        num_pages=num_pages,
        scheduler=SchedulerConfig(
            page_size=page_size, max_num_batched_tokens=tokens, speculative_tokens=k, **sched
        ),
    )
    return build_engine(model_dir, opts).engine


def in_waves(eng, prompts, params, every=3):
    """Add the prompts one at a time, `every` steps apart, while earlier ones run."""
    ids, pending = [], list(zip(prompts, params, strict=True))
    steps = 0
    while pending or eng.has_work():
        if pending and steps % every == 0:
            ids.append(eng.add_request(*pending.pop(0)))
        eng.step()
        steps += 1
    return ids


def keeping_finished(eng) -> dict:
    """The engine's requests by id as they finish (their prompt logprobs and alternatives
    kept), filled from now on."""
    kept, forget = {}, eng._forget

    def keep(req):
        kept[req.request_id] = req
        forget(req)

    eng._forget = keep
    return kept


def run_waves(eng, prompts, params):
    results = keeping_finished(eng)
    ids = in_waves(eng, prompts, params)
    return [
        (tuple(results[i].output_ids), results[i].finish_reason, tuple(results[i].logprobs))
        for i in ids
    ]


@pytest.mark.parametrize("model", ["mtp", "mtp3"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_equals_the_plain_engine(glm_dirs, model, k):
    prompts = random_prompts(VOCAB, PROMPTS, seed=1)
    ref = engine(glm_dirs[model]).generate(prompts, greedy(24))
    eng = engine(glm_dirs[model], k, tokens=16)  # chunked prefill beside verifications
    got = eng.generate(prompts, greedy(24))
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    for a, b in zip(got, ref, strict=True):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
    stats = eng.spec_stats()
    assert stats["draft_tokens"] > 0 and 0 <= stats["accepted_tokens"] <= stats["draft_tokens"]


def oracle(eng, refs: dict[tuple[int, ...], list[int]], wrong_every: int):
    """Drafts are the plain run's tokens (`refs` by prompt), each `wrong_every`-th one off by 1:
    the MTP layer drafts as always, then its drafts are replaced (greedy requests only)."""
    known_drafts(
        eng.drafter,
        refs,
        lambda index: wrong_every and index % wrong_every == wrong_every - 1,
        VOCAB,
    )
    return eng


@pytest.mark.parametrize("wrong_every", [0, 3, 5])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_kept_drafts_give_the_plain_tokens_and_end_where_plain_ends(glm_dirs, k, wrong_every):
    prompts = random_prompts(VOCAB, PROMPTS, seed=4)
    long = engine(glm_dirs["mtp"]).generate(prompts, greedy(30))
    refs = {tuple(p): list(r.token_ids) for p, r in zip(prompts, long, strict=True)}
    # endings inside runs of kept drafts: stop tokens, max_new_tokens and the model length
    params = [
        SamplingParams(max_new_tokens=30, stop_token_ids=(long[0].token_ids[7],)),
        SamplingParams(max_new_tokens=11, ignore_eos=True),
        SamplingParams(max_new_tokens=30, stop_token_ids=(long[2].token_ids[13],)),
        greedy(29),
        SamplingParams(max_new_tokens=2, ignore_eos=True),
    ]
    want = run_waves(engine(glm_dirs["mtp"], max_model_len=50), prompts, params)
    eng = oracle(engine(glm_dirs["mtp"], k, tokens=16, max_model_len=50), refs, wrong_every)
    got = run_waves(eng, prompts, params)
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert want[3][1] == "length" and len(want[3][0]) == 50 - len(prompts[3])
    stats = eng.spec_stats()
    if wrong_every == 0:
        assert stats["accepted_tokens"] == stats["draft_tokens"] > 0
    else:
        assert 0 < stats["accepted_tokens"] < stats["draft_tokens"]


def test_every_draft_kept_takes_one_step_per_k_plus_one_tokens(glm_dirs):
    (prompt,) = random_prompts(VOCAB, [10], seed=6)
    ref = engine(glm_dirs["mtp"]).generate([prompt], greedy(25))[0].token_ids
    eng = oracle(engine(glm_dirs["mtp"], 3), {tuple(prompt): list(ref)}, 0)
    eng.add_request(prompt, greedy(25))
    outputs = []
    while eng.has_work():
        outputs += eng.step()
    # the prefill's token, then 4 per step (3 kept drafts + the bonus), drafts capped at the end
    assert [len(o.new_token_ids) for o in outputs] == [1, 4, 4, 4, 4, 4, 4]
    assert tuple(t for o in outputs for t in o.new_token_ids) == ref
    stats = eng.spec_stats()
    assert stats["steps"] == 6 and stats["draft_tokens"] == stats["accepted_tokens"] == 18


def test_seeded_sampling_repeats_itself_and_penalties_run(glm_dirs):
    prompts = random_prompts(VOCAB, PROMPTS[:4], seed=2)
    params = [
        SamplingParams(max_new_tokens=16, temperature=0.8, seed=3, top_k=40, top_p=0.9),
        SamplingParams(max_new_tokens=16, temperature=1.0, seed=4, repetition_penalty=1.3),
        SamplingParams(max_new_tokens=16, frequency_penalty=0.7, top_logprobs=2),
        SamplingParams(max_new_tokens=16, temperature=0.7, seed=5, presence_penalty=0.5),
    ]
    runs = [engine(glm_dirs["mtp"], 2, tokens=16).generate(prompts, params) for _ in range(2)]
    assert [r.token_ids for r in runs[0]] == [r.token_ids for r in runs[1]]
    assert all(len(r.token_ids) == 16 for r in runs[0])
    # a greedy request with penalties: the plain engine's tokens
    plain = engine(glm_dirs["mtp"]).generate(prompts[2:3], params[2:3])[0]
    assert runs[0][2].token_ids == plain.token_ids


def test_prefix_cache_hits_give_the_same_tokens(glm_dirs):
    shared = random_prompts(VOCAB, [16], seed=8)[0]
    tails = random_prompts(VOCAB, [3, 5, 1, 7], seed=9)
    prompts = [shared + t for t in tails] + [shared]
    ref = engine(glm_dirs["mtp"], prefix_caching=False).generate(prompts, greedy(12))
    eng = engine(glm_dirs["mtp"], 2)
    got = run_waves(eng, prompts, [greedy(12)] * len(prompts))
    assert [g[0] for g in got] == [r.token_ids for r in ref]
    assert eng.prefix_cache_stats()["hit_tokens"] > 0


def test_with_drafts_a_prompt_page_ending_at_its_last_token_is_not_registered(glm_dirs):
    (prompt,) = random_prompts(VOCAB, [16], seed=3)  # 4 full pages of 4
    counts = {}
    for k in (0, 2):
        eng = engine(glm_dirs["mtp"], k)
        eng.generate([prompt], greedy(2))
        counts[k] = eng.prefix_cache_stats()["cached_pages"]
    assert counts == {0: 4, 2: 3}


def test_an_exact_pool_is_never_written_past(glm_dirs):
    """Drafts stop short of each request's reserved pages: a pool of just the pages the
    requests reserve serves them (a slot past a page list would fail the batch build)."""
    prompts = random_prompts(VOCAB, [7, 9], seed=5)
    ref = engine(glm_dirs["mtp"]).generate(prompts, greedy(9))
    refs = {tuple(p): list(r.token_ids) for p, r in zip(prompts, ref, strict=True)}
    eng = oracle(engine(glm_dirs["mtp"], 3, num_pages=8), refs, 0)  # 16 tokens, pages of 4
    got = eng.generate(prompts, greedy(9))
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]


def test_the_mtp_layer_caches_its_positions_as_one_chunk_would(glm_dirs):
    """The draft-extend over a sequence in one chunk, in pieces and one position at a time
    reads and writes the MTP layer's cache alike."""
    eng = engine(glm_dirs["mtp"], 1)
    model, kv = eng.model, eng.kv
    (ids,) = random_prompts(VOCAB, [13], seed=7)
    pages = kv.allocator.allocate(kv.pages_for(len(ids)))
    whole = ForwardBatch.build([ids[:-1]], [0], [pages], kv.page_size, "cpu", all_logits=True)
    with torch.inference_mode():
        _, hidden = model.forward_hidden(whole, kv)
        nexts = ForwardBatch.build([ids[1:]], [0], [pages], kv.page_size, "cpu", all_logits=True)
        one, _ = model.draft_forward(nexts, kv, hidden)
        pieces = []
        for start, n in ((0, 5), (5, 1), (6, 6)):
            piece = ForwardBatch.build(
                [ids[start + 1 : start + 1 + n]], [start], [pages], kv.page_size, "cpu",
                all_logits=True,
            )  # fmt: skip
            pieces.append(model.draft_forward(piece, kv, hidden[start : start + n])[0])
    torch.testing.assert_close(torch.cat(pieces), one, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(one[3], one[4])  # not a constant: each position's own logits


def test_draft_layers_add_their_kv_to_the_page_size(glm_dirs):
    sizes = {k: engine(glm_dirs["mtp"], k).kv for k in (0, 1)}
    latent = {k: kv.specs["latent"].num_layers for k, kv in sizes.items()}
    index = {k: kv.specs["index_k"].num_layers for k, kv in sizes.items()}
    assert latent == {0: 4, 1: 5} and index == {0: 2, 1: 3}


def test_a_model_without_mtp_layers_is_refused(glm_dirs):
    with pytest.raises(UnsupportedModel, match="num_nextn_predict_layers=0"):
        engine(glm_dirs["plain"], 2)
    for k in (-1, 9):
        with pytest.raises(UnsupportedModel, match="speculative_tokens must be in"):
            engine(glm_dirs["mtp"], k)


def test_init_config_reads_the_switch():
    config = InitConfig.from_env({"SNAPFN_SPECULATIVE_TOKENS": "3"})
    assert config.engine_options().scheduler.speculative_tokens == 3
    assert InitConfig.from_env({}).engine_options().scheduler.speculative_tokens == 0


def test_metrics_count_drafts_and_kept_drafts(glm_dirs):
    from snapfn.handler.http.metrics import engine_metrics
    from snapfn.handler.llm.service import LLMService

    eng = engine(glm_dirs["mtp"], 2)
    service = LLMService(eng)
    try:
        (prompt,) = random_prompts(VOCAB, [6], seed=1)
        service.generate(prompt, greedy(10), timeout_s=60)
        values = {f.name: f.samples[0].value for f in engine_metrics(service)}
    finally:
        service.close()
    stats = eng.spec_stats()
    assert values["snapfn_spec_draft_tokens"] == stats["draft_tokens"] > 0
    assert values["snapfn_spec_accepted_tokens"] == stats["accepted_tokens"]
    assert json.dumps(stats)  # the restored worker's info() carries it as JSON


# ---- a token a row, and the graphs that hold it ----------------------------------------------


def test_one_token_rows_give_the_chunks_logits_and_hidden_states(glm_dirs):
    """The verify's decode rows compute what the chunked batch does at every token."""
    eng = engine(glm_dirs["mtp"], 3)
    model, kv = eng.model, eng.kv
    prompts = random_prompts(VOCAB, [9, 5], seed=11)
    pages = [kv.allocator.allocate(kv.pages_for(len(p) + 4)) for p in prompts]
    with torch.inference_mode():
        for ids, table in zip(prompts, pages, strict=True):  # the prompts' KV, cached
            model.forward_hidden(ForwardBatch.build([ids], [0], [table], kv.page_size, "cpu"), kv)
        new = [[3, 17, 40, 8], [5, 22]]  # a last token and drafts each, as a verify brings
        starts = [len(p) for p in prompts]
        chunked = ForwardBatch.build(new, starts, pages, kv.page_size, "cpu", all_logits=True)
        want_logits, want_hidden = model.forward_hidden(chunked, kv)
        rows = speculative.one_token_rows(new, starts, pages, kv.page_size)
        assert rows.is_decode and rows.num_seqs == 6
        got_logits, got_hidden = model.forward_hidden(rows, kv)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_hidden, want_hidden, atol=1e-4, rtol=1e-4)


def finished_requests(eng, prompts, params):
    """Every request of one run, as it finished (its prompt logprobs and alternatives kept)."""
    kept = keeping_finished(eng)
    ids = [eng.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
    while eng.has_work():
        eng.step()
    return [kept[i] for i in ids]


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("tokens", [2048, 3])
def test_mixed_requests_give_the_plain_engines_outputs(glm_dirs, k, tokens):
    """One-token prompts, prompts of at most k + 1 tokens (a token a row) and longer ones, in a
    3-token budget or not, with prompt logprobs, alternatives, biases, a stop token, penalties
    and a single token: what the plain engine gives, field by field."""
    prompts = random_prompts(VOCAB, [1, 2, 3, 4, 5, 17], seed=3)
    params = [
        SamplingParams(max_new_tokens=9, prompt_logprobs=1),
        SamplingParams(max_new_tokens=9, top_logprobs=3),
        SamplingParams(max_new_tokens=9, logit_bias=((5, 3.0), (7, -2.0))),
        SamplingParams(max_new_tokens=9, stop_token_ids=(11,), prompt_logprobs=2),
        SamplingParams(max_new_tokens=1),
        SamplingParams(max_new_tokens=12, repetition_penalty=1.2, top_logprobs=1),
    ]
    want = finished_requests(engine(glm_dirs["mtp"]), prompts, params)
    got = finished_requests(engine(glm_dirs["mtp"], k, tokens=tokens), prompts, params)
    for a, b in zip(got, want, strict=True):
        assert (a.output_ids, a.finish_reason) == (b.output_ids, b.finish_reason)
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
        prompt_a = [x for x in a.prompt_logprobs if x is not None]
        prompt_b = [x for x in b.prompt_logprobs if x is not None]
        torch.testing.assert_close(prompt_a, prompt_b, atol=1e-4, rtol=0)
        assert [[t for t, _ in top] for top in a.top_logprobs] == [
            [t for t, _ in top] for top in b.top_logprobs
        ]
    assert [len(r.prompt_logprobs) for r in got] == [1, 0, 0, 4, 0, 0]


def test_spec_buckets_cover_every_verify_and_draft_step():
    from snapfn.handler.llm.engine.spec_graphs import spec_buckets

    assert spec_buckets([1, 2, 4], 3) == ([4, 8, 16], [1, 2, 4, 8, 16])
    assert spec_buckets([1, 8], 1) == ([2, 16], [1, 2, 8, 16])


def replayed_eagerly(eng, buckets, max_seq_len=64):
    """The engine's speculative graphs, each bucket's "graph" run eagerly over its static
    inputs when replayed: the host side of the CUDA path (static buffers, padding rows, the
    draft family's hidden-state input, bucket choice) on CPU."""
    from types import SimpleNamespace

    from snapfn.handler.llm.engine.spec_graphs import SpecGraphs

    spec = SpecGraphs(eng.model, eng.kv, buckets, eng.drafter.num_tokens, max_seq_len)
    for family in (spec.verify, spec.draft):
        for n in family.buckets:
            family._batches[n] = family._static_batch(n)

            def replay(family=family, n=n):
                family._outputs[n] = family._run(family._batches[n], n)

            family._graphs[n] = SimpleNamespace(replay=replay)
    eng.spec_graphs = eng.drafter.graphs = spec
    return spec.stats


def recording_drafts(eng) -> list[list[int]]:
    """Every request's drafts as the drafter proposes them, in order (greedy ones read from
    the device at once)."""
    drafts, propose = [], eng.drafter.propose

    def recorded(rows, ahead=None):
        propose(rows, ahead)
        if eng.drafter.pending is not None:
            eng.drafter.pending.land()
        drafts.extend(list(r.req.draft_ids) for r in rows)

    eng.drafter.propose = recorded
    return drafts


@pytest.mark.parametrize("k", [1, 3])
def test_graph_replays_give_the_plain_tokens_and_the_eager_drafts(glm_dirs, k):
    prompts = random_prompts(VOCAB, PROMPTS, seed=1)
    ref = engine(glm_dirs["mtp"]).generate(prompts, greedy(20))
    eager = engine(glm_dirs["mtp"], k, tokens=16)
    eager_drafts = recording_drafts(eager)
    eager.generate(prompts, greedy(20))
    eng = engine(glm_dirs["mtp"], k, tokens=16)
    stats = replayed_eagerly(eng, [1, 2, 4, 8])
    drafts = recording_drafts(eng)
    got = eng.generate(prompts, greedy(20))
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert drafts == eager_drafts and any(drafts)  # the draft family's hidden input as eager's
    for a, b in zip(got, ref, strict=True):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
    uses = stats.replays_by_use
    assert uses["verify"] > 0 and uses["draft_extend"] > 0
    assert (uses["draft"] > 0) == (k > 1)  # one draft from the draft-extend, then k - 1 steps
    assert stats.eager_fallbacks == 0 and stats.replays == sum(uses.values())


@pytest.mark.parametrize("graphs", [False, True])
def test_the_draft_extend_ahead_of_the_read_back_drafts_as_after_it(glm_dirs, graphs):
    """The draft-extend run over every verify row before the host knows which were kept (rows
    past the kept ones write MTP cache entries that must be rewritten before they are read):
    the MTP layer's own drafts equal those of the draft-extend over the kept rows only, while
    known drafts, wrong at set places, make the kept runs vary."""
    prompts = random_prompts(VOCAB, PROMPTS, seed=6)
    ref = engine(glm_dirs["mtp3"]).generate(prompts, greedy(24))
    refs = {tuple(p): list(r.token_ids) for p, r in zip(prompts, ref, strict=True)}
    runs = []
    for overlap in (True, False):
        eng = engine(glm_dirs["mtp3"], 3, tokens=16, overlap_speculative=overlap)
        if graphs:
            replayed_eagerly(eng, [1, 2, 4, 8])
        drafts = recording_drafts(eng)  # the MTP layer's, before the oracle replaces them
        oracle(eng, refs, 3)
        got = eng.generate(prompts, greedy(24))
        stats = eng.spec_stats()
        assert 0 < stats["accepted_tokens"] < stats["draft_tokens"]
        runs.append(drafts)
        assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert runs[0] == runs[1] and any(runs[0])


@pytest.mark.parametrize("graphs", [False, True])
def test_a_tight_pool_preempts_drafting_requests_and_keeps_the_plain_tokens(glm_dirs, graphs):
    """Requests preempted with drafts pending on the device (dropped), drafts cut to the pages
    left, kept runs of known drafts: the plain engine's tokens, every page back."""
    prompts = random_prompts(VOCAB, PROMPTS, seed=7)
    ref = engine(glm_dirs["mtp"]).generate(prompts, greedy(20))
    refs = {tuple(p): list(r.token_ids) for p, r in zip(prompts, ref, strict=True)}
    eng = engine(glm_dirs["mtp"], 3, tokens=16, num_pages=14)  # the longest needs 13
    if graphs:
        replayed_eagerly(eng, [1, 2, 4, 8])
    oracle(eng, refs, 4)
    got = eng.generate(prompts, greedy(20))
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    stats = eng.spec_stats()
    assert eng.scheduler.num_preemptions > 0 and stats["accepted_tokens"] > 0
    assert eng.scheduler.num_available_pages() == 14


def test_steps_past_the_largest_bucket_run_eagerly_and_are_counted(glm_dirs):
    prompts = random_prompts(VOCAB, PROMPTS, seed=3)
    ref = engine(glm_dirs["mtp"]).generate(prompts, greedy(12))
    refs = {tuple(p): list(r.token_ids) for p, r in zip(prompts, ref, strict=True)}
    eng = oracle(engine(glm_dirs["mtp"], 2), refs, 4)
    stats = replayed_eagerly(eng, [1, 2])  # verify rows up to 6: five requests of 3 do not fit
    got = eng.generate(prompts, greedy(12))
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert stats.eager_fallbacks > 0 and stats.replays_by_use["verify"] > 0


def test_sampled_requests_through_the_graphs_repeat_themselves(glm_dirs):
    prompts = random_prompts(VOCAB, PROMPTS[:3], seed=2)
    params = [
        SamplingParams(max_new_tokens=12, temperature=0.9, seed=s, top_p=0.9) for s in (1, 2, 3)
    ]
    runs = []
    for graphs in (False, True):
        eng = engine(glm_dirs["mtp"], 2)
        if graphs:
            replayed_eagerly(eng, [1, 2, 4])
        runs.append([r.token_ids for r in eng.generate(prompts, params)])
    assert runs[0] == runs[1]


# ---- a snapshot of a speculating engine ----------------------------------------------------


def test_a_snapshot_restores_speculating_and_one_without_drafts_is_refused(glm_dirs, tmp_path):
    from snapfn.handler.llm.recipes.function import LLMFunction
    from snapfn.snapshot.runtime import init_and_snapshot, restore

    def config(k, name):
        return InitConfig(
            page_size=4,
            max_num_batched_tokens=64,
            kv_cache_bytes_cpu=1 << 20,
            cache_dir=tmp_path / name,
            speculative_tokens=k,
        )

    prompt = random_prompts(VOCAB, [6], seed=12)
    fn = LLMFunction(config(2, "init"), glm_dirs["mtp"])
    init_and_snapshot(fn, tmp_path / "snap", log=None)
    want = fn.engine.generate(prompt, greedy(12))[0].token_ids
    fn.release()
    for k in (2, 3):  # the same pages: any draft count restores
        got, startup = restore(
            lambda k=k: LLMFunction(config(k, f"r{k}"), glm_dirs["mtp"]), tmp_path / "snap",
            log=None, rewrite_on_fallback=False,
        )  # fmt: skip
        assert startup.tier == "portable" and not startup.fallbacks
        assert got.engine.generate(prompt, greedy(12))[0].token_ids == want
        assert got.engine.spec_stats()["draft_tokens"] > 0
        got.release()
    got, startup = restore(
        lambda: LLMFunction(config(0, "r0"), glm_dirs["mtp"]), tmp_path / "snap",
        log=None, rewrite_on_fallback=False,
    )  # fmt: skip
    (fallback,) = startup.fallbacks
    assert fallback["step"] == "validate" and "speculative_tokens=2" in fallback["reason"]
    assert "SNAPFN_SPECULATIVE_TOKENS" in fallback["reason"]
    assert got.engine.generate(prompt, greedy(12))[0].token_ids == want  # the cold init's
    got.release()


# ---- with a grammar --------------------------------------------------------------------------

GUIDES = {
    "json": {
        "guided_json": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 8},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
            },
            "required": ["name", "age"],
            "additionalProperties": False,
        }
    },
    "regex": {"guided_regex": "[0-9]{3}-[a-z]{2,4}"},
    "choice": {"guided_choice": ["yes", "no", "perhaps"]},
}


@pytest.fixture(scope="module")
def guided_glm(tmp_path_factory):
    """The tiny GLM with an MTP layer at the embedded model's vocabulary, with its tokenizer:
    grammars compile against it."""
    import shutil

    from snapfn.handler.llm.embedded import embedded_model_dir

    root = tmp_path_factory.mktemp("guided")
    plain = save_tiny_glm(root / "plain", seed=3, vocab_size=4096, eos_token_id=1)
    write_with_mtp(plain, root / "mtp")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(embedded_model_dir()) / name, root / "mtp" / name)
    return root / "mtp"


def guided_engine(model_dir, k=0, **sched):
    from snapfn.handler.llm.structured.compiler import GrammarCache

    eng = engine(model_dir, k, **sched)
    eng.attach_grammars(GrammarCache(eng.tokenizer, eng.model.config.vocab_size, eng.eos_token_ids))
    return eng


def guided_params(seed=None):
    from snapfn.handler.llm.structured.spec import spec_from_fields

    sampled = {"temperature": 1.0, "seed": seed} if seed is not None else {}
    return [
        SamplingParams(max_new_tokens=40, guide=spec_from_fields(fields), **sampled)
        for fields in GUIDES.values()
    ]


def check_guided(results):
    import re

    import jsonschema

    json_out, regex_out, choice_out = results
    jsonschema.validate(json.loads(json_out.text), GUIDES["json"]["guided_json"])
    assert re.fullmatch(GUIDES["regex"]["guided_regex"], regex_out.text), regex_out.text
    assert choice_out.text in GUIDES["choice"]["guided_choice"]
    assert all(r.finish_reason == "stop" for r in results)


@pytest.mark.parametrize("k", [1, 3])
def test_guided_requests_draft_and_give_the_plain_tokens(guided_glm, k):
    prompts = [guided_engine(guided_glm).tokenizer.encode(t) for t in ("A", "B", "C")]
    want = guided_engine(guided_glm).generate(prompts, guided_params())
    eng = guided_engine(guided_glm, k)
    got = eng.generate(prompts, guided_params())
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(list(a.logprobs), list(b.logprobs), atol=1e-4, rtol=0)
    check_guided(got)
    assert eng.spec_stats()["draft_tokens"] > 0  # the guided requests drafted


@pytest.mark.parametrize("k", [0, 3])
def test_guided_requests_preempted_in_a_tight_pool_stay_in_their_grammars(guided_glm, k):
    """A preempted request's matcher stays where its tokens left it: after the recompute it
    goes on in its grammar, with the large pool's tokens."""
    tokenizer = guided_engine(guided_glm).tokenizer
    prompts = [tokenizer.encode(t) for t in ("A", "B", "C", "D", "E", "F", "G", "H", "I")]
    params = guided_params() * 3  # json, regex, choice, three times
    want = guided_engine(guided_glm).generate(prompts, params)
    eng = guided_engine(guided_glm, k, num_pages=11)  # what one request can need, 4 a page
    got = eng.generate(prompts, params)
    assert eng.scheduler.num_preemptions > 0
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    for i in range(3):
        check_guided(got[3 * i : 3 * i + 3])


def test_guided_drafts_of_the_plain_tokens_are_kept_and_end_with_the_grammar(guided_glm):
    prompts = [guided_engine(guided_glm).tokenizer.encode(t) for t in ("A", "B", "C")]
    want = guided_engine(guided_glm).generate(prompts, guided_params())
    refs = {tuple(p): list(r.token_ids) for p, r in zip(prompts, want, strict=True)}
    for wrong_every in (0, 3):
        eng = oracle(guided_engine(guided_glm, 3), refs, wrong_every)
        got = eng.generate(prompts, guided_params())
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        stats = eng.spec_stats()
        assert stats["accepted_tokens"] > 0
        if wrong_every == 0:
            assert stats["accepted_tokens"] == stats["draft_tokens"]
        else:  # wrong drafts, some of them refused by the grammar, rejected in the verify
            assert stats["accepted_tokens"] < stats["draft_tokens"]


def test_sampled_guided_requests_stay_in_their_grammars(guided_glm):
    eng = guided_engine(guided_glm, 2)
    prompts = [eng.tokenizer.encode(t) for t in ("A", "B", "C")]
    for seed in (1, 2, 3):
        check_guided(eng.generate(prompts, guided_params(seed)))
    assert eng.spec_stats()["draft_tokens"] > 0


# ---- the rejection rule --------------------------------------------------------------------


def test_the_rejection_rule_keeps_the_target_distribution():
    """Drafts from q, kept by the rule: the first token follows p, and where the first draft
    was kept, the second follows p2 (20000 seeded runs, so the check cannot flake)."""
    p = torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.1, 0.6, 0.1, 0.2], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.1, 0.4, 0.4], [0.3, 0.3, 0.3, 0.1]])
    g = torch.Generator().manual_seed(0)
    n, first, second = 20000, torch.zeros(4), torch.zeros(4)
    for _ in range(n):
        drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
        tokens = accept_sampled(drafts, q, p, g)
        first[tokens[0]] += 1
        if len(tokens) > 1:
            second[tokens[1]] += 1
    assert (first / n - p[0]).abs().max() < 0.015
    assert (second / second.sum() - p[1]).abs().max() < 0.02
    assert second.sum() > 0.3 * n  # the first draft was kept often enough to tell


def test_greedy_verification_keeps_drafts_up_to_the_first_mismatch():
    rows = torch.full((4, 8), -1.0)
    for i, best in enumerate([3, 5, 2, 7]):
        rows[i, best] = 1.0
    req = Request([1, 2], SamplingParams(max_new_tokens=8))
    for drafts, want in (([3, 5, 2], [3, 5, 2, 7]), ([3, 4, 2], [3, 5]), ([0, 5, 2], [3])):
        req.draft_ids = drafts
        assert verify_request(req, rows) == want


# ---- on a GPU --------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_greedy_equals_the_plain_engine(glm_dirs, backend):
    """Eager on both backends; from the verify and draft graphs where the backend's MoE and
    indexer capture (triton), with every pure-decode step replayed and the eager drafts."""
    from snapfn.handler.llm.engine.graphs import decode_captures

    def cuda_engine(k):
        opts = EngineOptions(
            device="cuda",
            dtype="float32",
            backend=backend,
            num_pages=256,
            scheduler=SchedulerConfig(page_size=16, speculative_tokens=k),
        )
        return build_engine(glm_dirs["mtp"], opts).engine

    prompts = random_prompts(VOCAB, PROMPTS, seed=1)
    ref = cuda_engine(0).generate(prompts, greedy(24))
    eager = cuda_engine(2)
    eager_drafts = recording_drafts(eager)
    assert [r.token_ids for r in eager.generate(prompts, greedy(24))] == [r.token_ids for r in ref]
    if not decode_captures(eager.model):
        return
    eng = cuda_engine(2)
    stats = eng.capture_graphs([1, 2, 4, 8], 64)
    assert stats.families == {"verify": [3, 6, 12, 24], "draft": [1, 2, 3, 4, 6, 8, 12, 24]}
    drafts = recording_drafts(eng)
    got = eng.generate(prompts, greedy(24))
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert all(n > 0 for n in stats.replays_by_use.values()) and stats.eager_fallbacks == 0
    same = sum(a == b for a, b in zip(drafts, eager_drafts, strict=True))
    assert len(drafts) == len(eager_drafts) and same >= 0.9 * len(drafts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)")
def test_cuda_guided_requests_draft_from_the_graphs_and_give_the_plain_tokens(guided_glm):
    """Guided requests on the triton backend from the verify and draft graphs: the plain
    engine's tokens, in their grammars, with drafts made."""
    from snapfn.handler.llm.structured.compiler import GrammarCache

    def cuda_engine(k):
        opts = EngineOptions(
            device="cuda",
            dtype="float32",
            backend="triton",
            num_pages=256,
            scheduler=SchedulerConfig(page_size=16, speculative_tokens=k),
        )
        eng = build_engine(guided_glm, opts).engine
        vocab = eng.model.config.vocab_size
        eng.attach_grammars(GrammarCache(eng.tokenizer, vocab, eng.eos_token_ids))
        return eng

    base = cuda_engine(0)
    prompts = [base.tokenizer.encode(t) for t in ("A", "B", "C")]
    want = base.generate(prompts, guided_params())
    eng = cuda_engine(2)
    stats = eng.capture_graphs([1, 2, 4], 128)
    got = eng.generate(prompts, guided_params())
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    check_guided(got)
    assert eng.spec_stats()["draft_tokens"] > 0 and stats.replays_by_use["verify"] > 0
