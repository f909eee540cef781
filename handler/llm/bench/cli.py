"""`snapfn bench`: cold-start modes side by side in one run, each in a fresh process
(`--function mod:handler`: a user function's, handler/function/bench.py).

    (a) hf           transformers from_pretrained + generate (what users do today)
    (b) safetensors  safetensors.load_file into our engine, eager, no snapshot
    (c) cold_init    snapfn's staged init (then writes the snapshot for d/e)
    (d) restore      tier-0 restore, snapshot files in the page cache
    (d') restore_zygote  the same, forked from a warm zygote (imports done, CUDA untouched):
                     the cold start of a host that keeps a zygote, as `serve` does
    (e) restore_cold tier-0 restore after dropping the snapshot from the page cache, and as root
                     the whole page cache (torch's libraries too): a machine's first start
    (e'') restore_cold_snapshot  the same with only the snapshot's files dropped (the machine's
                     libraries cached, as on a host that has run the image before)
    (e') restore_drifted  tier-0 restore of a copy of the snapshot whose compat key names another
                     GPU, driver and torch (cache-only fields): its caches dropped, kernels
                     compiled and graphs captured again into an empty cache folder, the
                     weights still streamed from the snapshot
    (h) restore_s3   the snapshot pushed to S3 (`--s3-endpoint`, else a moto server started
                     here), restored in a fresh process into an empty snapshot cache: pulled
                     whole then restored, and restored while it is pulled (overlapped); beside
                     the bytes' floor, the same GETs with the same threads into memory
    (i) prefix       after a cold init, a long shared prefix's first token on a prefix-cache
                     hit against a miss (bench/prefix.py)
    (j) structured   a structured request's latency, first against tenth, after a cold init
                     and after its restore, with the schema configured and without
                     (bench/structured.py)
    (k) mtp          after a cold init of a model with MTP layers, greedy decode with 0..3
                     drafts a step: ms/step, tokens/step, speed-up, acceptance (bench/mtp.py)

`steady`, `restore_s3`, `prefix`, `structured` and `mtp` run only when named in `--modes`.
Modes run in `--modes`' order; a restore mode restores the snapshot an earlier mode wrote into
the workdir (`cold_init`'s; `init_process`'s for the `*_process` ones).

Floors: weight bytes / pinned host→device bandwidth (d's floor) and weight bytes / disk read
bandwidth (e's floor), both measured in this run; each mode is printed as a ratio to its floor.
Outputs a table, a JSON file and a waterfall plot of the staged modes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from snapfn.handler.function.bench import run_mode_process

ALL_MODES = (
    "hf",
    "safetensors",
    "cold_init",
    "restore",
    "restore_zygote",
    "restore_cold",
    "restore_cold_snapshot",
    "restore_drifted",
    "init_process",
    "restore_process",
    "restore_process_zygote",
    "steady",
    "restore_s3",
    "prefix",
    "structured",
    "mtp",
)


ASKED_FOR = ("steady", "restore_s3", "prefix", "structured", "mtp")  # only when named in --modes


@dataclass(frozen=True)
class BenchDefaults:
    device: str = "cpu"
    modes: str = ",".join(m for m in ALL_MODES if m not in ASKED_FOR)
    decode_batches: str = "1,8"
    decode_tokens: int = 16
    prefill_tokens: int = 2048
    timeout_s: int = 900


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = BenchDefaults()
    p.add_argument(
        "--model", type=Path, default=None, help="HF model folder (default: the embedded model)"
    )
    p.add_argument("--device", default=d.device)
    p.add_argument(
        "--modes",
        default=d.modes,
        help=f"comma-separated subset of {','.join(ALL_MODES)}, run in that order; a restore"
        " mode restores what an earlier mode of the same run wrote (cold_init; init_process for"
        " the *_process ones), or what --workdir holds from an earlier run",
    )
    p.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where the snapshot and caches go (default: a temp dir)",
    )
    p.add_argument("--out", type=Path, default=None, help="write the JSON results here")
    p.add_argument("--plot", type=Path, default=None, help="write the waterfall PNG here")
    p.add_argument(
        "--decode-batches", default=d.decode_batches, help="steady-state decode batch sizes"
    )
    p.add_argument("--decode-tokens", type=int, default=d.decode_tokens)
    p.add_argument(
        "--prefill-tokens",
        type=int,
        default=d.prefill_tokens,
        help="prompt length of the steady mode's prefill figure",
    )
    p.add_argument("--timeout-s", type=int, default=d.timeout_s, help="per mode")
    p.add_argument(
        "--s3-endpoint",
        default=None,
        help="restore_s3: the S3 endpoint to push to (credentials from boto3's usual places;"
        " default: a moto server started here)",
    )
    fn = p.add_argument_group(
        "a user function instead of the LLM (modes: cold, restore_portable, restore_process)"
    )
    fn.add_argument("--function", default=None, help="module:handler to bench")
    fn.add_argument("--function-dir", type=Path, default=None, help="folder searched first")
    fn.add_argument(
        "--event",
        default=None,
        help="the event every mode answers (JSON; default: its health event)",
    )
    fn.add_argument(
        "--concurrency",
        default=None,
        metavar="N,N,…",
        help="also restore the process image N times at once, each in a fresh process, for each"
        " N (e.g. 1,2,4): every copy's first answer, the slowest beside one alone (CPU workers"
        " each have a pid namespace; on CUDA set SNAPFN_PROCESS_PID_NAMESPACE=mount for init)",
    )
    fn.add_argument(
        "--keeper",
        choices=("auto", "none", "page-cache", "copy"),
        default="auto",
        help="tier 1 once more with `snapfn keeper --hold H` holding the snapshot's device-memory"
        " file pinned (mode restore_process_keeper; the plain restore_process runs with no"
        " keeper). auto: page-cache on CUDA, none on CPU",
    )


# why a mode that starts from the run's tier-0 snapshot did not run
NO_SNAPSHOT = "no snapshot in the workdir: add cold_init to --modes, before this mode"


# What `restore_drifted`'s copy of the snapshot says it was made with: only fields outside the
# layout (compat.LAYOUT_FIELDS), so that tier 0 restores it with its caches dropped.
DRIFTED_COMPAT = {"torch": "0.0.1", "gpu_name": "another GPU", "driver_version": "1.0.0"}


# modes a zygote's child runs (run_zygote_mode), and the child mode each runs
ZYGOTE_MODES = {"restore_zygote": "restore", "restore_process_zygote": "restore_process"}


def child_argv(mode: str, args: argparse.Namespace, workdir: Path, extra: list[str]) -> list[str]:
    child_mode = (
        "restore"
        if mode in ("restore_zygote", "restore_cold", "restore_cold_snapshot", "restore_drifted")
        else ZYGOTE_MODES.get(mode, mode)
    )
    process = child_mode.endswith("_process")
    snapshot = workdir / ("snapshot_process" if process else "snapshot")
    cache = workdir / "cache"
    if mode == "restore_drifted":
        snapshot, cache = workdir / "snapshot_drifted", workdir / "cache_drifted"
    from snapfn.handler.llm.bench.child import restore_argv

    return restore_argv(child_mode, args.model, snapshot, args.device, cache, *extra)


def drifted_copy(snapshot: Path, dest: Path) -> None:
    """`dest`: `snapshot`'s files hard-linked (copied across file systems), its manifest's
    compat key edited by `DRIFTED_COMPAT`, as if made on another GPU, driver and torch."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(snapshot, dest, copy_function=_link_or_copy)
    manifest_path = dest / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["compat"].update(DRIFTED_COMPAT)
    manifest_path.unlink()  # a hard link: the original must keep its own text
    manifest_path.write_text(json.dumps(manifest, indent=1))


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def run_zygote_mode(
    mode: str, args: argparse.Namespace, workdir: Path, extra: list[str]
) -> dict[str, Any]:
    """Start a zygote (timed apart), then time fork → restore → first token: tier 0
    (`restore_zygote`) or tier 1 (`restore_process_zygote`: the restoring side forked, as a
    serve worker or an activator's instance is, the worker itself restored by criu)."""
    from snapfn.handler.llm.recipes.function import ZYGOTE_PRELOAD
    from snapfn.snapshot.zygote.owner import Zygote

    with Zygote.start(ZYGOTE_PRELOAD) as zygote, open(os.devnull, "w") as devnull:
        argv = child_argv(mode, args, workdir, extra)
        target = "snapfn.handler.llm.bench.child:zygote_target"
        worker = zygote.fork(target, {"argv": argv}, stdout=devnull, stderr=devnull)
        result = worker.channel.recv(timeout_s=args.timeout_s)
        code = worker.wait(timeout_s=60)
        preload_s = zygote.preload_seconds
    if result is None:
        return {"mode": mode, "error": f"worker exited {code} without a result"}
    return {**result, "mode": mode, "zygote_preload_s": round(preload_s, 3)}


