"""One benchmark mode, run in a fresh process by `snapfn bench` (see cli.py).

    python -m snapfn.handler.llm.bench.child MODE --model DIR --snapshot DIR --device D --t0 UNIX_S

Prints one JSON line: `{"mode", "ready_s", "first_token_s", "startup"?, "decode"?}` where the
times count from `--t0`, the moment the parent spawned this process, so interpreter start and
`import torch` are included, as a user's cold start includes them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from snapfn.handler.llm.bench.mtp import mode_mtp
from snapfn.handler.llm.bench.prefix import mode_prefix
from snapfn.handler.llm.bench.structured import mode_structured_init, mode_structured_restore

PROMPT_IDS = [1, 2, 3, 4, 5, 6, 7, 8]


def child_command(argv: list[str]) -> list[str]:
    """The command that runs bench child `argv` (a mode and its options) in a fresh process."""
    return [sys.executable, "-m", "snapfn.handler.llm.bench.child", *argv]


def restore_argv(mode: str, model, snapshot, device: str, cache_dir, *extra: str) -> list[str]:
    """A child's `argv` for `mode` over `snapshot`: its model, device and compile cache, and
    `--t0` now (what its figures count from)."""
    return [
        mode,
        *("--model", str(model), "--snapshot", str(snapshot)),
        *("--device", device, "--cache-dir", str(cache_dir)),
        *("--t0", repr(time.time()), *extra),
    ]


def since(t0: float) -> float:
    return round(time.time() - t0, 4)


def mode_hf(args: argparse.Namespace) -> dict[str, Any]:
    """(a) What users do today: transformers from_pretrained + generate."""
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM

    if importlib.util.find_spec("accelerate") is not None:  # loads straight onto the device
        model = AutoModelForCausalLM.from_pretrained(
            args.model, dtype="auto", device_map=args.device
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto").to(args.device)
    ready = since(args.t0)
    ids = torch.tensor([PROMPT_IDS], device=args.device)
    out = model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
    return {"ready_s": ready, "first_token_s": since(args.t0), "token": int(out[0, -1])}


def mode_safetensors(args: argparse.Namespace) -> dict[str, Any]:
    """(b) safetensors.load_file straight into our engine, eager, no snapshot."""
    from safetensors.torch import load_file

    from snapfn.handler.llm.build import (
        EngineOptions,
        allocate_kv,
        as_held,
        build_model,
        plan_num_pages,
    )
    from snapfn.handler.llm.config import ModelConfig
    from snapfn.handler.llm.engine.engine import Engine
    from snapfn.handler.llm.weights.checkpoint import Checkpoint

    ckpt = Checkpoint.open(args.model)
    config = as_held(ModelConfig.from_dir(args.model), ckpt.tensors)
    opts = EngineOptions(device=args.device)
    model = build_model(config, opts)
    params = dict(model.named_parameters())
    for path in ckpt.files:
        for name, tensor in load_file(path, device=args.device).items():
            target = model.map_weight(name)
            if target is not None:
                target.dest(params[target.param].data).copy_(tensor)
    engine = Engine(model, allocate_kv(model, plan_num_pages(model, opts), 16), opts.scheduler)
    return {"ready_s": since(args.t0), **_first_token(engine, args)}


def mode_cold_init(args: argparse.Namespace) -> dict[str, Any]:
    """(c) snapfn cold init (all stages), then write the snapshot the restore modes use."""
    from snapfn.snapshot.runtime import cold_init, write_snapshot

    fn = _function(args, Path(args.model))
    startup = cold_init(fn, log=None)
    result = {"ready_s": since(args.t0), **_first_token(fn.engine, args)}
    result["decode"] = _decode_figures(fn.engine, args)
    write_snapshot(fn, Path(args.snapshot), startup, log=None)
    result["snapshot_write_s"] = startup.stage("write_snapshot").seconds
    return {**result, "startup": startup.to_json()}


def mode_restore(args: argparse.Namespace) -> dict[str, Any]:
    """(d)/(e) tier-0 restore from the snapshot written by (c)."""
    from snapfn.snapshot.runtime import restore

    fn, startup = restore(lambda: _function(args, None), Path(args.snapshot), log=None)
    result = {"ready_s": since(args.t0), **_first_token(fn.engine, args)}
    # the first decode step's cost, where a decode graph is captured at its first use
    result["next_two_tokens_s"] = _two_tokens_s(fn.engine, args)
    result["decode"] = _decode_figures(fn.engine, args) if args.decode_batches else {}
    return {**result, "startup": startup.to_json(), "fallbacks": startup.fallbacks}


def mode_restore_s3(args: argparse.Namespace) -> dict[str, Any]:
    """(h) tier-0 restore of `--snapshot s3://…` into an empty snapshot cache (its place and
    SNAPFN_SNAPSHOT_CACHE_OVERLAP from the environment): pulled whole, then restored (off), or
    restored while it is pulled (on). `s3_total_s`: the cache lookup → the restore's end."""
    from snapfn.handler.llm.recipes.s3_restore import STREAMED, restore_following
    from snapfn.snapshot.runtime import restore
    from snapfn.snapshot.store.cache import SnapshotCacheConfig, open_snapshot

    start = time.perf_counter()
    cache = SnapshotCacheConfig.from_env(os.environ)
    opened = open_snapshot(args.snapshot, cache, streamed=STREAMED, log=None)
    opened_s = time.perf_counter() - start
    if opened.pull is None:
        fn, startup = restore(lambda: _function(args, None), opened.path, log=None)
    else:
        fn, startup = restore_following(opened.pull, _config(args), None, log=None)
    total_s = time.perf_counter() - start
    result = {"ready_s": since(args.t0), **_first_token(fn.engine, args)}
    return {
        **result,
        "overlapped": opened.pull is not None,
        "opened_s": round(opened_s, 4),  # off: the whole pull; on: the lookup, the pull started
        "s3_total_s": round(total_s, 4),
        "startup": startup.to_json(),
        "fallbacks": startup.fallbacks,
    }


