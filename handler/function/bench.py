"""`snapfn bench --function mod:handler`: a user function's cold start against its restores,
side by side in one run, each in a fresh process, to the first answer.

    init              `snapfn init --function` once: the snapshot the restores read (tier 1 and
                      the tier-0 files in it), timed apart
    cold              python + imports + the function's cold init + the first answer
    restore_portable  tier 0: the compile caches put back, the init hooks run again
    restore_process   tier 1: the checkpointed worker restored, its device memory filled
                      beside criu by a helper from the snapshot's file, no keeper running
    restore_process_keeper
                      tier 1 again with `snapfn keeper --hold page-cache|copy` (`--keeper`;
                      by default on CUDA) holding that file pinned: the keeper's warm driver
                      makes the regions, fills them at the PCIe rate and does the CUDA restore

Beside them: the device memory the snapshot keeps out of its image (the pool's bytes), the
image's own bytes, and the floor of moving the pool's bytes host → device at the pinned rate
measured in this run. Every mode answers the same event (`--event`, else the function's health
event), and the report says whether they all answered the same bits.

    python -m snapfn.handler.function.bench MODE --function F --snapshot DIR --device D
        --event JSON --t0 WALLCLOCK [--function-dir DIR]      (one mode, run by the above)

A mode prints `BENCH_RESULT <json>`, or on failure `BENCH_ERROR <json>` with its one-line
reason; `run_mode_process` (the LLM bench's too) turns a child that printed neither, or ran past
`--timeout-s`, into a one-line reason as well (`mode_failure`): a table never shows "?".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

FUNCTION_MODES = ("cold", "restore_portable", "restore_process")
RESULT_PREFIX, ERROR_PREFIX = "BENCH_RESULT ", "BENCH_ERROR "
MAX_REASON_CHARS = 300
# the last line of a Python traceback: `ValueError: …`, `snapfn.snapshot.errors.BadRequest: …`
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failed|Refused)\b")


def run(args: argparse.Namespace) -> int:
    """The bench of `args.function` (the `snapfn bench` flags): the table, JSON and exit 0 when
    every mode answered."""
    import tempfile

    from snapfn.handler.function.host import init_function_snapshot
    from snapfn.handler.function.user_function import check_device
    from snapfn.handler.llm.bench.cli import machine_name
    from snapfn.snapshot.portable.format import read_manifest
    from snapfn.snapshot.stages import stderr_log

    check_device(args.device)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="snapfn-bench-function-"))
    snapshot = workdir / "snapshot"
    start = time.perf_counter()
    print(f"[snapfn bench] init: snapshot of {args.function} …", file=sys.stderr, flush=True)
    init_function_snapshot(
        args.function,
        snapshot,
        args.function_dir,
        stderr_log,
        device=args.device,
        cache_root=workdir / "cache",  # NOTE: the process image maps what compiled there
    )
    init_s = time.perf_counter() - start
    manifest = read_manifest(snapshot)
    event = json.loads(args.event) if args.event else manifest["user_function"]["health_event"]
    results = {}
    for mode in FUNCTION_MODES:
        if mode == "restore_process" and manifest["tier"] != "process":
            results[mode] = {"mode": mode, "skipped": "the snapshot holds no process image"}
            continue
        print(f"[snapfn bench] running {mode} …", file=sys.stderr, flush=True)
        # NOTE: a cold start and a tier-0 restore start from empty compile caches, as on a
        # new machine; tier 1 reads the caches its image maps where init left them
        cache_root = workdir / f"cache-{mode}" if mode != "restore_process" else workdir / "cache"
        if mode == "restore_process":
            pid_free(manifest)
        # NOTE: "" turns the keeper off, whatever runs at the default socket
        results[mode] = run_mode(mode, args, snapshot, event, cache_root, SNAPFN_PINNED_SOCKET="")
    hold = keeper_hold(args)
    if hold is not None and "first_answer_s" in results.get("restore_process", {}):
        mode = "restore_process_keeper"
        print(
            f"[snapfn bench] running {mode} (keeper --hold {hold}) …", file=sys.stderr, flush=True
        )
        with running_keeper(hold, snapshot, workdir / "keeper", args.timeout_s) as address:
            pid_free(manifest)
            results[mode] = run_mode(
                "restore_process",
                args,
                snapshot,
                event,
                workdir / "cache",
                SNAPFN_PINNED_SOCKET=address,
            )
            results[mode]["mode"] = mode
            results[mode]["keeper"] = hold
    concurrent = {}
    for n in concurrency_levels(getattr(args, "concurrency", None)):
        if manifest["tier"] != "process":
            break
        print(f"[snapfn bench] {n} tier-1 restores at once …", file=sys.stderr, flush=True)
        concurrent[str(n)] = run_concurrently(n, args, snapshot, event, workdir / "cache")
    report = {
        "function": args.function,
        "device": args.device,
        "machine": machine_name(args.device),
        "event": event,
        "init_s": round(init_s, 3),
        "snapshot": snapshot_figures(manifest, args.device),
        "modes": results,
        **({"concurrent": concurrent} if concurrent else {}),
    }
    report["ratios"] = ratios(report)
    print(format_report(report))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return 0 if all("error" not in r for r in results.values()) else 1


def concurrency_levels(text: str | None) -> list[int]:
    """`--concurrency 1,2,4` as [1, 2, 4]; SystemExit with the reason for anything else."""
    if not text:
        return []
    try:
        levels = [int(part) for part in text.split(",")]
    except ValueError:
        raise SystemExit(f"snapfn bench: --concurrency {text!r}: comma-separated counts") from None
    if any(not 1 <= n <= 64 for n in levels):
        raise SystemExit(f"snapfn bench: --concurrency {text!r}: each count from 1 to 64")
    return levels


def run_concurrently(
    n: int, args: argparse.Namespace, snapshot: Path, event: Any, cache_root: Path
) -> dict[str, Any]:
    """`n` tier-1 restores of one image started at once, each in a fresh process: each copy's
    first answer, the slowest, whether all were tier 1 and answered alike."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(n) as pool:
        runs = list(
            pool.map(
                lambda _: run_mode(
                    "restore_process", args, snapshot, event, cache_root, SNAPFN_PINNED_SOCKET=""
                ),
                range(n),
            )
        )
    firsts = [r.get("first_answer_s") for r in runs]
    answers = {json.dumps(r.get("answer"), sort_keys=True) for r in runs}
    return {
        "first_answer_s": firsts,
        "slowest_s": max((f for f in firsts if f is not None), default=None),
        "tiers": [r.get("startup", {}).get("tier") or r.get("error") for r in runs],
        "fallbacks": [
            f["reason"] for r in runs for f in r.get("startup", {}).get("fallbacks", [])[:1]
        ],
        "answers_equal": len(answers) == 1 and all("answer" in r for r in runs),
    }


