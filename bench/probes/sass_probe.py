"""What the GEMV kernels compile to on sm_90, without a GPU (offline probe): registers a thread,
shared memory, and the instructions of the K loop, per config.

python3 bench/probes/sass_probe.py [--kernel gemv|moe_gate_up|moe_down] [--fp8 | --bf16]
    [--flags norm,residual,swiglu] [--configs engine|all] [--arch 90]

triton compiles each config to a cubin (`triton.compile` for a `GPUTarget`; ptxas ships in the
triton wheel), and the wheel's `cuobjdump` / `nvdisasm` read it back. No device is touched, so
this runs on the CPU machine. Prints one JSON object per config: its registers a thread (what
decides how many programs an SM keeps resident, each with its loads in flight), its shared
memory, the K loop's instruction count per weight element a thread handles, and the loop's
barriers, global loads and shuffles. The loop is the SASS's longest: for nested loops (the MoE
down GEMV walks K inside a loop over the slots) that is the outer one, whose instructions are
counted once, inner body and per-slot epilogue together, so its per-element figure is not
comparable with a single loop's. It showed the FP8 GEMVs' `[BLOCK_N, BLOCK_K]` accumulators
taking 128-155 registers a thread, which `triton_kernels.lane_sums` (commit 07522b8) halved.

Pointer arguments and the shape integers are declared 16-divisible, as triton's launcher
specialises them for the engine's shapes. Without that, triton cannot vectorise the weight
loads and emits byte loads. Registers and instruction counts are from the local triton
version, which may differ from the device's (the H200 image had 3.6.0, this probe ran with
3.7.1).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.tools.disasm import get_sass

from snapfn.handler.llm.kernels.triton import gemv as triton_gemv
from snapfn.handler.llm.kernels.triton import moe as triton_moe

# each kernel's pointer and integer arguments (triton signature types, 16-bit rows)
SIGNATURES = {
    "gemv": {
        "x_ptr": "*bf16",
        "residual_ptr": "*bf16",
        "sum_ptr": "*bf16",
        "norm_ptr": "*bf16",
        "w_ptr": "*fp8e4nv",
        "scale_ptr": "*fp32",
        "bias_ptr": "*bf16",
        "out_ptr": "*bf16",
        "partial_ptr": "*fp32",
        "count_ptr": "*i32",
        "n": "i32",
        "k": "i32",
        "num_k_blocks": "i32",
        "eps": "fp32",
    },
    "moe_gate_up": {
        "x_ptr": "*bf16",
        "gate_ptr": "*fp8e4nv",
        "up_ptr": "*fp8e4nv",
        "gate_scale_ptr": "*fp32",
        "up_scale_ptr": "*fp32",
        "topk_ids_ptr": "*i32",
        "act_ptr": "*bf16",
        "first_expert": "i32",
        "num_local": "i32",
        "hidden": "i32",
        "inter": "i32",
    },
    "moe_down": {
        "act_ptr": "*bf16",
        "down_ptr": "*fp8e4nv",
        "down_scale_ptr": "*fp32",
        "topk_ids_ptr": "*i32",
        "weights_ptr": "*fp32",
        "out_ptr": "*bf16",
        "first_expert": "i32",
        "num_local": "i32",
        "hidden": "i32",
        "inter": "i32",
    },
}
WEIGHT_ARGS = {"gemv": ("w_ptr",), "moe_gate_up": ("gate_ptr", "up_ptr"), "moe_down": ("down_ptr",)}
DIVISIBLE_INTS = {"n", "k", "num_k_blocks", "hidden", "inter"}


def kernel_and_configs(name: str, fp8: bool, which: str):
    if name == "gemv":
        engine = triton_gemv.GEMV_FP8_CONFIGS if fp8 else triton_gemv.GEMV_CONFIGS
        configs = triton_gemv.GEMV_ALL_CONFIGS if which == "all" else engine
        return triton_gemv._gemv_kernel, configs
    kernel = (
        triton_moe._gate_up_gemv_kernel if name == "moe_gate_up" else triton_moe._down_gemv_kernel
    )
    return kernel, triton_moe.MOE_GEMV_CONFIGS


def constants(name: str, fp8: bool, flags: set[str], config: triton.Config) -> dict:
    tile = {"BLOCK_N": config.kwargs["BLOCK_N"], "BLOCK_K": config.kwargs["BLOCK_K"]}
    if name == "gemv":
        return {
            "SPLIT": "split" in flags,
            "NORM": bool({"norm", "residual", "swiglu"} & flags),
            "SCALED": fp8,
            "SCALE_BLOCK": 128,
            "RESIDUAL": "residual" in flags,
            "SWIGLU": "swiglu" in flags,
            "HAS_BIAS": False,
            "ROUND_TO_X": False,
            **tile,
        }
    if name == "moe_gate_up":
        return {"FP8": fp8, **tile}
    return {"TOPK": 8, "ROUND_PRODUCT": False, "FP8": fp8, **tile}


def compile_config(name: str, fp8: bool, flags: set[str], config: triton.Config, arch: int):
    kernel, _ = kernel_and_configs(name, fp8, "engine")  # the JITFunctions, not the tuners
    signature = dict(SIGNATURES[name])
    if not fp8:
        for arg in WEIGHT_ARGS[name]:
            signature[arg] = "*bf16"
    consts = constants(name, fp8, flags, config)
    signature.update({c: "constexpr" for c in consts})
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, arg in enumerate(kernel.arg_names)
        if signature.get(arg, "constexpr") != "constexpr"
        and (signature[arg].startswith("*") or arg in DIVISIBLE_INTS)
    }
    source = ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs)
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def registers(cubin: bytes) -> int | None:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [tool, "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
    match = re.search(r"REG:(\d+)", out)
    return int(match.group(1)) if match else None


def loop_ops(sass: str) -> list[str]:
    """The opcodes of the longest loop: between a label and the last branch back to it (for
    nested loops, the outer one, inner body included once)."""
    lines = sass.splitlines()
    labels = {line[:-1]: i for i, line in enumerate(lines) if re.fullmatch(r"\.?L?\w+:", line)}
    best: tuple[int, int] = (0, -1)
    for i, line in enumerate(lines):
        match = re.search(r"BRA `?\(?(\.?\w+)\)?;", line)
        if match and labels.get(match.group(1), i) < i:
            start = labels[match.group(1)]
            if i - start > best[1] - best[0]:
                best = (start, i)
    ops = []
    for line in lines[best[0] : best[1] + 1]:
        parts = line.split("\t")
        words = parts[1].split() if len(parts) > 1 else []
        if words:
            ops.append((words[1] if words[0].startswith("@") else words[0]).rstrip(";"))
    return ops


def describe(name: str, fp8: bool, flags: set[str], config: triton.Config, arch: int) -> dict:
    kw = config.kwargs
    label = f"{kw['BLOCK_N']}x{kw['BLOCK_K']}w{config.num_warps}"
    row = {"kernel": name, "weights": "fp8" if fp8 else "bf16", "flags": sorted(flags)}
    row["config"] = label
    try:
        compiled = compile_config(name, fp8, flags, config, arch)
    except Exception as exc:  # a config that does not compile: say why
        return {**row, "error": repr(exc)[:300]}
    ops = loop_ops(get_sass(compiled.asm["cubin"]))
    counts = Counter(ops)
    per_thread = kw["BLOCK_N"] * kw["BLOCK_K"] / (config.num_warps * 32)
    if name == "moe_gate_up" or "swiglu" in flags:
        per_thread *= 2  # gate and up tiles
    return {
        **row,
        "registers": registers(compiled.asm["cubin"]),
        "shared_bytes": compiled.metadata.shared,
        "loop_instructions": len(ops),
        "per_weight_element": round(len(ops) / per_thread, 2),
        "barriers": counts.get("BAR.SYNC.DEFER_BLOCKING", 0),
        "global_loads": sum(v for op, v in counts.items() if op.startswith("LDG")),
        "shuffles": sum(v for op, v in counts.items() if op.startswith("SHFL")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kernel", default="gemv", choices=sorted(SIGNATURES))
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--fp8", action="store_true", default=True)
    weights.add_argument("--bf16", action="store_true")
    parser.add_argument("--flags", default="", help="gemv: comma-separated norm,residual,swiglu")
    parser.add_argument("--configs", default="engine", choices=("engine", "all"))
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args()
    fp8 = not args.bf16
    flags = {f for f in args.flags.split(",") if f}
    _, configs = kernel_and_configs(args.kernel, fp8, args.configs)
    for config in configs:
        print(json.dumps(describe(args.kernel, fp8, flags, config, args.arch)), flush=True)


if __name__ == "__main__":
    main()
