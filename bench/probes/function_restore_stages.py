"""A function's tier-1 restore, repeated in this process: the median of its criu_restore stage
and of the whole restore (CPU or GPU).

python3 bench/probes/function_restore_stages.py SNAPSHOT [--function examples.cuda_graph:handler]
    [--restores 10] [--device cpu]

SNAPSHOT: a process snapshot of the function (`snapfn init --function … --snapshot SNAPSHOT`).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from snapfn.handler.function.runtime import WorkerRuntime
from snapfn.handler.function.target import ServeTarget
from snapfn.handler.llm.init_config import InitConfig


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("snapshot", type=Path)
    p.add_argument("--function", default="examples.cuda_graph:handler")
    p.add_argument("--restores", type=int, default=10)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    config = InitConfig.from_env({}, device=a.device, cache_dir=Path(tempfile.mkdtemp()))
    criu, total, tiers = [], [], []
    for _ in range(a.restores):
        target = ServeTarget(
            kind="function", function=a.function, snapshot_dir=a.snapshot, init_config=config
        )
        rt = WorkerRuntime(target)
        rt.start(background=False)
        tiers.append(rt.startup.tier)
        if rt.startup.tier == "process":
            criu.append(rt.startup.stage("criu_restore").seconds)
            total.append(rt.startup.total_s)
        rt.close()
        time.sleep(0.2)  # the restored worker exits once its channel closes
    print(
        json.dumps(
            {
                "tiers": sorted(set(tiers)),
                "criu_restore_median_s": round(statistics.median(criu), 4) if criu else None,
                "restore_median_s": round(statistics.median(total), 4) if total else None,
                "restores": len(total),
            }
        )
    )


if __name__ == "__main__":
    main()
