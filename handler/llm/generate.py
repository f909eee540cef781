"""`snapfn generate`: load a model (default: the embedded one), generate, print text or JSON.

Timing figures (load, prefill, decode ms/token) go to stderr so `--json` output stays clean.
The sampling flags take the API's ranges (`SamplingParams.validate`: temperature in [0, 2]),
checked before anything loads (`--device`: by the CLI, `cli.check_device`); a restore's stages
are printed once, as they run, then its outcome.
`--batch-size N` runs N copies of the prompt together, which is how decode speed at batch N
is measured.

`--tp-size N` runs the model tensor-parallel over N ranks (each holding 1/N of every layer's
heads and columns, `models/tensor_parallel.py`), `--ep-size M` a MoE model's routed experts
expert-parallel over M (each rank 1/M of them); `N * M` processes in all, which the command
starts itself (`ranks.py`) or torchrun gives:

    snapfn generate --model M --tp-size 2
    torchrun --nproc-per-node 2 -m snapfn.handler.cli generate --model M --ep-size 2 [--device cuda]

Every rank generates the prompt (`--ep-dispatch all_to_all`: each its own copy, the tokens
dispatched to their experts' ranks; `replicated`: every rank runs every token and the experts'
shares are all-reduced); rank 0 prints. The ranks meet over NCCL on CUDA (`cuda:LOCAL_RANK`
each) and gloo on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from snapfn.handler.function.target_flags import add_snapshot_arguments, opened_snapshot
from snapfn.handler.llm.engine.request import MAX_PENALTY, MAX_TEMPERATURE
from snapfn.handler.llm.parallel import EP_DISPATCHES, ParallelConfig
from snapfn.handler.llm.ranks import parallel_ranks
from snapfn.snapshot.errors import BadRequest


@dataclass(frozen=True)
class GenerateDefaults:
    prompt: str = "Once upon a time"
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    device: str = "cpu"
    dtype: str = "auto"
    batch_size: int = 1
    kv_cache_mb: int = 256


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = GenerateDefaults()
    p.add_argument(
        "--model", type=Path, default=None, help="HF model folder (default: the embedded model)"
    )
    add_snapshot_arguments(
        p, "restore from this snapshot instead of loading the model (falls back to a cold init)"
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None, help=f"prompt text (default: {d.prompt!r})")
    src.add_argument("--prompt-ids", default=None, help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template"
    )
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help=">= 1")
    p.add_argument(
        "--temperature",
        type=float,
        default=d.temperature,
        help=f"in [0, {MAX_TEMPERATURE:g}], as the API; below 1e-5: greedy",
    )
    p.add_argument("--top-p", type=float, default=d.top_p, help="in (0, 1]")
    p.add_argument("--top-k", type=int, default=d.top_k, help="0 = off")
    p.add_argument("--seed", type=int, default=None, help="not set: a fresh draw each run")
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=d.repetition_penalty,
        help=f"in (0, {MAX_PENALTY:g}], over prompt and output tokens; 1 = off",
    )
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument(
        "--ignore-eos", action="store_true", help="keep going past end-of-sequence tokens"
    )
    p.add_argument("--device", default=d.device, help="cpu or cuda[:N]")
    p.add_argument("--dtype", default=d.dtype, help="auto, float32, bfloat16 or float16")
    p.add_argument(
        "--batch-size", type=int, default=d.batch_size, help="run N copies of the prompt together"
    )
    p.add_argument("--kv-cache-mb", type=int, default=d.kv_cache_mb, help="KV pool size in MiB")
    p.add_argument(
        "--json", action="store_true", help='print {"token_ids", "text", "logprobs"} as JSON'
    )
    p.add_argument(
        "--tp-size",
        type=int,
        default=1,
        help="tensor-parallel ranks, one process each (started here, or by torchrun)",
    )
    p.add_argument(
        "--ep-size",
        type=int,
        default=1,
        help="expert-parallel ranks of a MoE model (times --tp-size processes in all)",
    )
    p.add_argument(
        "--ep-dispatch",
        choices=EP_DISPATCHES,
        default=ParallelConfig.ep_dispatch,
        help="how tokens meet other ranks' experts (with --ep-size > 1)",
    )


def _prompt_ids(args: argparse.Namespace, tokenizer) -> list[int]:
    if args.prompt_ids is not None:
        try:
            return [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError as exc:
            raise BadRequest(f"--prompt-ids must be comma-separated integers ({exc})") from exc
    if tokenizer is None:
        raise BadRequest(
            "this model folder has no tokenizer.json: pass --prompt-ids instead of --prompt"
        )
    text = args.prompt if args.prompt is not None else GenerateDefaults().prompt
    if args.chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(text)


def run(args: argparse.Namespace) -> int:
    from snapfn.handler.llm.engine.request import SamplingParams
    from snapfn.handler.llm.recipes.process_restore import process_restore_enabled

    if args.batch_size < 1:
        raise BadRequest(f"--batch-size must be >= 1, got {args.batch_size}")
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        repetition_penalty=args.repetition_penalty,
    ).validate()
    # NOTE: an s3:// cache miss of one rank is restored as it is pulled (recipes/s3_restore.py);
    # any other is pulled first, then checked
    opened = opened_snapshot(args, _streamed(args))
    snapshot, pull = (opened.path, opened.pull) if opened is not None else (None, None)
    if args.ep_size * args.tp_size != 1 and snapshot is not None:
        if "RANK" in os.environ:
            raise BadRequest(
                "--snapshot with --tp-size/--ep-size under torchrun: let snapfn start the ranks"
                " (run it without torchrun)"
            )
        return _run_restored_service(args, snapshot, params)
    if process_restore_enabled(snapshot):
        return _run_restored_service(args, snapshot, params)
    from snapfn.handler.llm.build import EngineOptions, build_engine
    from snapfn.handler.llm.embedded import embedded_model_dir

    model_dir = args.model or embedded_model_dir()
    again = getattr(args, "command_line", None)  # set by the CLI: what the other ranks run
    command = [sys.executable, "-m", "snapfn.handler.cli", *again] if again else None
    ranks = parallel_ranks(args.tp_size, args.ep_size, args.ep_dispatch, args.device, None, command)
    with ranks as (parallel, device):
        t0 = time.perf_counter()
        if snapshot is not None:
            engine, model_type = _restore(args, snapshot, pull)
        else:
            opts = EngineOptions(
                device=device,
                dtype=args.dtype,
                kv_cache_bytes=args.kv_cache_mb << 20,
                parallel=parallel,
            )
            loaded = build_engine(model_dir, opts)
            engine, model_type = loaded.engine, loaded.config.model_type
        load_s = time.perf_counter() - t0
        source = args.snapshot or model_dir
        if parallel.ep_size > 1:
            _say_experts_held(engine.model, parallel, model_dir)
        parts = [f"tp {parallel.tp_size}"] if parallel.tp_size > 1 else []
        if parallel.ep_size > 1:
            parts.append(f"ep {parallel.ep_size}, {parallel.ep_dispatch}")
        if parts:
            source = f"{model_dir} ({', '.join(parts)})"
        ids = _prompt_ids(args, engine.tokenizer)
        if snapshot is None and engine.model.device.type == "cuda":
            one_rank = parallel.tp_size * parallel.ep_size == 1
            _warm_shapes(engine, args.batch_size, ids, params, graphs=one_rank)
            load_s = time.perf_counter() - t0
        timing = _timed_generate(engine, [ids] * args.batch_size, params)
        result = timing.pop("results")[0]
        if parallel.ep_rank == 0 and parallel.tp_rank == 0:  # one rank prints
            _report(args, source, model_type, engine, load_s, timing)
            _print_result(args, result, engine.tokenizer is not None)
    return 0


def _warm_shapes(engine, batch_size: int, ids: list[int], params, graphs: bool) -> None:
    """Before the generation is timed, on CUDA: its decode graph captured (batch `batch_size`;
    with `graphs`, one rank, where the model's decode captures), then a two-token generation of
    the same shapes, so every kernel of the prefill, the sampler and a decode step compiles (and
    picks its config) here, and the decode loop replays a graph and compiles nothing."""
    from dataclasses import replace

    from snapfn.handler.llm.engine.graphs import decode_captures
    from snapfn.handler.llm.init_config import InitConfig

    model = engine.model
    if graphs and decode_captures(model) and not model.lockstep:
        max_seq_len = len(ids) + params.max_new_tokens + 1
        engine.capture_graphs([batch_size], min(max_seq_len, InitConfig().graph_max_seq_len))
    engine.generate([list(ids)] * batch_size, replace(params, max_new_tokens=2, ignore_eos=True))


def _say_experts_held(model, parallel: ParallelConfig, model_dir: Path) -> None:
    held = getattr(model, "local_experts", None)
    if held is None:
        raise BadRequest(f"--ep-size: {model_dir} has no routed experts to split")
    print(
        f"[snapfn] ep rank {parallel.ep_rank} of {parallel.ep_size}: routed experts "
        f"{held.start}-{held.stop - 1} of each MoE layer's {model.config.moe.n_routed_experts}",
        file=sys.stderr,
    )


def _run_restored_service(args: argparse.Namespace, snapshot: Path, params) -> int:
    """A snapshot with a process image, or one of several ranks: restore it (tier 1, falling
    back to tier 0 → cold; several ranks started here) and generate through the service, as the
    front doors do."""
    from snapfn.handler.llm.init_config import InitConfig
    from snapfn.handler.llm.recipes.process_restore import restore_llm
    from snapfn.snapshot.runtime import summary

    config = InitConfig.from_env(
        os.environ,
        device=args.device,
        dtype=args.dtype,
        tp_size=args.tp_size,
        ep_size=args.ep_size,
        ep_dispatch=args.ep_dispatch,
    )
    t0 = time.perf_counter()
    if config.world_size > 1:  # this process is rank 0 and starts the others
        from snapfn.handler.function.runtime import init_llm_ranks
        from snapfn.handler.function.target import ServeTarget

        target = ServeTarget(model_dir=args.model, snapshot_dir=snapshot, init_config=config)
        service, startup, _ = init_llm_ranks(target, log=None)
    else:
        service, startup, _ = restore_llm(snapshot, config, args.model, log=None)
    load_s = time.perf_counter() - t0
    print(summary(startup), file=sys.stderr)
    try:
        ids = _prompt_ids(args, service.tokenizer)
        start = time.perf_counter()
        streams = [service.submit(ids, params) for _ in range(args.batch_size)]
        result = streams[0].result()
        for stream in streams[1:]:
            stream.result()
        first = streams[0].first_token_at or time.perf_counter()
        total = time.perf_counter() - start
    finally:
        service.close()
    steps = max(len(result.token_ids) - 1, 1)
    print(
        f"[snapfn] {args.snapshot} ({startup.tier}) on {args.device}: ready in {load_s:.2f} s; "
        f"batch {args.batch_size}: first token {(first - start) * 1e3:.1f} ms, "
        f"decode {(total - (first - start)) / steps * 1e3:.2f} ms/token",
        file=sys.stderr,
    )
    _print_result(args, result, service.tokenizer is not None)
    return 0


def _print_result(args: argparse.Namespace, result, has_tokenizer: bool) -> None:
    if args.json:
        doc = {"token_ids": list(result.token_ids), "text": result.text}
        print(json.dumps({**doc, "logprobs": list(result.logprobs)}))
    else:
        print(result.text if has_tokenizer else " ".join(map(str, result.token_ids)))


def _timed_generate(engine, prompts: list[list[int]], params) -> dict:
    """Generate, timing the first step (prefill) apart from the decode steps.

    Returns the figures and, under "results", the first request's merged outputs.
    """
    _sync(engine)
    ids = [engine.add_request(p, params) for p in prompts]
    t0 = time.perf_counter()
    first, steps, outputs = None, 0, []
    while engine.any_rank_busy(engine.has_work()):  # an expert-parallel rank: in lock step
        outs = engine.step()
        _sync(engine)
        steps += 1
        if first is None and outs:
            first = time.perf_counter() - t0
        outputs += [o for o in outs if o.request_id == ids[0]]
    total = time.perf_counter() - t0
    decode_steps = max(steps - 1, 1)
    return {
        "first_token_s": first or total,
        "decode_ms_per_step": (total - (first or 0)) / decode_steps * 1e3,
        "decode_steps": decode_steps,
        "results": [_merge(ids[0], outputs)],
    }


def _merge(request_id: str, outs: list):
    from snapfn.handler.llm.engine.request import GenerationResult

    return GenerationResult(
        request_id=request_id,
        prompt_ids=(),
        token_ids=tuple(t for o in outs for t in o.new_token_ids),
        logprobs=tuple(lp for o in outs for lp in o.new_logprobs),
        text="".join(o.text_delta for o in outs),
        finish_reason=outs[-1].finish_reason or "unknown",
    )


def _sync(engine) -> None:
    if engine.model.device.type == "cuda":
        import torch

        torch.cuda.synchronize(engine.model.device)


def _streamed(args: argparse.Namespace) -> tuple[str, ...]:
    """What a restore of an s3:// snapshot streams as it is pulled (several ranks: nothing)."""
    from snapfn.handler.llm.recipes.s3_restore import STREAMED

    return STREAMED if args.tp_size * args.ep_size == 1 else ()


def _restore(args: argparse.Namespace, snapshot: Path, pull=None):
    """Restore the LLM function from a snapshot (tier 0; `pull`: an s3:// one still arriving,
    followed), falling back to a cold init from `--model`, else from the snapshot's recorded
    source once its content hash matches; with neither, NoTrustedSource (the CLI prints its one
    line and exits non-zero)."""
    from snapfn.handler.llm.init_config import InitConfig
    from snapfn.handler.llm.recipes.function import LLMFunction
    from snapfn.handler.llm.recipes.s3_restore import restore_following
    from snapfn.handler.llm.recipes.sources import llm_fallback
    from snapfn.snapshot.runtime import restore, stderr_log

    config = InitConfig.from_env(os.environ, device=args.device, dtype=args.dtype)
    if pull is not None:
        fn, startup = restore_following(pull, config, args.model, stderr_log)
        _print_outcome(startup)
        return fn.engine, fn.engine.model.config.model_type
    fallback = llm_fallback(config, args.model)
    fn, startup = restore(lambda: LLMFunction(config, args.model), snapshot, fallback=fallback)
    _print_outcome(startup)  # NOTE: its stages were printed as they ran
    return fn.engine, fn.engine.model.config.model_type


def _print_outcome(startup) -> None:
    """A restore's outcome and fallbacks, once its stages are printed."""
    verdict = "ok" if startup.ok else "FAILED"
    print(f"{startup.kind} ({startup.tier}) {verdict} in {startup.total_s:.3f} s", file=sys.stderr)
    for fb in startup.fallbacks:
        line = f"  fallback {fb['from']} → {fb['to']} at {fb['step']}: {fb['reason']}"
        print(line, file=sys.stderr)


def _report(args, source, model_type: str, engine, load_s: float, timing: dict) -> None:
    print(
        f"[snapfn] {source} ({model_type}, {engine.model.dtype}) on {args.device}: "
        f"ready in {load_s:.2f} s; "
        f"batch {args.batch_size}: first token {timing['first_token_s'] * 1e3:.1f} ms, "
        f"decode {timing['decode_ms_per_step']:.2f} ms/step over {timing['decode_steps']} steps",
        file=sys.stderr,
    )
