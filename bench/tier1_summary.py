"""One line per tier-1 bench result: ready / first token, each stage's start and seconds, and
what the restorer (helper or keeper) reported. Usage: python3 bench/tier1_summary.py RESULT.json"""

import json
import sys
from pathlib import Path

mode = json.loads(Path(sys.argv[1]).read_text())["modes"]["restore_process"]
if "startup" not in mode:  # the restore failed or was skipped: say why
    print(sys.argv[1].rsplit("/", 1)[-1], mode.get("error") or mode.get("skipped"))
    sys.exit(1)
stages = {s["name"]: s for s in mode["startup"]["stages"]}
timeline = {n: (round(s["start_s"], 3), round(s["seconds"], 3)) for n, s in stages.items()}
restorer = stages.get("worker.adopt", {}).get("figures", {}).get("restorer", {})
keys = ("context_s", "made_s", "filled_s", "pinned_bytes", "pinned_miss", "gbps")
print(
    sys.argv[1].rsplit("/", 1)[-1],
    "ready",
    mode.get("ready_s"),
    "first",
    mode.get("first_token_s"),
    "again",
    mode.get("second_request_s"),
    "started",
    mode.get("restore_started_s"),
)
print("  stages", timeline)
print(
    "  by", {n: stages[n]["figures"].get("by") for n in ("prefetch", "cuda_restore") if n in stages}
)
print("  restorer", {k: restorer.get(k) for k in keys})