def pid_free(manifest: dict[str, Any]) -> None:
    """Before a tier-1 mode's clock starts: the pid its image restores into (a GPU worker's)
    freed by the copy the mode before restored, which exits once its caller has."""
    from snapfn.snapshot.process.worker_process import wait_for_pid

    pid = (manifest.get("process") or {}).get("host_pid")
    if isinstance(pid, int) and pid > 0 and Path(f"/proc/{pid}").exists():
        wait_for_pid(pid, 60.0, {})


def keeper_hold(args: argparse.Namespace) -> str | None:
    """What `--keeper` asks the keeper to hold, or None for no keeper run."""
    hold = getattr(args, "keeper", "none")
    if hold == "auto":
        hold = "page-cache" if args.device.startswith("cuda") else "none"
    return None if hold == "none" else hold


@contextlib.contextmanager
def running_keeper(hold: str, snapshot: Path, folder: Path, timeout_s: float):
    """`snapfn keeper --hold HOLD --snapshot SNAPSHOT` on a socket of its own in `folder`,
    until it says it serves; its address. Stopped with SIGTERM after."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    address, log_path = folder / "keeper.sock", folder / "keeper.log"
    argv = [sys.executable, "-m", "snapfn.handler.cli", "keeper", "--hold", hold]
    argv += ["--snapshot", str(snapshot), "--socket", str(address)]
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log_file)
    try:
        deadline = time.monotonic() + timeout_s
        while "serving on" not in log_path.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text().strip().splitlines()[-1:] or ["no output"]
                raise SystemExit(f"snapfn bench: the keeper did not start: {tail[0]}")
            time.sleep(0.1)
        print(f"[snapfn bench] {log_path.read_text().strip().splitlines()[-1]}", file=sys.stderr)
        yield str(address)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_mode(
    mode: str,
    args: argparse.Namespace,
    snapshot: Path,
    event: Any,
    cache_root: Path,
    **env: str,
) -> dict[str, Any]:
    argv = [sys.executable, "-m", "snapfn.handler.function.bench", mode]
    argv += ["--function", args.function, "--snapshot", str(snapshot), "--device", args.device]
    argv += ["--event", json.dumps(event), "--cache-root", str(cache_root)]
    argv += ["--t0", repr(time.time())]
    if args.function_dir is not None:
        argv += ["--function-dir", str(args.function_dir)]
    return run_mode_process(mode, argv, args.timeout_s, {**os.environ, **env})


def run_mode_process(
    mode: str, argv: list[str], timeout_s: float, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run one mode's child and read its result line, else its one-line failure."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "error": f"no result within --timeout-s {timeout_s:g} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            try:
                return {**json.loads(line.removeprefix(RESULT_PREFIX)), "mode": mode}
            except ValueError:
                return {"mode": mode, "error": f"its result line is not JSON: {line[:80]!r}"}
    return {"mode": mode, "error": mode_failure(proc.returncode, proc.stdout, proc.stderr)}


def mode_failure(code: int, stdout: str, stderr: str) -> str:
    """One line: why a mode's child gave no result (its error line, its exception, or its last
    line of output) and how it exited."""
    reason = None
    for line in reversed(stdout.splitlines()):
        if line.startswith(ERROR_PREFIX):
            try:
                reason = str(json.loads(line.removeprefix(ERROR_PREFIX))["error"])
            except (ValueError, KeyError, TypeError):
                reason = line.removeprefix(ERROR_PREFIX)
            break
    lines = [line.strip() for line in f"{stdout}\n{stderr}".splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith((RESULT_PREFIX, ERROR_PREFIX))]
    if reason is None:
        exceptions = [line for line in lines if EXCEPTION_LINE.match(line)]
        reason = (exceptions or lines or ["no output"])[-1]
    if len(reason) > MAX_REASON_CHARS:
        reason = reason[: MAX_REASON_CHARS - 1] + "…"
    return f"{reason} (exit {code})"


def snapshot_figures(manifest: dict[str, Any], device: str) -> dict[str, Any]:
    """What the process image holds and leaves out, and the floor of streaming the rest."""
    process = manifest.get("process") or {}
    worker = process.get("worker", {})
    figures = {
        "tier": manifest["tier"],
        "image_bytes": process.get("image_bytes"),
        "pool_bytes": worker.get("pool_bytes", 0),
        "device_in_use_bytes": worker.get("device_in_use_bytes"),
        "image_device_bytes": worker.get("image_device_bytes"),
    }
    if device.startswith("cuda") and figures["pool_bytes"]:
        from snapfn.snapshot.portable.bandwidth import measure_h2d_gbps

        gbps = measure_h2d_gbps(device)
        figures.update(h2d_gbps=round(gbps, 2))
        figures["pool_floor_s"] = round(figures["pool_bytes"] / gbps / 1e9, 4)
    return figures


def ratios(report: dict[str, Any]) -> dict[str, Any]:
    modes, out = report["modes"], {}
    cold = modes.get("cold", {}).get("first_answer_s")
    floor = report["snapshot"].get("pool_floor_s")
    for mode in ("restore_portable", "restore_process", "restore_process_keeper"):
        got = modes.get(mode, {}).get("first_answer_s")
        if cold and got:
            out[f"{mode}_speedup_vs_cold"] = round(cold / got, 2)
        if floor and got and mode != "restore_portable":
            out[f"{mode}_vs_pool_floor"] = round(got / floor, 2)
    answers = [json.dumps(r["answer"], sort_keys=True) for r in modes.values() if "answer" in r]
    if len(answers) > 1:
        out["answers_equal"] = len(set(answers)) == 1
    return out


def format_report(report: dict[str, Any]) -> str:
    s = report["snapshot"]
    lines = [
        f"snapfn bench: {report['function']} on {report['device']} ({report['machine']})",
        f"init (snapshot written, {s['tier']}): {report['init_s']:.3f} s",
        f"{'mode':<22} {'ready s':>9} {'first answer s':>15}  notes",
    ]
    for mode, r in report["modes"].items():
        note = r.get("error") or r.get("skipped") or _notes(r)
        ready = f"{r['ready_s']:9.3f}" if "ready_s" in r else f"{'-':>9}"
        first = f"{r['first_answer_s']:15.3f}" if "first_answer_s" in r else f"{'-':>15}"
        lines.append(f"{mode:<22} {ready} {first}  {note}")
    if s.get("image_bytes") is not None:
        lines.append(
            f"process image {s['image_bytes'] / 1e9:.3f} GB; device memory kept out of it "
            f"{s['pool_bytes'] / 1e9:.3f} GB"
            + (
                f" (h2d {s['h2d_gbps']} GB/s -> floor {s['pool_floor_s']} s)"
                if "h2d_gbps" in s
                else ""
            )
        )
    for n, c in report.get("concurrent", {}).items():
        firsts = ", ".join(f"{f:.3f}" if f is not None else "-" for f in c["first_answer_s"])
        tiers = sorted(set(map(str, c["tiers"])))
        lines.append(
            f"{n} restores at once: first answers {firsts} s (slowest {c['slowest_s']}); "
            f"tiers {', '.join(tiers)}; answers equal: {c['answers_equal']}"
        )
        lines += [f"  fell back: {reason}" for reason in sorted(set(c.get("fallbacks", [])))]
    lines += [f"{k}: {v}" for k, v in report["ratios"].items()]
    return "\n".join(lines)


def _notes(r: dict[str, Any]) -> str:
    startup = r.get("startup", {})
    stages = {s["name"]: s for s in startup.get("stages", [])}
    parts = [f"tier {startup.get('tier')}"]
    for name in ("criu_restore", "cuda_restore", "worker.device_memory", "init_hooks"):
        if name in stages:
            parts.append(f"{name.removeprefix('worker.')} {stages[name]['seconds']:.3f}")
    memory = stages.get("worker.device_memory", {}).get("figures", {})
    filled = memory.get("restorer") or {}
    if filled.get("gbps"):
        parts.append(f"filled at {filled['gbps']} GB/s by the {memory.get('by')}")
    if "verify_s" in memory:
        parts.append(f"checked {memory['verify_s']:.3f}")
    if "init_hooks" in stages and "compiled_files" in stages["init_hooks"]["figures"]:
        parts.append(f"compiled {stages['init_hooks']['figures']['compiled_files']} files")
    if startup.get("fallbacks"):
        parts.append(f"FELL BACK: {startup['fallbacks'][0]['reason']}")
    return ", ".join(parts)


# ---- one mode, in a fresh process ---------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="snapfn.handler.function.bench")
    p.add_argument("mode", choices=FUNCTION_MODES)
    p.add_argument("--function", required=True)
    p.add_argument("--snapshot", type=Path, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--event", required=True)
    p.add_argument("--t0", type=float, required=True)
    p.add_argument("--function-dir", type=Path, default=None)
    p.add_argument("--cache-root", type=Path, required=True)
    a = p.parse_args(argv)
    try:
        answer, startup, ready_at = _start_and_answer(a, json.loads(a.event))
    except Exception as exc:  # the parent reports this one line for the mode
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
        print(ERROR_PREFIX + json.dumps({"error": reason}), flush=True)
        os._exit(1)
    except SystemExit as exc:
        print(ERROR_PREFIX + json.dumps({"error": str(exc.code)}), flush=True)
        os._exit(1)
    done_at = time.time()
    result = {
        "ready_s": round(ready_at - a.t0, 4),
        "first_answer_s": round(done_at - a.t0, 4),
        "answer": answer,
        "startup": startup.to_json(),
    }
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    # NOTE: no interpreter teardown: a restored worker's channel is closed by exiting
    os._exit(0)


def _start_and_answer(a: argparse.Namespace, event: Any):
    from snapfn.handler.api import Context, call_handler
    from snapfn.handler.function.runtime import WorkerRuntime
    from snapfn.handler.function.target import ServeTarget
    from snapfn.handler.function.user_function import UserFunction, function_cache_dir
    from snapfn.handler.llm.init_config import InitConfig

    if a.mode == "restore_portable":
        from snapfn.snapshot.runtime import restore

        cache_dir = function_cache_dir(a.function, a.cache_root)
        fn, startup = restore(
            lambda: UserFunction(a.function, a.function_dir, a.device, cache_dir),
            a.snapshot,
            rewrite_on_fallback=False,
            log=None,
        )
        ready_at = time.time()
        return (
            call_handler(fn.loaded.handler, event, Context.new(a.function, 900)),
            startup,
            ready_at,
        )
    snapshot = a.snapshot if a.mode == "restore_process" else None
    config = InitConfig.from_env(os.environ, device=a.device, cache_dir=a.cache_root)
    target = ServeTarget(
        kind="function",
        function=a.function,
        function_dir=a.function_dir,
        snapshot_dir=snapshot,
        init_config=config,
    )
    runtime = WorkerRuntime(target)
    runtime.start(background=False)
    if not runtime.startup.ok:
        raise SystemExit(f"{a.mode}: {runtime.readiness.reason}")
    ready_at = time.time()
    return runtime.invoke(event), runtime.startup, ready_at


if __name__ == "__main__":
    sys.exit(main())