def run_mode(
    mode: str, args: argparse.Namespace, workdir: Path, extra: list[str]
) -> dict[str, Any]:
    """Run one mode in a fresh process (or a zygote worker) and parse its result line."""
    if mode in ZYGOTE_MODES:
        return run_zygote_mode(mode, args, workdir, extra)
    from snapfn.handler.llm.bench.child import child_command

    argv = child_argv(mode, args, workdir, extra)
    cmd = child_command(argv)
    return run_mode_process(mode, cmd, args.timeout_s)


def measure_floors(args: argparse.Namespace, weights: Path) -> dict[str, Any]:
    from snapfn.snapshot.portable.bandwidth import measure_disk_read_gbps, measure_h2d_gbps

    nbytes = weights.stat().st_size
    h2d = measure_h2d_gbps(args.device) if args.device.startswith("cuda") else _memcpy_gbps()
    disk = measure_disk_read_gbps(weights)
    return {
        "weight_bytes": nbytes,
        "h2d_gbps": round(h2d, 2),
        "disk_gbps": round(disk, 2),
        "h2d_floor_s": round(nbytes / h2d / 1e9, 4),
        "disk_floor_s": round(nbytes / disk / 1e9, 4),
    }


def _memcpy_gbps(nbytes: int = 1 << 28) -> float:
    import torch

    src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(src)
    return 3 * nbytes / (time.perf_counter() - t0) / 1e9


