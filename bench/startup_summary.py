"""One line per mode of cold-start bench results: ready / first token, the first token and its
logprob, the next two-token generation's seconds (restores), the decode figure, what each startup stage compiled, restored or skipped (a restore
must show `compiled_files` 0), and each stage's seconds.
Usage: python3 bench/startup_summary.py RESULT.json [RESULT.json ...]"""

import json
import sys
from pathlib import Path

KEEP = (
    "compiled_files",
    "restored_cache_files",
    "cache_files",
    "backend",
    "buckets",
    "skipped",
    "captured",
    "compiler_warm",
    "images_held_by_keeper",
)

for path in sys.argv[1:]:
    for mode, m in json.loads(Path(path).read_text())["modes"].items():
        stages = (m.get("startup") or {}).get("stages", [])
        found = {s["name"]: {k: v for k, v in s["figures"].items() if k in KEEP} for s in stages}
        seconds = {s["name"]: round(s.get("seconds", 0.0), 3) for s in stages}
        first = {k: m.get(k) for k in ("token", "logprob") if k in m}
        print(
            mode,
            m.get("ready_s"),
            m.get("first_token_s"),
            first,
            m.get("next_two_tokens_s"),
            m.get("decode"),
            {k: v for k, v in found.items() if v},
            seconds,
        )