def mode_s3_floor(args: argparse.Namespace) -> dict[str, Any]:
    """(h)'s floor: the GETs a pull of `--snapshot s3://…` makes, into memory (store/floor.py)."""
    from snapfn.snapshot.store.floor import measure_get_floor
    from snapfn.snapshot.store.s3 import make_s3_client
    from snapfn.snapshot.store.transfer import DEFAULT_NUM_THREADS

    client = make_s3_client(None, DEFAULT_NUM_THREADS)
    return measure_get_floor(args.snapshot, client, DEFAULT_NUM_THREADS)


def mode_init_process(args: argparse.Namespace) -> dict[str, Any]:
    """Setup for (f): a cold init in a checkpointable worker, then its process image."""
    from snapfn.handler.llm.recipes.cli import _init_process

    startup = _init_process(_config(args), Path(args.model), Path(args.snapshot))
    return {"ready_s": since(args.t0), "tier": startup.tier, "startup": startup.to_json()}


def mode_restore_process(args: argparse.Namespace) -> dict[str, Any]:
    """(f) tier-1 restore: criu + CUDA restore of the warmed worker, weights streamed back.

    This process never imports torch: it drives the worker and asks it for the first token.
    """
    from snapfn.handler.llm.engine.request import SamplingParams
    from snapfn.handler.llm.recipes.process_restore import restore_process

    imported = since(args.t0)
    service, startup = restore_process(Path(args.snapshot), _config(args), log=None)
    ready = since(args.t0)
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    result = service.generate(PROMPT_IDS, params)
    first = since(args.t0)
    again = time.perf_counter()  # the same request again: what of the first was first-time cost
    service.generate(PROMPT_IDS, params)
    again_s = time.perf_counter() - again
    decode = {}
    if args.decode_batches:

        def timed(tokens: int) -> float:
            if tokens == 1:
                return again_s  # the one-token request, timed just above
            t0 = time.perf_counter()
            service.generate(PROMPT_IDS, SamplingParams(max_new_tokens=tokens, ignore_eos=True))
            return time.perf_counter() - t0

        decode["batch1_ms_per_step"] = _ms_per_step(timed, args.decode_tokens)
    service.close()
    return {
        "ready_s": ready,
        "first_token_s": first,
        "second_request_s": round(again_s, 4),
        "token": result.token_ids[0],
        "logprob": result.logprobs[0],
        "decode": decode,
        "torch_imported": "torch" in sys.modules,
        # where the time before the restore's own stages went: interpreter start and imports
        "imported_s": imported,
        "restore_started_s": round(startup.started_at - args.t0, 4),
        "startup": startup.to_json(),
    }