def run(args: argparse.Namespace) -> int:
    import tempfile

    if args.function is not None:
        from snapfn.handler.function.bench import run as run_function_bench

        return run_function_bench(args)
    from snapfn.handler.llm.embedded import embedded_model_dir
    from snapfn.snapshot.portable.pagecache import drop, prewarm

    args.model = args.model or embedded_model_dir()
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(ALL_MODES)
    if unknown:
        print(f"snapfn bench: unknown modes {sorted(unknown)}", file=sys.stderr)
        return 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="snapfn-bench-"))
    decode = ["--decode-batches", args.decode_batches, "--decode-tokens", str(args.decode_tokens)]
    results, floors = {}, {}
    for mode in modes:
        weights = workdir / "snapshot" / "weights" / "rank0.bin"
        if mode == "restore" and weights.exists():
            floors = floors or measure_floors(args, weights)
            prewarm([p for p in (workdir / "snapshot").rglob("*") if p.is_file()])
        if mode in ("restore_process", "restore_process_zygote"):
            prewarm([p for p in (workdir / "snapshot_process").rglob("*") if p.is_file()])
        if mode in ("restore_cold", "restore_cold_snapshot"):
            if weights.exists():  # the disk's floor (its probe leaves the file cached)
                floors = floors or measure_floors(args, weights)
            files = [p for p in (workdir / "snapshot").rglob("*") if p.is_file()]
            everything = mode == "restore_cold" and os.geteuid() == 0
            if not drop(files, drop_caches=everything):
                results[mode] = {
                    "mode": mode,
                    "skipped": "the page cache could not be dropped on this machine",
                }
                continue
        if mode == "restore_drifted":
            if not (workdir / "snapshot" / "manifest.json").exists():
                results[mode] = {"mode": mode, "skipped": NO_SNAPSHOT}
                continue
            drifted_copy(workdir / "snapshot", workdir / "snapshot_drifted")
            shutil.rmtree(workdir / "cache_drifted", ignore_errors=True)
        print(f"[snapfn bench] running {mode} …", file=sys.stderr, flush=True)
        if mode == "restore_s3":
            results.update(run_s3_modes(args, workdir))
            continue
        if mode == "structured":
            from snapfn.handler.llm.bench.structured import run_structured_modes

            results.update(run_structured_modes(args, workdir, run_mode_process))
            continue
        with_decode = mode in ("cold_init", "restore_process", "restore_process_zygote")
        with_decode = with_decode or mode in ("steady", "mtp")
        extra = decode if with_decode else []
        if mode == "steady":
            extra = extra + ["--prefill-tokens", str(args.prefill_tokens)]
        results[mode] = run_mode(mode, args, workdir, extra)
        print(f"[snapfn bench] {mode}: {_brief(results[mode])}", file=sys.stderr, flush=True)
    report = {
        "model": str(args.model),
        "device": args.device,
        "machine": machine_name(args.device),
        "floors": floors,
        "modes": results,
        "ratios": ratios(results, floors),
    }
    print(format_report(report))
    _write_outputs(args, report)
    return 0 if all("error" not in r for r in results.values()) else 1


