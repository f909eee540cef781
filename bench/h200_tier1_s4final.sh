#!/usr/bin/env bash
# Device run on one H200 (session 4, run 3), 8B llama bf16: the tier-1 GPU tests; cold init,
# tier 0 and tier 1 side by side (memory file, tokenizer loaded once criu is done) and two more
# tier-1 restores; then, with the disk freed of those snapshots, a worker in its own pid + mount
# namespace (SNAPFN_PROCESS_PID_NAMESPACE=mount, 40% of the GPU for weights + KV): init, a
# restore, then two restores at once and their tokens.
# Usage (device tool; criu carried as .criu: cp -a /opt/snapfn-criu .criu): bash bench/h200_tier1_s4final.sh
set -uo pipefail
. bench/device-env.sh
t0=$SECONDS
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_process_gpu.py > "$out/h200-gpu-tests-s4final.log" 2>&1
grep -E "^E |passed|failed" "$out/h200-gpu-tests-s4final.log" | tail -8
snapfn make-model --preset 8b --dtype bf16 --device cuda --out "$work/llama8b" | tail -1
echo "[$((SECONDS - t0)) s] model made"
bench() { snapfn bench --model "$work/llama8b" --device cuda "$@"; }
name=h200-llama8b-tier1-s4final
bench --workdir "$work/bench" --modes cold_init,restore,init_process,restore_process \
  --decode-batches 1,32 --out "$out/$name.json" --plot "$out/$name.png" 2>&1 | grep -A12 "^mode"
for i in 2 3; do
  bench --workdir "$work/bench" --modes restore_process --decode-batches 1 --out "$out/$name-$i.json" 2>&1 | grep -A1 "^mode"
done
echo "[$((SECONDS - t0)) s] tier 1 done"
rm -rf "$work/bench"  # 64 GB of disk: the model and one process snapshot at a time
# a KV pool small enough for two copies on the one GPU
export SNAPFN_PROCESS_PID_NAMESPACE=mount SNAPFN_MEM_FRACTION_STATIC=0.4
bench --workdir "$work/mount" --modes init_process,restore_process --decode-batches 1 \
  --out "$out/$name-mount.json" 2>&1 | grep -E -A2 "^mode|rror" | head -12
python3 - "$work/mount/snapshot_process" <<'PY' 2>&1 | tail -12
import json, sys, threading, time
from pathlib import Path
from snapfn.handler.llm.init_config import InitConfig
from snapfn.handler.llm.recipes.process_restore import restore_process
from snapfn.handler.llm.engine.request import SamplingParams
snap = Path(sys.argv[1])
doc = json.loads((snap / "manifest.json").read_text())
print("tier", doc.get("tier"), "mount_namespace", (doc.get("process") or {}).get("mount_namespace"),
      "fallbacks", doc.get("startup", {}).get("fallbacks"))
results = {}
def one(i):
    t = time.perf_counter()
    try:
        service, startup = restore_process(snap, InitConfig(device="cuda"), log=None)
        out = service.generate([128000, 9906, 1917], SamplingParams(max_new_tokens=4, ignore_eos=True))
        results[i] = (round(time.perf_counter() - t, 3), out.token_ids, startup.stage("criu_restore").figures)
        service.close()
    except Exception as exc:
        results[i] = ("failed", repr(exc)[:300])
threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
for t in threads: t.start()
for t in threads: t.join()
for i, r in sorted(results.items()): print("copy", i, r)
PY
echo "[$((SECONDS - t0)) s] mount done"
