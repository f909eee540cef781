"""Time to the first answer of a scale-from-zero cold start through the activator, with its
instances forked from the zygote and as fresh interpreters, side by side (CPU or GPU).

python3 bench/probes/activator_first_answer.py [--function examples.cuda_graph:handler | --llm]
    [--cold-starts 3] [--device cpu] [-- extra snapfn serve flags, e.g. --snapshot DIR]

--llm: the LLM front door instead of a function (a 4-token completion; `-- --snapshot DIR` or
`-- --model DIR` picks the model, else the embedded one).

Each cold start: wait until the idle instance is gone, send one request, time it from the
client (request sent → answer read); the activator's own `snapfn_activator_first_answer_seconds`
(instance spawned → first answer relayed) is read from /metrics at the end. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

COMPLETION = {"prompt": "ROMEO:", "max_tokens": 4, "temperature": 0}


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def post(url: str, body: dict) -> float:
    start = time.perf_counter()
    request = urllib.request.Request(url, json.dumps(body).encode(), method="POST")
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=600) as r:
        r.read()
    return time.perf_counter() - start


def one_setting(args: argparse.Namespace, zygote: str) -> dict:
    env = {**os.environ, "SNAPFN_INSTANCE_ZYGOTE": zygote}
    argv = [sys.executable, "-m", "snapfn.handler.cli", "serve", "--host", "127.0.0.1"]
    target = [] if args.llm else ["--function", args.function]
    argv += ["--port", "0", *target, "--idle-timeout", "1"]
    argv += ["--max-instances", "1", "--device", args.device, *args.extra]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    try:
        url = ""
        for line in proc.stdout:
            if "listening on " in line:
                url = line.split("listening on ")[1].split()[0]
                break
        if zygote == "on":  # the zygote imports beside the activator: let it finish first
            time.sleep(args.zygote_wait_s)
        firsts, tiers = [], []
        path, body = ("/invoke", {}) if not args.llm else ("/v1/completions", COMPLETION)
        for _ in range(args.cold_starts):
            while json.loads(get(f"{url}/health"))["instances"]:
                time.sleep(0.05)
            firsts.append(round(post(f"{url}{path}", body), 4))
            tiers.append(json.loads(get(f"{url}/startup"))["last_cold_start"]["tier"])
        metrics = get(f"{url}/metrics")
        total = re.findall(
            r"snapfn_activator_first_answer_seconds_sum\{launch=\"(\w+)\"\} (\S+)", metrics
        )
        count = re.findall(
            r"snapfn_activator_first_answer_seconds_count\{launch=\"(\w+)\"\} (\S+)", metrics
        )
        return {
            "client_first_answer_s": firsts,
            "tiers": tiers,
            "activator_first_answer_mean_s": {
                k: round(float(s) / float(dict(count)[k]), 4)
                for k, s in total
                if float(dict(count)[k])
            },
            "launches": sorted(k for k, n in count if float(n)),
        }
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--function", default="examples.cuda_graph:handler")
    p.add_argument("--llm", action="store_true", help="the LLM's completions, not a function")
    p.add_argument("--cold-starts", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--zygote-wait-s", type=float, default=15.0)
    p.add_argument("extra", nargs="*")
    args = p.parse_args()
    report = {"target": "llm" if args.llm else args.function, "device": args.device}
    report["flags"] = args.extra
    for zygote in ("on", "off"):
        report[f"zygote_{zygote}"] = one_setting(args, zygote)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