def mode_steady(args: argparse.Namespace) -> dict[str, Any]:
    """(g) Steady state after a cold init: decode ms per step at each batch size and prefill
    tokens/s, each beside its roofline, measured in this process on the same device: a decode
    step streams the weights it uses once (`memory.step_weights`'s bytes ÷ memory bandwidth,
    KV reads left out: short prompts); prefill does 2 FLOPs per weight used and token (÷ the
    dense matmul rate)."""
    from snapfn.handler.llm.engine.memory import step_weights, weights_bytes
    from snapfn.handler.llm.engine.request import SamplingParams
    from snapfn.snapshot.portable.bandwidth import measure_matmul_tflops, measure_memory_gbps
    from snapfn.snapshot.runtime import cold_init

    fn = _function(args, Path(args.model))
    cold_init(fn, log=None)
    model, engine = fn.model, fn.engine
    weight_bytes = weights_bytes(model)
    gbps = measure_memory_gbps(args.device)
    tflops = measure_matmul_tflops(args.device, model.dtype)
    decode, read = {}, {}
    for key, ms in _decode_figures(engine, args).items():
        batch = key.removesuffix("_ms_per_step")
        read[batch] = step_weights(model, int(batch.removeprefix("batch")))[0]
        roof_ms = read[batch] / (gbps * 1e9) * 1e3
        decode[batch] = {"ms": ms, "roofline_ms": round(roof_ms, 3), "x": round(ms / roof_ms, 2)}
    n = min(args.prefill_tokens, engine.max_req_input_len)
    vocab = model.config.vocab_size
    # NOTE: the timed prompt is not the warm-up's: it would find every full page of it in the
    # prefix cache (on by default) and prefill only its last page (the steady figures dated
    # 2026-12-07 and before, after prefix caching came on, timed such a hit)
    warm, prompt = ([(7919 * i + 11 + k) % vocab for i in range(n)] for k in (1, 0))
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    engine.generate([warm], one)  # warm-up: this prompt length's shapes
    _sync(args.device)
    t0 = time.perf_counter()
    engine.generate([prompt], one)
    _sync(args.device)
    tokens_per_s = n / (time.perf_counter() - t0)
    roof_tps = tflops * 1e12 / (2 * step_weights(model, n)[1])
    short = _short_prefill_figures(engine, args)
    return {
        "weight_bytes": weight_bytes,
        "decode_read_bytes": read,
        "memory_gbps": round(gbps, 1),
        "matmul_tflops": round(tflops, 2),
        "decode": decode,
        "prefill": {
            "tokens": n,
            "tokens_per_s": round(tokens_per_s, 1),
            "roofline_tokens_per_s": round(roof_tps, 1),
            "x": round(roof_tps / tokens_per_s, 2),
        },
        "short_prefill": short,
        "backend": getattr(getattr(model, "backend", None), "name", "?"),
        "deepgemm": bool(getattr(model.backend, "deepgemm_in_use", lambda: False)()),
    }


SHORT_PREFILL_TOKENS = (8, 32, 64)


