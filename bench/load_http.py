"""Bounded HTTP load run on loopback: `snapfn serve` + N concurrent streaming completions.

    python bench/load_http.py [--model DIR] [--requests 200] [--concurrency 200] [--max-tokens 16]

Starts `snapfn serve` on 127.0.0.1 (a free port; loopback only, by construction) with the given
model, or a tiny synthetic llama written by `snapfn make-model` when none is given, waits until
it is up, then sends `--requests` streaming `/v1/completions` requests (`ignore_eos`, so each
must yield exactly `--max-tokens` tokens) from `--concurrency` client threads. Bounded in count
and in time (`--time-limit-s`). Prints one JSON object: client-side time to first token
(p50/p99), end-to-end latency, generated tokens/s, and how many requests were lost (no answer,
an error, a missing `[DONE]`, or the wrong token count). Exits 1 if any was lost. The server is
stopped with SIGTERM at the end. The client threads share the machine with the server.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import requests

HOST = "127.0.0.1"  # loopback only


@dataclass(frozen=True)
class LoadConfig:
    requests: int = 200
    concurrency: int = 200
    max_tokens: int = 16
    server_threads: int = 256
    time_limit_s: float = 300.0
    prompt: str = "Once upon a time"


@dataclass
class Outcome:
    ok: bool
    ttft_s: float | None
    e2e_s: float
    tokens: int
    error: str | None = None


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, LoadConfig]:
    d = LoadConfig()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="HF model folder (default: a tiny synthetic llama)")
    p.add_argument("--requests", type=int, default=d.requests)
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--server-threads", type=int, default=d.server_threads)
    p.add_argument("--time-limit-s", type=float, default=d.time_limit_s)
    args = p.parse_args(argv)
    config = LoadConfig(
        requests=args.requests,
        concurrency=min(args.concurrency, args.requests),
        max_tokens=args.max_tokens,
        server_threads=args.server_threads,
        time_limit_s=args.time_limit_s,
    )
    return args, config


def make_tiny_model(folder: Path) -> Path:
    out = folder / "tiny"
    cmd = [sys.executable, "-m", "snapfn.handler.cli", "make-model", "--out", str(out)]
    subprocess.run([*cmd, "--preset", "tiny", "--dtype", "fp32"], check=True, capture_output=True)
    return out


def start_server(model: Path, config: LoadConfig, workdir: Path) -> tuple[subprocess.Popen, str]:
    """`snapfn serve` on a free loopback port; returns the process and its URL once printed."""
    cmd = [sys.executable, "-m", "snapfn.handler.cli", "serve", "--model", str(model)]
    cmd += ["--host", HOST]
    cmd += ["--port", "0", "--threads", str(config.server_threads), "--model-name", "bench"]
    cmd += ["--max-running-requests", str(max(64, config.concurrency))]
    # NOTE: one intra-op thread: the client threads share these cores, and OpenMP threads
    # spinning on an oversubscribed machine stall every engine step.
    env = {**os.environ, "XDG_CACHE_HOME": str(workdir / "cache"), "OMP_NUM_THREADS": "1"}
    log = (workdir / "server.log").open("w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        if "listening on " in line:
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # drain the pipe
            return proc, line.split("listening on ")[1].split()[0]
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise SystemExit(f"server did not start; see {workdir / 'server.log'}")


def wait_up(url: str, timeout_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if requests.get(f"{url}/health", timeout=10).status_code == 200:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise SystemExit(f"server not up after {timeout_s} s")


def one_request(url: str, config: LoadConfig, deadline: float) -> Outcome:
    body = {
        "model": "bench",
        "prompt": config.prompt,
        "max_tokens": config.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    t0, ttft, tokens, done = time.perf_counter(), None, 0, False
    timeout = max(1.0, deadline - time.monotonic())
    try:
        with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=timeout) as r:
            if r.status_code != 200:
                return Outcome(False, None, time.perf_counter() - t0, 0, f"HTTP {r.status_code}")
            for line in r.iter_lines(chunk_size=None):  # each chunk as it arrives
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                tokens += len(chunk["choices"][0]["token_ids"])
                ttft = ttft if ttft is not None else time.perf_counter() - t0
    except requests.RequestException as exc:
        return Outcome(False, ttft, time.perf_counter() - t0, tokens, type(exc).__name__)
    ok = done and tokens == config.max_tokens
    error = None if ok else f"done={done} tokens={tokens}"
    return Outcome(ok, ttft, time.perf_counter() - t0, tokens, error)


def run_load(url: str, config: LoadConfig) -> tuple[list[Outcome], float]:
    deadline = time.monotonic() + config.time_limit_s
    t0 = time.perf_counter()
    with ThreadPoolExecutor(config.concurrency) as pool:
        futures = [pool.submit(one_request, url, config, deadline) for _ in range(config.requests)]
        outcomes = [f.result() for f in futures]
    return outcomes, time.perf_counter() - t0


def server_figures(url: str) -> dict[str, float]:
    """Means of the server's own latency histograms (arrival to first token, to the end)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{url}/metrics", timeout=30).text
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("endpoint") == "/v1/completions" and s.name.endswith(
                ("_sum", "_count")
            ):
                sums[s.name] = sums.get(s.name, 0.0) + s.value
            if s.name == "snapfn_engine_steps_total":
                sums["engine_steps"] = s.value
    figures = {"engine_steps": sums.get("engine_steps", 0.0)}
    for name in ("time_to_first_token", "request_queue", "e2e_request_latency"):
        count = sums.get(f"snapfn_{name}_seconds_count", 0.0)
        mean = sums.get(f"snapfn_{name}_seconds_sum", 0.0) / count if count else None
        figures[f"{name}_mean_ms"] = None if mean is None else round(mean * 1000, 1)
    return figures


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def report(outcomes: list[Outcome], wall_s: float, config: LoadConfig, up_s: float) -> dict:
    ttft = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    e2e = [o.e2e_s for o in outcomes if o.ok]
    tokens = sum(o.tokens for o in outcomes)
    lost = [o for o in outcomes if not o.ok]

    def ms(values: list[float], q: float) -> float | None:
        p = percentile(values, q)
        return None if p is None else round(p * 1000, 1)

    return {
        "requests": config.requests,
        "concurrency": config.concurrency,
        "max_tokens": config.max_tokens,
        "answered": len(outcomes) - len(lost),
        "lost": len(lost),
        "lost_examples": sorted({o.error for o in lost})[:5],
        "ttft_ms": {"p50": ms(ttft, 50), "p99": ms(ttft, 99), "max": ms(ttft, 100)},
        "e2e_ms": {"p50": ms(e2e, 50), "p99": ms(e2e, 99)},
        "generated_tokens": tokens,
        "wall_s": round(wall_s, 3),
        "tokens_per_s": round(tokens / wall_s, 1),
        "requests_per_s": round(len(outcomes) / wall_s, 1),
        "server_up_s": round(up_s, 3),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
    }


def main(argv: list[str] | None = None) -> int:
    args, config = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="snapfn-load-") as tmp:
        workdir = Path(tmp)
        model = args.model or make_tiny_model(workdir)
        proc, url = start_server(model, config, workdir)
        try:
            up_s = wait_up(url, timeout_s=120)
            outcomes, wall_s = run_load(url, config)
            server = server_figures(url)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    result = report(outcomes, wall_s, config, up_s)
    result["server"] = server
    result["model"] = str(args.model) if args.model else "make-model --preset tiny --dtype fp32"
    print(json.dumps(result, indent=2))
    return 1 if result["lost"] else 0


if __name__ == "__main__":
    sys.exit(main())