def _brief(result: dict[str, Any]) -> str:
    if "first_token_s" in result:
        return f"ready {result['ready_s']:.3f} s, first token {result['first_token_s']:.3f} s"
    if "hit_first_token_ms" in result:
        return f"first token {result['hit_first_token_ms']} ms on a prefix hit, {result['miss_first_token_ms']} on a miss"
    if "by_k" in result:  # mtp (bench/mtp.py)
        from snapfn.handler.llm.bench.mtp import brief

        return brief(result)
    if "prefill" in result:
        x = result["decode"].get("batch1", {}).get("x")
        return f"batch-1 decode {x}x its roofline" if x is not None else "no batch-1 decode figure"
    return result.get("error") or result.get("skipped") or "done (no timing in its result)"


def ratios(results: dict[str, Any], floors: dict[str, Any]) -> dict[str, float]:
    out = {}
    hf = results.get("hf", {}).get("first_token_s")
    for mode, r in results.items():
        if "first_token_s" not in r:
            continue
        if hf:
            out[f"{mode}_speedup_vs_hf"] = round(hf / r["first_token_s"], 2)
    stream = _stream_seconds(results.get("restore", {}))
    if stream and floors:
        out["restore_stream_vs_h2d_floor"] = round(stream / floors["h2d_floor_s"], 2)
    tier1, tier0 = (results.get(m, {}).get("first_token_s") for m in ("restore_process", "restore"))
    if tier1 and tier0:
        out["restore_process_speedup_vs_restore"] = round(tier0 / tier1, 2)
    cold_init, drifted = (
        results.get(m, {}).get("first_token_s") for m in ("cold_init", "restore_drifted")
    )
    if cold_init and drifted:
        out["restore_drifted_speedup_vs_cold_init"] = round(cold_init / drifted, 2)
    same = [
        m
        for m in ("restore", "restore_drifted", "restore_process", "restore_process_zygote")
        if _same_token(results, m)
    ]
    out.update({f"{m}_token_equals_cold_init": True for m in same})
    for mode in ("restore_cold", "restore_cold_snapshot"):
        cold = _stream_seconds(results.get(mode, {}))
        if cold and floors:
            out[f"{mode}_stream_vs_disk_floor"] = round(cold / floors["disk_floor_s"], 2)
    return {**out, **floor_ratios(results, floors), **s3_ratios(results)}


# each restore's floor: its weights' bytes moved at the rate that bounds it (`measure_floors`)
RESTORE_FLOORS = {
    "restore": "h2d_floor_s",
    "restore_zygote": "h2d_floor_s",
    "restore_process": "h2d_floor_s",
    "restore_process_zygote": "h2d_floor_s",
    "restore_cold": "disk_floor_s",
    "restore_cold_snapshot": "disk_floor_s",
}


def floor_ratios(results: dict[str, Any], floors: dict[str, Any]) -> dict[str, float]:
    """Each restore's first token over its floor: the host-to-device copy of the weights (page
    cache warm, and tier 1), the disk's read of them (`restore_cold`, page cache dropped)."""
    out = {}
    for mode, floor in RESTORE_FLOORS.items():
        seconds, floor_s = results.get(mode, {}).get("first_token_s"), (floors or {}).get(floor)
        if seconds and floor_s:
            out[f"{mode}_first_token_vs_{floor.removesuffix('_s')}"] = round(seconds / floor_s, 2)
    return out


# ---- (h) restore_s3 ------------------------------------------------------------------------------
S3_BUCKET = "snapfn-bench"
S3_RUNS = (("s3_floor", "floor", "on"), ("restore_s3", "sequential", "off"))
S3_RUNS += (("restore_s3", "overlapped", "on"),)  # (child mode, name, overlap)