def _short_prefill_figures(engine, args: argparse.Namespace) -> list[dict[str, Any]]:
    """A one-token request's milliseconds for short prompts, eager and replayed through the
    decode graphs a row a token (engine.py, `_replay_rows`), side by side: each the best of
    three, every run a prompt of its own (no prefix-cache hit). Without captured graphs (CPU)
    the rows' figure is absent."""
    from snapfn.handler.llm.engine.request import SamplingParams

    vocab, one = engine.model.config.vocab_size, SamplingParams(max_new_tokens=1, ignore_eos=True)
    runs = itertools.count()

    def best_ms(n: int, rows: bool) -> tuple[float, int]:
        times, replays = [], engine.graphs.stats.prefill_replays if engine.graphs else 0
        for _ in range(4):  # the first: warm-up
            offset = 104729 * next(runs)
            prompt = [(offset + 7919 * i + 11) % vocab for i in range(n)]
            with engine.prefills_as_rows(rows):
                _sync(args.device)
                t0 = time.perf_counter()
                engine.generate([prompt], one)
                _sync(args.device)
            times.append(time.perf_counter() - t0)
        after = engine.graphs.stats.prefill_replays if engine.graphs else 0
        return round(min(times[1:]) * 1e3, 3), after - replays

    figures = []
    for n in SHORT_PREFILL_TOKENS:
        if n > min(engine.prefill_graph_tokens, engine.max_req_input_len):
            continue
        eager_ms, _ = best_ms(n, False)
        rows_ms, replays = best_ms(n, True)
        entry = {"tokens": n, "eager_ms": eager_ms}
        if replays:  # every run replayed (4); none: no graph holds n rows
            entry.update(rows_ms=rows_ms, x=round(eager_ms / rows_ms, 2))
        figures.append(entry)
    return figures


def _config(args: argparse.Namespace, **more: object):
    from snapfn.handler.llm.init_config import InitConfig

    overrides = {
        "device": args.device,
        "cache_dir": Path(args.cache_dir) if args.cache_dir else None,
        **more,
    }
    return InitConfig.from_env(os.environ, **overrides)


def _function(args: argparse.Namespace, model_dir: Path | None, **more: object):
    from snapfn.handler.llm.recipes.function import LLMFunction

    return LLMFunction(_config(args, **more), model_dir)


def _first_token(engine, args: argparse.Namespace) -> dict[str, Any]:
    from snapfn.handler.llm.engine.request import SamplingParams

    (result,) = engine.generate([PROMPT_IDS], SamplingParams(max_new_tokens=1, ignore_eos=True))
    _sync(args.device)
    return {
        "first_token_s": since(args.t0),
        "token": result.token_ids[0],
        "logprob": result.logprobs[0],
    }


def _two_tokens_s(engine, args: argparse.Namespace) -> float:
    """Seconds of a two-token generation of the first token's prompt (a prefill and one decode
    step), right after it."""
    from snapfn.handler.llm.engine.request import SamplingParams

    t0 = time.perf_counter()
    engine.generate([PROMPT_IDS], SamplingParams(max_new_tokens=2, ignore_eos=True))
    _sync(args.device)
    return round(time.perf_counter() - t0, 4)


def distinct_prompts(batch: int, vocab: int) -> list[list[int]]:
    """`batch` prompts as long as `PROMPT_IDS`, each of other tokens, so that a MoE model's
    rows route to different experts as the roofline (`memory.step_weights`) assumes."""
    return [[(t + 7919 * row) % vocab for t in PROMPT_IDS] for row in range(batch)]


