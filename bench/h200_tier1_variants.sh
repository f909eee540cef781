#!/usr/bin/env bash
# Device run on one H200 (session 4, run 2), 8B llama bf16, tier 1 with the memory file:
# the tier-1 GPU tests; a snapshot with every page in criu's image (SNAPFN_PROCESS_MEMORY=image)
# against one with the memory file, restored side by side; on the second, the prefetch helper's
# reader threads (8, 16) and its read path (pread into pinned slots, or pinning the page cache:
# SNAPFN_PROCESS_PREFETCH_READ=register); last, a worker in its own pid + mount namespace.
# Each init prints its checkpoint's fallback reason, if any.
# Usage (device tool; criu carried as .criu: cp -a /opt/snapfn-criu .criu): bash bench/h200_tier1_variants.sh
set -uo pipefail
. bench/device-env.sh
t0=$SECONDS
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_process_gpu.py > "$out/h200-gpu-tests-run2.log" 2>&1
grep -E "^E |passed|failed" "$out/h200-gpu-tests-run2.log" | tail -8
snapfn make-model --preset 8b --dtype bf16 --device cuda --out "$work/llama8b" | tail -1
echo "[$((SECONDS - t0)) s] model made"
bench() { snapfn bench --model "$work/llama8b" --device cuda --decode-batches 1 "$@" 2>&1 | grep -E -A1 "^mode|rror"; }
manifest() {
  python3 - "$1/snapshot_process/manifest.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
meta = doc.get("process") or {}
print("tier", doc.get("tier"), "image_bytes", meta.get("image_bytes"), "memory", meta.get("memory"),
      "seconds", meta.get("seconds"), "fallbacks", doc.get("startup", {}).get("fallbacks"))
PY
}
name=h200-llama8b-tier1-s4r2
( export SNAPFN_PROCESS_MEMORY=image
  bench --workdir "$work/image" --modes init_process,restore_process --out "$out/$name-image.json" )
manifest "$work/image"
echo "[$((SECONDS - t0)) s] memory=image done"
bench --workdir "$work/file" --modes init_process,restore_process --out "$out/$name-file.json"
manifest "$work/file"
bench --workdir "$work/image" --modes restore_process --out "$out/$name-image-2.json"
bench --workdir "$work/file" --modes restore_process --out "$out/$name-file-2.json"
for variant in THREADS=16 READ=register; do
  ( export "SNAPFN_PROCESS_PREFETCH_$variant"
    bench --workdir "$work/file" --modes restore_process --out "$out/$name-file-${variant/=/-}.json" )
done
echo "[$((SECONDS - t0)) s] variants done"
( export SNAPFN_PROCESS_PID_NAMESPACE=mount
  bench --workdir "$work/mount" --modes init_process,restore_process --out "$out/$name-mount.json" )
manifest "$work/mount"
echo "[$((SECONDS - t0)) s] mount done"