def run_s3_modes(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Push the snapshot, then each of S3_RUNS in a fresh process: the GET floor, the restore
    pulled whole first, the restore overlapped with its pull (each into an empty cache)."""
    if not (workdir / "snapshot" / "manifest.json").exists():
        return {"restore_s3": {"mode": "restore_s3", "skipped": NO_SNAPSHOT}}
    from snapfn.handler.llm.bench.child import child_command, restore_argv
    from snapfn.snapshot.store.transfer import push

    uri, out = f"s3://{S3_BUCKET}/bench/{workdir.name}/snapshot", {}
    with _s3_endpoint(args.s3_endpoint) as (client, env):
        _s3_call_quietly(client.create_bucket, Bucket=S3_BUCKET)
        push(workdir / "snapshot", uri, client=client, log=None)
        for child_mode, name, overlap in S3_RUNS:
            shutil.rmtree(workdir / f"s3-{name}", ignore_errors=True)
            child_env = {
                **os.environ,
                **env,
                "SNAPFN_SNAPSHOT_CACHE": str(workdir / f"s3-{name}" / "snapshots"),
                "SNAPFN_SNAPSHOT_CACHE_OVERLAP": overlap,
            }
            cache = workdir / f"s3-{name}" / "c"
            cmd = child_command(restore_argv(child_mode, args.model, uri, args.device, cache))
            mode = f"restore_s3_{name}"
            out[mode] = run_mode_process(mode, cmd, args.timeout_s, env=child_env)
            print(f"[snapfn bench] {mode}: {_s3_brief(out[mode])}", file=sys.stderr, flush=True)
    return out


def _s3_brief(r: dict[str, Any]) -> str:
    if "s3_total_s" in r:
        return f"{r['s3_total_s']:.3f} s from the cache lookup to the restore's end"
    return r.get("error") or f"{r.get('seconds')} s for {r.get('bytes')} bytes"


def s3_ratios(results: dict[str, Any]) -> dict[str, Any]:
    floor = results.get("restore_s3_floor", {}).get("seconds")
    seq, ov = (results.get(f"restore_s3_{m}", {}) for m in ("sequential", "overlapped"))
    out = {}
    if floor and seq.get("s3_total_s"):
        out["restore_s3_sequential_vs_floor"] = round(seq["s3_total_s"] / floor, 2)
    if floor and ov.get("s3_total_s"):
        out["restore_s3_overlapped_vs_floor"] = round(ov["s3_total_s"] / floor, 2)
    if seq.get("s3_total_s") and ov.get("s3_total_s"):
        out["restore_s3_overlapped_speedup_vs_sequential"] = round(
            seq["s3_total_s"] / ov["s3_total_s"], 2
        )
        same = all(seq.get(k) == ov.get(k) is not None for k in ("token", "logprob"))
        out["restore_s3_overlapped_token_equals_sequential"] = same
    return out


@contextlib.contextmanager
def _s3_endpoint(endpoint: str | None):
    """(client, the environment a child needs): the endpoint given, else a moto server."""
    from snapfn.snapshot.store.s3 import make_s3_client

    if endpoint is not None:
        yield make_s3_client(endpoint), {"AWS_ENDPOINT_URL": endpoint}
        return
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # NOTE: it logs every request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_DEFAULT_REGION": "us-east-1"}
        env |= {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
        yield _client_of(env), env
    finally:
        server.stop()


def _client_of(env: dict[str, str]) -> Any:
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        region_name=env["AWS_DEFAULT_REGION"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
    )


def _s3_call_quietly(call, **kwargs) -> None:
    """A bucket that exists already is fine."""
    from botocore.exceptions import ClientError

    try:
        call(**kwargs)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou",):
            raise


def _same_token(results: dict[str, Any], mode: str) -> bool:
    cold, other = results.get("cold_init", {}), results.get(mode, {})
    keys = ("token", "logprob")
    return all(k in cold and k in other for k in keys) and all(cold[k] == other[k] for k in keys)


PROCESS_STEPS = (
    "validate",
    "criu_restore",
    "cuda_restore",
    "resume",
    "worker.cuda_ready",
    "worker.adopt",
    "worker.remap",
    "worker.stream_weights",
    "worker.replay_check",
    "connect",
)


def _stage(result: dict[str, Any], name: str) -> dict[str, Any] | None:
    stages = result.get("startup", {}).get("stages", [])
    return next((stage for stage in stages if stage["name"] == name), None)


def _stage_seconds(result: dict[str, Any], name: str) -> float | None:
    stage = _stage(result, name)
    return None if stage is None else stage["seconds"]


def _stream_seconds(result: dict[str, Any]) -> float | None:
    """The weights' stream's own seconds (its `elapsed_s`): beside the warmup (`start_stream`,
    the default) the `stream_weights` stage's seconds are only the wait for it at the join."""
    stage = _stage(result, "stream_weights")
    if stage is None:
        return None
    return stage.get("figures", {}).get("elapsed_s", stage["seconds"])


def format_report(report: dict[str, Any]) -> str:
    width = max([14, *map(len, report["modes"])])  # the mode column: its longest name
    lines = [
        f"snapfn bench: {report['model']} on {report['device']} ({report['machine']})",
        f"{'mode':<{width}} {'ready s':>9} {'first token s':>14}  notes",
    ]
    for mode, r in report["modes"].items():
        note = r.get("error") or r.get("skipped") or _notes(r)
        ready = f"{r['ready_s']:9.3f}" if "ready_s" in r else f"{'-':>9}"
        ttft = f"{r['first_token_s']:14.3f}" if "first_token_s" in r else f"{'-':>14}"
        lines.append(f"{mode:<{width}} {ready} {ttft}  {note}")
    f = report["floors"]
    if f:
        lines.append(
            f"floors: {f['weight_bytes'] / 1e9:.2f} GB weights; h2d {f['h2d_gbps']} GB/s -> "
            f"{f['h2d_floor_s']} s; disk {f['disk_gbps']} GB/s -> {f['disk_floor_s']} s"
        )
    lines += [f"{k}: {v}" for k, v in report["ratios"].items()]
    return "\n".join(lines)


def _notes(r: dict[str, Any]) -> str:
    parts = []
    if r.get("startup", {}).get("tier") == "process":
        steps = [(n, _stage_seconds(r, n)) for n in PROCESS_STEPS]
        parts.append(
            " ".join(f"{n.removeprefix('worker.')} {t:.3f}" for n, t in steps if t is not None)
        )
    stream = _stream_seconds(r)
    if stream is not None:
        gbps = _stage(r, "stream_weights").get("figures", {}).get("gbps")
        note = f"stream {stream:.3f} s" + (f" ({gbps} GB/s)" if gbps is not None else "")
        if _stage(r, "start_stream") is not None:  # beside the warmup: the join's wait too
            note += f", waited {_stage_seconds(r, 'stream_weights'):.3f} s"
        parts.append(note)
    if r.get("mode") == "steady" and r.get("prefill"):
        p = r["prefill"]
        parts.append(
            "decode ms/step "
            + ", ".join(
                f"{b} {d['ms']} (roofline {d['roofline_ms']}, {d['x']}x)"
                for b, d in r["decode"].items()
            )
            + f"; prefill {p['tokens_per_s']:.0f} tok/s (roofline {p['roofline_tokens_per_s']:.0f}, {p['x']}x)"
            + f"; {r['memory_gbps']} GB/s, {r['matmul_tflops']} TFLOP/s, backend {r['backend']}"
        )
        short = [
            f"{f['tokens']} tok {f['eager_ms']} ms eager"
            + (f", {f['rows_ms']} ms as graph rows ({f['x']}x)" if "rows_ms" in f else "")
            for f in r.get("short_prefill", [])
        ]
        if short:
            parts.append("short prompt, one token: " + "; ".join(short))
    elif r.get("decode"):
        parts.append("decode " + ", ".join(f"{k}={v}" for k, v in r["decode"].items()))
    if r.get("mode") == "prefix" and "hit_first_token_ms" in r:
        parts.append(
            f"{r['prompt_tokens']}-token prompts, {r['prefix_tokens']} shared: first token "
            f"{r['miss_first_token_ms']} ms on a miss, {r['hit_first_token_ms']} ms on a hit "
            f"({r['hit_speedup']}x; same tokens: {r['hit_tokens_equal_miss_tokens']})"
        )
    if r.get("mode") == "mtp" and "by_k" in r:
        from snapfn.handler.llm.bench.mtp import brief

        parts.append(brief(r))
    if "first_over_tenth" in r:  # structured (bench/structured.py)
        from snapfn.handler.llm.bench.structured import brief

        parts.append(brief(r))
    if r.get("fallbacks"):
        parts.append(f"FELL BACK: {r['fallbacks'][0]['reason']}")
    return "; ".join(parts)


def machine_name(device: str) -> str:
    """The machine a report ran on: the GPU and torch, or the CPU's architecture and cores."""
    import platform

    if device.startswith("cuda"):
        import torch

        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return f"{platform.machine()} CPU x{os.cpu_count()}"


def _write_outputs(args: argparse.Namespace, report: dict[str, Any]) -> None:
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    if args.plot is not None:
        from snapfn.handler.llm.recipes.waterfall import plot_waterfall

        staged = {m: r["startup"] for m, r in report["modes"].items() if "startup" in r}
        if not staged:
            print(
                f"snapfn bench: {args.plot} not written: no mode of this run recorded startup"
                " stages (the init and restore modes do)",
                file=sys.stderr,
            )
            return
        plot_waterfall(
            list(staged.values()),
            args.plot,
            title=f"snapfn bench: {report['model']}",
            labels=list(staged),
        )
