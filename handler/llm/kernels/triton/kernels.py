"""Triton kernels of our own, each matching a torch reference op of the engine.

| kernel | reference (the oracle) |
| --- | --- |
| `rms_norm` | `models.layers.RMSNorm.forward`: float32 statistics, cast back, then times weight |
| `add_rms_norm` | `h = x + residual` (in the input dtype), then `rms_norm(h)`; returns both |
| `dequantize_fp8_block` | `quant.dequantize_fp8_block`: `q.float() * scale_inv[n//128, k//128]` in `dtype` |
| `fp8_block_linear` | `F.linear(x, dequantize_fp8_block(w, s, x.dtype))`: the weight dequantized in registers, tile by tile, never written out |
| `rope_store_kv` | `torch_ref.apply_rotary` of q and k, then `store_kv` of k and v: one launch |
| `silu_mul` | `F.silu(gate) * up` of a fused `gate | up` projection |

NOTE: this module imports triton at import time; only `triton.backend` imports it, lazily,
because `import triton` takes seconds and the package must stay importable without it.
`TRITON_INTERPRET=1` must be set before this module is first imported for the kernels to run
on CPU tensors (triton decides interpreted or compiled when `@triton.jit` runs).

Every kernel here has several configs on GPUs (`fp8_block_linear`'s output-tile width and
pipeline depth per weight shape; through `autotuned`, the others' warps, and block sizes where
they have a free one). Which one a key runs is decided once, without timing anything by
default (`tuning.py`: the init's choice on a restore, the shipped table for this GPU, else the
kernel's default config; SNAPFN_KERNEL_TUNING=init times the configs at init instead, with
triton's results cache on, in `TRITON_CACHE_DIR`, which the snapshot saves). Under the
interpreter, which cannot time configs, each runs one fixed config (`tuned_or_fixed`; see
docs/kernels.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from snapfn.handler.llm.kernels.triton import tuning
from snapfn.handler.llm.weights.quant import FP8_BLOCK, FP8_DTYPE, scale_shape


class TunedKernel(triton.runtime.Autotuner):
    """triton's autotuner, deciding through `tuning.choose` which config the first call of
    each key runs: pinned (a restore: the init's), shipped for this GPU, else timed (tuning
    mode "init", triton's own autotuning, results cached on disk) or the default config (the
    first of those the pruning keeps). Every choice is recorded (`tuning.record`)."""

    def run(self, *args, **kwargs):
        if len(self.configs) < 2:
            return super().run(*args, **kwargs)
        self.nargs = dict(zip(self.arg_names, args, strict=False))  # as triton: the positionals
        key = self._tuning_key(kwargs)
        if key not in self.cache:
            candidates = {_config_id(c): c for c in self.prune_configs(kwargs)}
            name, text = self.base_fn.__name__, repr(key)
            chosen, source = tuning.choose(name, text, list(candidates), _gpu_name(args))
            if chosen is None:  # timed by triton, which then launches the winner itself
                out = super().run(*args, **kwargs)
                self.cache[key] = self.best_config  # NOTE: whatever key triton filed it under
                tuning.record(name, text, _config_id(self.best_config), source)
                return out
            self.cache[key] = candidates[chosen]
            tuning.record(name, text, chosen, source)
        config = self.best_config = self.cache[key]
        self.nargs = None
        return self.fn.run(*args, **kwargs, **config.all_kwargs())

    def _tuning_key(self, kwargs: dict) -> tuple:
        """triton's own tuning key: the `key` arguments' values, then every tensor's dtype."""
        named = {k: v for k, v in {**self.nargs, **kwargs}.items() if k in self.arg_names}
        key = [named[k] for k in self.keys if k in named]
        key += [str(v.dtype) for v in named.values() if hasattr(v, "dtype")]
        return tuple(key)


def _config_id(config: triton.Config) -> str:
    return tuning.config_id(config.kwargs, config.num_warps, config.num_stages)


def _gpu_name(args: tuple) -> str:
    """The GPU the call's tensors are on (its shipped table's name), or "cpu" (interpreted)."""
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    return torch.cuda.get_device_name(device) if device and device.type == "cuda" else "cpu"