def _decode_figures(engine, args: argparse.Namespace) -> dict[str, float]:
    """Steady-state decode ms per step at each batch size (after one warm-up generation): a
    generation of `2 * decode_tokens` tokens less one of `decode_tokens`, over the steps
    between (`_ms_per_step`), so that neither the prompt's prefill nor a generation's end steps
    count as steady decode. The rows are distinct prompts (`distinct_prompts`). NOTE: before
    commit 2737f03 the figure was one whole generation over its tokens, the prefill included;
    before 6f506e2 every row was the same prompt, so a MoE model's rows all read the same
    experts (its batch 8-64 figures beat a roofline that counts the experts a uniform router
    would touch)."""
    from snapfn.handler.llm.engine.request import SamplingParams

    vocab = engine.model.config.vocab_size

    def timed(batch: int, tokens: int) -> float:
        params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
        _sync(args.device)
        t0 = time.perf_counter()
        engine.generate(distinct_prompts(batch, vocab), params)
        _sync(args.device)
        return time.perf_counter() - t0

    figures = {}
    for b in [int(x) for x in args.decode_batches.split(",") if x]:
        timed(b, 2)  # warm-up
        figures[f"batch{b}_ms_per_step"] = _ms_per_step(
            lambda n, b=b: timed(b, n), args.decode_tokens
        )
    return figures


def _ms_per_step(timed, tokens: int) -> float:
    """Steady decode ms per step from `timed(n)`, the seconds of an n-token generation: `2 *
    tokens` tokens less `tokens`, over `tokens`. Both generations hold the prefill and the steps
    at a generation's ends that the overlapped loop cannot hide (the first decode step, launched
    after the prefill's token lands, and the last, which ends by length and is not launched
    early), so the difference is steady steps only. Each is the best of two runs, so that one
    stall (another process on a small CI machine) does not swallow the difference.
    When noise swamps the difference (a tiny model on a busy CPU: the long generation's best
    is no slower than the short one's), the figure is the long generation's best over its
    tokens instead, an upper bound that counts the prefill too, and stderr says so: a step time
    of zero or less is never reported.
    NOTE: before commit ccbdee5 the figure was `tokens` tokens less one, over `tokens - 1` steps,
    which counted those end steps in (the steady figures dated 2026-11-30 in docs/benchmarks.md);
    before 93fb5f9 a swamped difference was reported as 0.0 (a CI run's flaky failure)."""
    steps = max(1, tokens)
    long = min(timed(2 * steps) for _ in range(2))
    seconds = long - min(timed(steps) for _ in range(2))
    if seconds <= 0:
        print(
            f"decode: {2 * steps} tokens took no longer than {steps} (timing noise); "
            f"reporting the {2 * steps}-token generation's mean per token, prefill included",
            file=sys.stderr,
        )
        return round(long / (2 * steps) * 1e3, 3)
    return round(seconds / steps * 1e3, 3)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def zygote_target(args: dict[str, Any], channel) -> None:
    """Entry point of a worker forked from a zygote: run one mode, answer on the channel (its
    exception as the result's one-line `error`, as a fresh process's child reports it)."""
    parsed = parse_args(args["argv"])
    try:
        result = MODES[parsed.mode](parsed)
    except Exception as exc:
        reason = f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}".splitlines()[0]
        channel.send({"mode": parsed.mode, "error": reason})
        raise
    channel.send({"mode": parsed.mode, **result})


MODES = {
    "hf": mode_hf,
    "safetensors": mode_safetensors,
    "cold_init": mode_cold_init,
    "restore": mode_restore,
    "init_process": mode_init_process,
    "restore_process": mode_restore_process,
    "steady": mode_steady,
    "restore_s3": mode_restore_s3,
    "s3_floor": mode_s3_floor,
    "prefix": lambda args: mode_prefix(
        args, lambda: _function(args, Path(args.model)), lambda: _sync(args.device)
    ),
    "mtp": lambda args: mode_mtp(
        args,
        lambda k: _function(args, Path(args.model), speculative_tokens=k),
        lambda: _sync(args.device),
    ),
    "structured_init": lambda args: mode_structured_init(args, lambda d: _function(args, d)),
    "structured_restore": lambda args: mode_structured_restore(args, lambda d: _function(args, d)),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_child")
    p.add_argument("mode", choices=sorted(MODES))
    p.add_argument("--model", default=None)
    p.add_argument("--snapshot", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--t0", type=float, required=True)
    p.add_argument("--decode-batches", default="")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--prefill-tokens", type=int, default=2048)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = {"mode": args.mode, **MODES[args.mode](args)}
    print("BENCH_RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
