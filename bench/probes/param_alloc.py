"""What a restore's `build_model` costs, and what placing the parameters would cost instead.

python3 bench/probes/param_alloc.py [--preset 8b] [--layers N] [--device cuda] [--top 15]

In one process (torch imported and the device's context made before any clock, as a zygote's
restore has them), for a preset's shapes (no weights written or read):
  build      `build_model` as a restore runs it, under cProfile (its top functions by own time)
  per_param  `torch.empty` of every parameter again, each its own allocation
  one_block  one `torch.empty` as large as the restore layout (2 MiB-aligned parameters)
  region     one releasable region as large (CUDA VMM reserve + create + map; tier 1's kind)
  meta       `build_model` on the meta device (the Python modules alone, no memory)
Each allocation is given back (and torch's cache emptied) before the next. Prints one JSON
object of seconds.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="8b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args()

    import torch

    from snapfn.handler.llm.build import EngineOptions, build_model
    from snapfn.handler.llm.config import ModelConfig
    from snapfn.handler.llm.make_model.hf_config import config_json
    from snapfn.handler.llm.make_model.hf_layout import resolve_num_layers
    from snapfn.handler.llm.make_model.presets import get_preset
    from snapfn.snapshot.cuda.regions import allocate_region, arena_bytes

    preset = get_preset(a.preset)
    layers = resolve_num_layers(preset, a.layers)
    doc = config_json(
        preset, layers, "bf16", bos_token_id=0, eos_token_id=1, modules_to_not_convert=[]
    )
    config = ModelConfig.from_hf(doc)
    device = torch.device(a.device)
    torch.empty(1, device=device)  # the context, before any clock
    out: dict = {"preset": a.preset, "layers": layers, "device": str(device)}

    def settle() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    model = build_model(config, EngineOptions(device=a.device))
    prof.disable()
    out["build_s"] = round(time.perf_counter() - t0, 4)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(a.top)
    out["build_top"] = [line for line in buf.getvalue().splitlines() if line.strip()][-a.top :]
    shapes = [(tuple(q.shape), q.dtype) for q in model.parameters()]
    sizes = [q.numel() * q.element_size() for q in model.parameters()]
    out.update(parameters=len(shapes), parameter_bytes=sum(sizes))
    del model
    settle()

    t0 = time.perf_counter()
    held = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in shapes]
    out["per_param_s"] = round(time.perf_counter() - t0, 4)
    del held
    settle()

    total = arena_bytes(sizes)
    t0 = time.perf_counter()
    block = torch.empty(total, dtype=torch.uint8, device=device)
    out["one_block_s"] = round(time.perf_counter() - t0, 4)
    del block
    settle()

    t0 = time.perf_counter()
    region = allocate_region(total, device)
    out["region_s"] = round(time.perf_counter() - t0, 4)
    region.release()
    settle()

    t0 = time.perf_counter()
    try:
        build_model(config, EngineOptions(device="meta"))
        out["meta_s"] = round(time.perf_counter() - t0, 4)
    except Exception as exc:  # noqa: BLE001  (a probe: the failure is the finding)
        out["meta_error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