def autotuned(
    kernel, configs: list[triton.Config], key: list[str], prune=None, default: int = 0
) -> TunedKernel:
    """`kernel` over `configs`, one chosen per value of `key` (and of its tensors' dtypes) by
    `TunedKernel`; `configs[default]` is the untuned choice (where the pruning keeps it; else
    the first config it keeps).

    NOTE: `key` names only values fixed by the model's and the graph bucket's shapes, never a
    token count: tuning launches a kernel many times and syncs, so it must happen in warmup and
    never inside a CUDA graph capture (the engine runs each bucket eagerly before capturing it).
    A kernel that updated an input in place would need `restore_value` for the timing runs;
    ours write fresh outputs, or (KV cache slots, each MoE pair's row) the same values each run.
    `prune(configs, named_args, **kwargs)`: the configs worth timing for a call (triton's
    `early_config_prune`), e.g. by a constexpr flag."""
    configs = [configs[default], *(c for i, c in enumerate(configs) if i != default)]
    prune_by = {"early_config_prune": prune} if prune is not None else None
    return TunedKernel(
        kernel,
        kernel.arg_names,
        configs,
        key,
        reset_to_zero=None,
        restore_value=None,
        prune_configs_by=prune_by,
        cache_results=True,
    )


def tuned_or_fixed(
    tuned: triton.runtime.Autotuner, config: triton.Config | None = None, **fixed
) -> tuple[object, dict]:
    """(kernel, launch parameters): `tuned`, which picks its own, on GPUs; under the
    interpreter, which cannot time configs, the untuned kernel with `fixed`; the untuned kernel
    with `config` where one is forced (probes, and the checks that run every config)."""
    if config is not None:
        return tuned.fn, config.all_kwargs()
    if triton.knobs.runtime.interpret:
        return tuned.fn, fixed
    return tuned, {}


def warps_configs(*warps: int) -> list[triton.Config]:
    """Configs differing only in warps per program, for kernels whose tile the shapes fix (a
    row, a head, a scale block)."""
    return [triton.Config({}, num_warps=w) for w in warps]


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    sum_ptr,
    weight_ptr,
    out_ptr,
    num_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # one program per row of `[M, num_cols]` contiguous tensors
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    offsets = row * num_cols + cols
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + offsets, mask=mask, other=0.0)
        # rounded to the input dtype, as `x + residual` is in torch
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + offsets, x, mask=mask)
    xf = x.to(tl.float32)
    mean_square = tl.sum(xf * xf, axis=0) / num_cols
    normed = (xf * tl.rsqrt(mean_square + eps)).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    # the product of two values of <= 16-bit dtypes is exact in float32: one rounding, as torch
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


_rms_norm_tuned = autotuned(
    _rms_norm_kernel, warps_configs(1, 2, 4, 8, 16), key=["num_cols", "HAS_RESIDUAL"], default=2
)


def _launch_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    _check_device(x, weight, residual)
    num_cols = x.shape[-1]
    if weight.shape != (num_cols,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match x [..., {num_cols}]")
    rows = x.reshape(-1, num_cols).contiguous()  # [M, H]
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    total = None
    if residual is not None:
        residual = residual.reshape(-1, num_cols).contiguous()
        total = torch.empty_like(rows)
    kernel, fixed = tuned_or_fixed(_rms_norm_tuned)
    kernel[(rows.shape[0],)](
        rows,
        residual if residual is not None else rows,  # unread without a residual
        total if total is not None else rows,  # unwritten without a residual
        weight.contiguous(),
        out,
        num_cols,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=triton.next_power_of_2(num_cols),
        **fixed,
    )
    return out.view(x.shape), None if total is None else total.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of `x [..., H]` with `weight [H]`, as `layers.RMSNorm`."""
    out, _ = _launch_rms_norm(x, None, weight, eps)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`h = x + residual` then `rms_norm(h)`, in one pass: returns `(rms_norm(h), h)`."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} does not match "
            f"x {tuple(x.shape)} {x.dtype}"
        )
    out, total = _launch_rms_norm(x, residual, weight, eps)
    assert total is not None
    return out, total


@triton.jit
def _dequant_fp8_block_kernel(
    q_ptr,
    scale_ptr,
    out_ptr,
    n,
    k,
    num_n_blocks,
    num_k_blocks,
    BLOCK: tl.constexpr,
):
    # one program per (matrix, n block, k block) of `[B, n, k]` contiguous weights
    matrix = tl.program_id(0).to(tl.int64)
    n_block = tl.program_id(1)
    k_block = tl.program_id(2)
    rows = n_block * BLOCK + tl.arange(0, BLOCK)
    cols = k_block * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < n) & (cols[None, :] < k)  # edge blocks are partial
    offsets = matrix * n * k + rows[:, None].to(tl.int64) * k + cols[None, :]
    q = tl.load(q_ptr + offsets, mask=mask, other=0.0)
    scale = tl.load(scale_ptr + (matrix * num_n_blocks + n_block) * num_k_blocks + k_block)
    out = q.to(tl.float32) * scale.to(tl.float32)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


# one program per 128x128 block whatever the weight's shape: keyed by the block alone
_dequant_fp8_block_tuned = autotuned(
    _dequant_fp8_block_kernel, warps_configs(4, 8, 16), key=["BLOCK"]
)


# NOTE: `m` (the input rows) is not specialised on (triton compiles one variant for m == 1 and
# one for m % 16 == 0 otherwise): the rows are masked anyway, and a variant per row count would
# leave prefill lengths that warmup did not run to compile in a request
@triton.jit(do_not_specialize=["m"])
def _fp8_block_linear_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    out_ptr,
    partial_ptr,
    count_ptr,
    m,
    n,
    k,
    x_stride,
    out_stride,
    num_k_blocks,
    DOT_FP32: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # one program per [BLOCK_M, BLOCK_N] output tile and K split (grid axis 2); K walked one
    # 128-wide scale block at a time. SPLIT (one row tile): each program leaves its [BLOCK_M,
    # BLOCK_N] sums in `partial` [splits, BLOCK_M, n]; the last of a tile's splits to finish
    # (`count`, one per column tile, back to 0 after) adds them up in split order and stores
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    pid_k = tl.program_id(2)
    splits = tl.num_programs(2)
    per_split = tl.cdiv(num_k_blocks, splits)
    row_mask, col_mask = rows < m, cols < n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    scale_rows = scale_ptr + (cols // BLOCK_K).to(tl.int64) * num_k_blocks
    for kb in range(pid_k * per_split, tl.minimum((pid_k + 1) * per_split, num_k_blocks)):
        ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = ks < k
        x = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * x_stride + ks[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + cols[:, None].to(tl.int64) * k + ks[None, :],
            mask=col_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        scale = tl.load(scale_rows + kb, mask=col_mask, other=0.0)
        # dequantized as the reference does (float32 product, rounded to x's dtype), then
        # multiplied with float32 accumulation
        w = (w.to(tl.float32) * scale[:, None]).to(x_ptr.dtype.element_ty)
        acc = dot_acc(acc, x, tl.trans(w), DOT_FP32)
    out_mask = row_mask[:, None] & col_mask[None, :]
    if SPLIT:
        # NOTE: ordered as `triton.gemv`'s split: the barrier puts every thread's partial stores
        # before the count, whose acq_rel orders them before the last program's `.cg` loads
        tile = tl.arange(0, BLOCK_M)[:, None] * n + cols[None, :]
        tl.store(partial_ptr + pid_k * BLOCK_M * n + tile, acc, mask=out_mask)
        tl.debug_barrier()
        last = tl.atomic_add(count_ptr + tl.program_id(1), 1, sem="acq_rel") == splits - 1
        out_mask = out_mask & last
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in range(0, splits):
            part = partial_ptr + s * BLOCK_M * n + tile
            acc += tl.load(part, mask=out_mask, other=0.0, cache_modifier=".cg")
        tl.store(count_ptr + tl.program_id(1), 0, mask=last)  # ready for the next launch
    out = out_ptr + rows[:, None].to(tl.int64) * out_stride + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


# NOTE: output-tile widths and pipeline depths; each is benchmarked once per (N, K, BLOCK_M,
# SPLIT, dtype) the first time that shape runs, outside any CUDA graph capture (DecodeGraphs
# runs each bucket once before capturing it)
FP8_LINEAR_CONFIGS = [
    triton.Config({"BLOCK_N": bn}, num_warps=4, num_stages=stages)
    for bn in (32, 64, 128)
    for stages in (3, 4)
]
_fp8_block_linear_tuned = autotuned(
    _fp8_block_linear_kernel, FP8_LINEAR_CONFIGS, key=["n", "k", "BLOCK_M", "SPLIT"]
)
# K splits of a decode-sized product (`fp8_split_count`): about FP8_SPLIT_PROGRAMS_PER_SM
# programs an SM over the narrowest tiles (FP8_SPLIT_TILE_N columns), each split at least
# FP8_SPLIT_MIN_K_BLOCKS scale blocks of K long, at most FP8_MAX_SPLITS (the backend's default;
# `fp8_linear_split` off: none). Unsplit, GLM-5's FP8 products at 1-4 rows ran at 1.5 TB/s or
# less, 192 programs of 32 columns for o_proj's 6144 each walking all of K = 16384; split,
# o_proj took 40 us against 57 and the dense down 31 against 55 on the H200
# (bench/results/2026-12-02-h200-mtp-l16-e32-splits, fp8-splits-probe.jsonl)
FP8_SPLIT_PROGRAMS_PER_SM = 8
FP8_SPLIT_TILE_N = 32
FP8_SPLIT_MIN_K_BLOCKS = 4
FP8_MAX_SPLITS = 8
FP8_SPLIT_MAX_ROWS = 16  # one 16-row tile: a decode or verify step's


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count  # torch caches it


def fp8_split_count(m: int, n: int, k: int, device: torch.device, block: int = FP8_BLOCK) -> int:
    """How many K splits `fp8_block_linear(splits="auto")` gives an `[m, k] @ [n, k].T`
    product on `device`: none past one 16-row tile or on the CPU (the interpreter splits only
    when given a count), else enough for about FP8_SPLIT_PROGRAMS_PER_SM programs an SM."""
    if device.type != "cuda" or m > FP8_SPLIT_MAX_ROWS:
        return 1
    sms = _sm_count(device)
    tiles = triton.cdiv(n, FP8_SPLIT_TILE_N)
    k_blocks = triton.cdiv(k, block)
    most = min(FP8_MAX_SPLITS, k_blocks // FP8_SPLIT_MIN_K_BLOCKS)
    return max(1, min(sms * FP8_SPLIT_PROGRAMS_PER_SM // tiles, most))


# (device, n, splits) -> (partial sums [splits * 16 * n] float32, counts [n] int32): a split
# product's scratch, made once (warmup runs each shape before graph capture) and shared by
# every call of that shape (one stream runs them one after another; counts end at 0); the
# 1-element pair of a device stands in for it in an unsplit launch (the same argument dtypes:
# the same tuning key)
_FP8_SPLIT_SCRATCH: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _fp8_split_scratch(device: torch.device, n: int, splits: int) -> tuple:
    key = (str(device), n if splits > 1 else 0, splits)
    if key not in _FP8_SPLIT_SCRATCH:
        size = splits * FP8_SPLIT_MAX_ROWS * n if splits > 1 else 1
        _FP8_SPLIT_SCRATCH[key] = (
            torch.empty(size, dtype=torch.float32, device=device),
            torch.zeros(max(n, 1) if splits > 1 else 1, dtype=torch.int32, device=device),
        )
    return _FP8_SPLIT_SCRATCH[key]


def fp8_block_linear(
    x: torch.Tensor,
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    block: int = FP8_BLOCK,
    splits: int | str = 1,
) -> torch.Tensor:
    """`x [..., K] @ dequant(q [N, K], scale_inv).T` in `x`'s dtype, without writing the
    dequantized weight: a decode step then reads one byte per weight instead of five (the
    fp8 weight, the bf16 copy written and read back). `splits`: K splits (a count, at most
    FP8_SPLIT_MAX_ROWS rows; or "auto", `fp8_split_count`'s)."""
    _check_device(x, q, scale_inv)
    if q.dtype != FP8_DTYPE or q.dim() != 2:
        raise ValueError(f"expected a 2-D {FP8_DTYPE} weight, got {q.dtype} {tuple(q.shape)}")
    n, k = q.shape
    if x.shape[-1] != k or tuple(scale_inv.shape) != scale_shape((n, k), block):
        raise ValueError(
            f"x {tuple(x.shape)}, weight {tuple(q.shape)} and scales {tuple(scale_inv.shape)} "
            f"do not match (scales: [ceil(N/{block}), ceil(K/{block})])"
        )
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    if splits == "auto":
        splits = fp8_split_count(m, n, k, x.device, block)
    if not isinstance(splits, int) or splits < 1 or (splits > 1 and m > FP8_SPLIT_MAX_ROWS):
        raise ValueError(
            f"splits must be 'auto' or a count of at least 1 (above 1: at most "
            f"{FP8_SPLIT_MAX_ROWS} rows), got {splits!r} for {m} rows"
        )
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 64
    kernel, fixed = tuned_or_fixed(_fp8_block_linear_tuned, BLOCK_N=64)
    partial, counts = _fp8_split_scratch(x.device, n, splits)
    if out.numel():

        def grid(meta):
            return (triton.cdiv(m, block_m), triton.cdiv(n, meta["BLOCK_N"]), splits)

        kernel[grid](
            rows,
            q.contiguous(),
            scale_inv.contiguous(),
            out,
            partial,
            counts,
            m,
            n,
            k,
            rows.stride(0),
            out.stride(0),
            triton.cdiv(k, block),
            DOT_FP32=dot_in_fp32(x.dtype),
            SPLIT=splits > 1,
            BLOCK_M=block_m,
            BLOCK_K=block,
            **fixed,
        )
    return out.view(*x.shape[:-1], n)


def dequantize_fp8_block(
    q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, block: int = FP8_BLOCK
) -> torch.Tensor:
    """`q [..., N, K]` fp8 e4m3 times its block scales `scale_inv [..., ceil(N/b), ceil(K/b)]`,
    in `dtype`: the same values as `quant.dequantize_fp8_block`."""
    _check_device(q, scale_inv)
    if q.dtype != FP8_DTYPE:
        raise ValueError(f"expected a {FP8_DTYPE} weight, got {q.dtype}")
    n, k = q.shape[-2:]
    nb, kb = scale_shape((n, k), block)
    if tuple(scale_inv.shape) != (*q.shape[:-2], nb, kb):
        raise ValueError(
            f"weight_scale_inv shape {tuple(scale_inv.shape)} does not match fp8 weight "
            f"{tuple(q.shape)}: expected [..., {nb}, {kb}] for {block}x{block} blocks"
        )
    matrices = q.reshape(-1, n, k).contiguous()  # [B, N, K]
    scales = scale_inv.reshape(-1, nb, kb).contiguous()  # [B, nb, kb]
    out = torch.empty(matrices.shape, dtype=dtype, device=q.device)
    if out.numel():
        kernel, fixed = tuned_or_fixed(_dequant_fp8_block_tuned)
        grid = (matrices.shape[0], nb, kb)
        kernel[grid](matrices, scales, out, n, k, nb, kb, BLOCK=block, **fixed)
    return out.view(q.shape)


@triton.jit
def _rotate_row(src, dst, cos, sin, i, mask, half, INTERLEAVED: tl.constexpr):
    """One head's row: pairs (i, i + half) or (2i, 2i + 1) rotated, written half-split."""
    if INTERLEAVED:
        x1 = tl.load(src + 2 * i, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + 2 * i + 1, mask=mask, other=0.0).to(tl.float32)
    else:
        x1 = tl.load(src + i, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + half + i, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + i, (x1 * cos - x2 * sin).to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + half + i, (x2 * cos + x1 * sin).to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _rope_store_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    k_slot_stride,
    k_head_stride,
    v_slot_stride,
    v_head_stride,
    num_q_heads,
    half,
    v_dim,
    INTERLEAVED: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # one program per (token, head): q heads first, then kv heads (k rotated into the cache,
    # v copied beside it)
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    mask = i < half
    cos = tl.load(cos_ptr + t * half + i, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * half + i, mask=mask, other=0.0).to(tl.float32)
    if head < num_q_heads:
        src = q_ptr + t * q_stride_t + head * q_stride_h
        dst = q_out_ptr + (t * num_q_heads + head) * 2 * half
        _rotate_row(src, dst, cos, sin, i, mask, half, INTERLEAVED)
    else:
        kv_head = head - num_q_heads
        slot = tl.load(slot_ptr + t).to(tl.int64)
        src = k_ptr + t * k_stride_t + kv_head * k_stride_h
        dst = k_cache_ptr + slot * k_slot_stride + kv_head * k_head_stride
        _rotate_row(src, dst, cos, sin, i, mask, half, INTERLEAVED)
        j = tl.arange(0, BLOCK_V)
        v_mask = j < v_dim
        value = tl.load(v_ptr + t * v_stride_t + kv_head * v_stride_h + j, mask=v_mask)
        dst_v = v_cache_ptr + slot * v_slot_stride + kv_head * v_head_stride + j
        tl.store(dst_v, value.to(v_cache_ptr.dtype.element_ty), mask=v_mask)


# NOTE: the cache writes need no restore between timing runs: each run stores the same rotated
# k and v at the same slots, and q is rotated into a new tensor
_rope_store_tuned = autotuned(
    _rope_store_kernel, warps_configs(1, 2, 4), key=["num_q_heads", "half", "v_dim", "INTERLEAVED"]
)


@triton.jit
def _rope_part_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    x_stride_t,
    x_stride_h,
    num_heads,
    dim,
    start,
    half,
    INTERLEAVED: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # one program per (token, head): dims [start, start + 2 * half) rotated, the rest copied
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    src = x_ptr + t * x_stride_t + head * x_stride_h
    dst = out_ptr + (t * num_heads + head) * dim
    d = tl.arange(0, BLOCK_D)
    kept = (d < dim) & ((d < start) | (d >= start + 2 * half))
    tl.store(dst + d, tl.load(src + d, mask=kept), mask=kept)
    i = tl.arange(0, BLOCK)
    mask = i < half
    cos = tl.load(cos_ptr + t * half + i, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * half + i, mask=mask, other=0.0).to(tl.float32)
    _rotate_row(src + start, dst + start, cos, sin, i, mask, half, INTERLEAVED)


_rope_part_tuned = autotuned(
    _rope_part_kernel, warps_configs(1, 2, 4), key=["num_heads", "dim", "half", "INTERLEAVED"]
)


def rope_part(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, start: int
) -> torch.Tensor:
    """`torch_ref.rope_part`: `x [T, H, D]` (head rows contiguous, any token and head strides)
    with dims `start : start + 2 * half` rotated by `cos/sin [T, half]`, the rest copied, into
    a new contiguous tensor: one launch where the reference runs a slice's rotation (seven
    kernels) and a concatenation."""
    _check_device(x, cos, sin)
    tokens, num_heads, dim = x.shape
    half = cos.shape[-1]
    if cos.shape != (tokens, half) or sin.shape != cos.shape or start + 2 * half > dim:
        raise ValueError(
            f"x {tuple(x.shape)}: cos/sin {tuple(cos.shape)} do not fit from dim {start}"
        )
    if x.stride(2) != 1:
        raise ValueError(f"x's head rows must be contiguous, got strides {x.stride()}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if tokens and num_heads:
        kernel, fixed = tuned_or_fixed(_rope_part_tuned)
        kernel[(tokens, num_heads)](
            x, cos.contiguous(), sin.contiguous(), out, x.stride(0), x.stride(1), num_heads,
            dim, start, half, INTERLEAVED=interleaved, BLOCK=triton.next_power_of_2(half),
            BLOCK_D=triton.next_power_of_2(dim), **fixed,
        )  # fmt: skip
    return out


@triton.jit
def _norm_rope_store_kernel(
    x_ptr,
    weight_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    cache_ptr,
    x_stride_t,
    slot_stride,
    rank,
    half,
    eps,
    INTERLEAVED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # one program per token: `rms_norm(x[:rank]) | rope(x[rank:rank + 2 half])` into its slot,
    # rounded as `_rms_norm_kernel` and `_rotate_row` round
    t = tl.program_id(0).to(tl.int64)
    src = x_ptr + t * x_stride_t
    dst = cache_ptr + tl.load(slot_ptr + t).to(tl.int64) * slot_stride
    r = tl.arange(0, BLOCK_R)
    r_mask = r < rank
    x = tl.load(src + r, mask=r_mask, other=0.0).to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / rank
    normed = (x * tl.rsqrt(mean_square + eps)).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + r, mask=r_mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(dst + r, out.to(cache_ptr.dtype.element_ty), mask=r_mask)
    i = tl.arange(0, BLOCK)
    mask = i < half
    cos = tl.load(cos_ptr + t * half + i, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * half + i, mask=mask, other=0.0).to(tl.float32)
    _rotate_row(src + rank, dst + rank, cos, sin, i, mask, half, INTERLEAVED)


# NOTE: the cache writes need no restore between timing runs: the same values, the same slots
_norm_rope_store_tuned = autotuned(
    _norm_rope_store_kernel, warps_configs(1, 2, 4), key=["rank", "half", "INTERLEAVED"]
)


def norm_rope_store(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """`Backend.norm_rope_store` in one launch: `x [T, R + 2 half]` (rows contiguous, any
    token stride: a view of a projection's output), its first `R` values RMS-normed with
    `weight [R]`, the rest rotated by `cos/sin [T, half]`, written into `cache [P, S, R + 2
    half]` at `slot_mapping`. The reference runs the norm, the rotation (seven kernels), a
    concatenation and the cache write."""
    _check_device(x, weight, cos, sin, cache)
    _check_token_rows(x, cos, sin, cache)
    tokens, width = x.shape
    rank, half = weight.shape[0], cos.shape[-1]
    if rank + 2 * half != width:
        raise ValueError(f"x {tuple(x.shape)} must be norm {rank} | rope {2 * half} wide")
    if tokens:
        kernel, fixed = tuned_or_fixed(_norm_rope_store_tuned)
        kernel[(tokens,)](
            x, weight, cos.contiguous(), sin.contiguous(), slot_mapping, cache, x.stride(0),
            width, rank, half, eps, INTERLEAVED=interleaved,
            BLOCK_R=triton.next_power_of_2(rank), BLOCK=triton.next_power_of_2(half), **fixed,
        )  # fmt: skip


@triton.jit
def _layer_norm_at(src, w_ptr, b_ptr, d, mask, mean, rstd, dtype):
    """LayerNorm of `src[d]` (given the row's mean and 1/std), rounded to `dtype` once, as
    torch's layer_norm rounds: float32 throughout, the weight and bias included."""
    x = tl.load(src + d, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + d, mask=mask, other=0.0).to(tl.float32)
    return ((x - mean) * rstd * w + b).to(dtype).to(tl.float32)


@triton.jit
def _layer_norm_rope_store_kernel(
    x_ptr,
    weight_ptr,
    bias_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    cache_ptr,
    x_stride_t,
    slot_stride,
    dim,
    half,
    eps,
    INTERLEAVED: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # one program per token: `layer_norm(x)` with its first 2 half dims rotated (`_rotate_row`'s
    # pairs and rounding, from the rounded norm as `rope_part` reads it), into its slot
    t = tl.program_id(0).to(tl.int64)
    src = x_ptr + t * x_stride_t
    dst = cache_ptr + tl.load(slot_ptr + t).to(tl.int64) * slot_stride
    dtype = x_ptr.dtype.element_ty
    d = tl.arange(0, BLOCK_D)
    d_mask = d < dim
    x = tl.load(src + d, mask=d_mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / dim
    centred = tl.where(d_mask, x - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(centred * centred, axis=0) / dim + eps)
    kept = d_mask & (d >= 2 * half)  # the dims past the rotated ones, normed only
    normed = _layer_norm_at(src, weight_ptr, bias_ptr, d, kept, mean, rstd, dtype)
    tl.store(dst + d, normed.to(cache_ptr.dtype.element_ty), mask=kept)
    i = tl.arange(0, BLOCK)
    mask = i < half
    if INTERLEAVED:
        first, second = 2 * i, 2 * i + 1
    else:
        first, second = i, i + half
    x1 = _layer_norm_at(src, weight_ptr, bias_ptr, first, mask, mean, rstd, dtype)
    x2 = _layer_norm_at(src, weight_ptr, bias_ptr, second, mask, mean, rstd, dtype)
    cos = tl.load(cos_ptr + t * half + i, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * half + i, mask=mask, other=0.0).to(tl.float32)
    out = cache_ptr.dtype.element_ty
    tl.store(dst + i, (x1 * cos - x2 * sin).to(dtype).to(out), mask=mask)
    tl.store(dst + half + i, (x2 * cos + x1 * sin).to(dtype).to(out), mask=mask)


# NOTE: the cache writes need no restore between timing runs: the same values, the same slots
_layer_norm_rope_store_tuned = autotuned(
    _layer_norm_rope_store_kernel, warps_configs(1, 2, 4), key=["dim", "half", "INTERLEAVED"]
)


def layer_norm_rope_store(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """`Backend.layer_norm_rope_store` in one launch: `x [T, D]` (rows contiguous, any token
    stride) LayerNormed with `weight`, `bias [D]`, its first `2 half` dims rotated by `cos/sin
    [T, half]`, written into `cache [P, S, D]` at `slot_mapping`. The reference runs the norm,
    the rotation with its concatenation, and the cache write."""
    _check_device(x, weight, bias, cos, sin, cache)
    _check_token_rows(x, cos, sin, cache)
    tokens, dim = x.shape
    half = cos.shape[-1]
    if weight.shape != (dim,) or bias.shape != (dim,):
        raise ValueError(
            f"weight {tuple(weight.shape)} and bias {tuple(bias.shape)} must be [{dim}] (x's)"
        )
    if tokens:
        kernel, fixed = tuned_or_fixed(_layer_norm_rope_store_tuned)
        kernel[(tokens,)](
            x, weight, bias, cos.contiguous(), sin.contiguous(), slot_mapping, cache,
            x.stride(0), dim, dim, half, eps, INTERLEAVED=interleaved,
            BLOCK_D=triton.next_power_of_2(dim), BLOCK=triton.next_power_of_2(half), **fixed,
        )  # fmt: skip


def _check_token_rows(x, cos, sin, cache) -> None:
    """What the one-launch cache stores take: `x [T, D]` with contiguous rows (any token
    stride), `cos/sin [T, half]` with `2 half <= D`, and `cache [P, S, D]` of contiguous pages."""
    tokens, width = x.shape
    half = cos.shape[-1]
    if cos.shape != (tokens, half) or sin.shape != cos.shape or 2 * half > width:
        raise ValueError(f"cos/sin {tuple(cos.shape)} do not fit x {tuple(x.shape)}")
    if cache.shape[2:] != (width,):
        raise ValueError(f"cache {tuple(cache.shape)} must hold rows of x's {width} values")
    if x.stride(1) != 1 or cache.stride(2) != 1 or cache.stride(0) != cache.shape[1] * width:
        raise ValueError(f"rows must be contiguous: x {x.stride()}, cache {cache.stride()}")


def _slot_strides(cache: torch.Tensor, name: str) -> tuple[int, int]:
    """A `[P, S, H, D]` cache's stride per slot (page * S + offset) and per head."""
    if cache.stride(3) != 1 or cache.stride(0) != cache.shape[1] * cache.stride(1):
        raise ValueError(f"{name} must have contiguous pages and head rows, got {cache.stride()}")
    return cache.stride(1), cache.stride(2)


def rope_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotate `q [T, Hq, D]` and `k [T, Hkv, D]` by `cos/sin [T, D/2]` (as
    `torch_ref.apply_rotary`), store the rotated k and `v [T, Hkv, Dv]` into the caches at
    `slot_mapping [T]`, and return the rotated q: one launch for all of it."""
    _check_device(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, v_dim = v.shape[1], v.shape[2]
    half = head_dim // 2
    if head_dim % 2 or k.shape != (tokens, num_kv_heads, head_dim) or v.shape[0] != tokens:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match")
    if cos.shape != (tokens, half) or sin.shape != (tokens, half):
        raise ValueError(f"cos/sin must be [{tokens}, {half}], got {tuple(cos.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(2) != 1:
            raise ValueError(f"{name}'s head rows must be contiguous, got strides {t.stride()}")
    k_slot, k_head = _slot_strides(k_cache, "k_cache")
    v_slot, v_head = _slot_strides(v_cache, "v_cache")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if tokens:
        kernel, fixed = tuned_or_fixed(_rope_store_tuned)
        kernel[(tokens, num_q_heads + num_kv_heads)](
            q,
            k,
            v,
            cos.contiguous(),
            sin.contiguous(),
            slot_mapping,
            q_out,
            k_cache,
            v_cache,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            k_slot,
            k_head,
            v_slot,
            v_head,
            num_q_heads,
            half,
            v_dim,
            INTERLEAVED=interleaved,
            BLOCK=triton.next_power_of_2(half),
            BLOCK_V=triton.next_power_of_2(v_dim),
            **fixed,
        )
    return q_out


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, inter, row_stride, BLOCK: tl.constexpr):
    # one program per (row, block of the intermediate dim)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gate_up_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * row_stride + inter + cols, mask=mask, other=0.0)
    # rounded where torch rounds: silu's output to the dtype, then the product
    act = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
    out = act * up.to(tl.float32)
    tl.store(out_ptr + row * inter + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


# columns per program and warps (4 to 8 values a thread), per intermediate width
SILU_MUL_CONFIGS = [
    triton.Config({"BLOCK": block}, num_warps=warps)
    for block, warps in ((256, 1), (512, 2), (1024, 4), (1024, 8), (2048, 8))
]
_silu_mul_tuned = autotuned(_silu_mul_kernel, SILU_MUL_CONFIGS, key=["inter"], default=2)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for `gate_up [..., 2I]` = `gate | up`: `[..., I]`, one launch."""
    _check_device(gate_up)
    inter = gate_up.shape[-1] // 2
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dim must be even (gate | up), got {gate_up.shape[-1]}")
    rows = gate_up.reshape(-1, 2 * inter)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], inter), dtype=gate_up.dtype, device=gate_up.device)
    if out.numel():
        kernel, fixed = tuned_or_fixed(
            _silu_mul_tuned, BLOCK=min(1024, triton.next_power_of_2(inter))
        )

        def grid(meta):
            return (rows.shape[0], triton.cdiv(inter, meta["BLOCK"]))

        kernel[grid](rows, out, inter, rows.stride(0), **fixed)
    return out.view(*gate_up.shape[:-1], inter)


@triton.jit
def lane_sums(products, LANE: tl.constexpr):
    """`products [N, K]` summed over each run of LANE along K: `[N, K // LANE]`.

    A GEMV's K step adds its products into an accumulator that it sums over K once, after the
    loop. A `[BLOCK_N, BLOCK_K]` accumulator holds a float32 register per weight element of
    the tile; summed in runs of what one 16-byte load holds (each thread's own elements: no
    shuffles: LANE = `min(128 // bits of a weight, BLOCK_K)`, 16 FP8 ones) it holds a LANE-th
    of that. The registers freed let more programs stay resident, each with its loads in flight
    (triton 3.7's sm_90 code: 128 -> 71 registers a thread for an 8 x 1024 FP8 tile, 155 -> 80
    for 16 x 512 with the norm and SwiGLU)."""
    n: tl.constexpr = products.shape[0]
    k: tl.constexpr = products.shape[1]
    return tl.sum(tl.reshape(products, (n, k // LANE, LANE)), axis=2)


@triton.jit
def dot_acc(acc, a, b, DOT_FP32: tl.constexpr):
    """`acc + a @ b` with float32 sums: on tensor cores in the inputs' dtype (cuBLAS's way, which
    the reference's bf16 matmuls take), or in IEEE float32 (`dot_in_fp32`)."""
    if DOT_FP32:
        return acc + tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return acc + tl.dot(a, b)


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """`dot_acc`'s DOT_FP32 for inputs of `dtype`: float32 models, and triton's interpreter,
    which has no bf16 dot (the products of 16-bit inputs are exact in float32)."""
    return dtype == torch.float32 or bool(triton.knobs.runtime.interpret)


def _check_device(*tensors: torch.Tensor | None) -> None:
    """Compiled kernels need CUDA tensors; the interpreter runs on CPU tensors."""
    if triton.knobs.runtime.interpret:
        return
    for t in tensors:
        if t is not None and not t.is_cuda:
            raise ValueError(
                f"triton kernels need CUDA tensors, got one on {t.device} "
                "(set TRITON_INTERPRET=1 before importing triton to run them on CPU)"
            )
