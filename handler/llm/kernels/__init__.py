"""Backend registry: attention / GEMM / MoE implementations chosen by name.

`get_backend("auto", device)` picks the backend for the device: on CUDA the first of
`AUTO_CUDA` that is installed and builds here — "flashinfer" (FlashInfer's paged attention over
the triton backend), then "triton" (our own Triton kernels over the torch reference) — else,
and on CPU always, the torch reference. A backend enters `AUTO_CUDA` only once its GPU checks
passed on a GPU (docs/kernels.md says which run). `SNAPFN_BACKEND=NAME` picks one by name.
Under "triton" and "flashinfer", DeepGEMM (`deepgemm.py`) runs the prefill-sized FP8 GEMMs
where it is importable on an SM90 GPU; `SNAPFN_DEEPGEMM=off` keeps them on the Triton path.
`SNAPFN_GEMV=off` keeps one-row projections on cuBLAS (16-bit weights) or the FP8 tile kernel,
with the norm and SwiGLU kernels around them (`triton.gemv` fuses them in), and a one-token
MoE on the sorted-pairs kernels (`triton.moe.moe_gemv` reads its experts as GEMVs);
`SNAPFN_DECODE_ATTENTION` picks who runs the flashinfer backend's decode attention
(`flashinfer.backend.DECODE_ATTENTION`); `SNAPFN_PREFILL_INDEXER=off` scores the DSA indexer's
prefill chunks with the reference's float32 GEMM instead of Triton; `SNAPFN_MOE_ROUTER=off`
routes MoE tokens with the reference's torch ops instead of one Triton kernel
(`triton.moe.route`), and `SNAPFN_INDEXER_SELECT=off` picks the DSA indexer's decode top-k
with the reference's sort instead of one (`triton.indexer.select_topk_decode`).
`SNAPFN_MOE_GEMV_ROWS=off` keeps the routed experts of a step of 2 to 4 tokens (a verify step's
1 + k drafts, a decode batch of 2-4) on the sorted-pairs kernels; by default `moe_gemv` takes
them as it takes one token's (`triton.moe.MOE_GEMV_MAX_TOKENS`).
By default the K of a decode-sized FP8 product of the tile kernel is split
(`triton.kernels.fp8_split_count`: 16 rows or fewer, few column tiles);
`SNAPFN_FP8_LINEAR_SPLIT=off` runs every product unsplit.
`SNAPFN_GEMV_SPLIT=off` never splits a GEMV's K (`triton.gemv.split_count`), and
`SNAPFN_CACHE_STORES=off` writes MLA's latent and the DSA indexer's key into their caches with
the reference's ops instead of one launch each (`triton.kernels.norm_rope_store`,
`layer_norm_rope_store`): switches to time each change against its absence on one machine.
Decode batches' MLA attention runs `triton.mla` (no host planning); `SNAPFN_MLA_DECODE=off`
keeps the reference (triton backend) or flashinfer's MLA kernel (flashinfer backend).
`SNAPFN_MLA_ABSORB=triton` computes MLA's absorbed products of a decode batch (`W_k^T q`, `W_v o`
per head) with `triton.absorb`, reading `kv_b` as stored (FP8), instead of two bmms over a
dense copy; `auto`, the default, keeps the bmms, which were about 1 us a layer faster on the
H200 (bench/results/2026-12-01-h200-steady-glm5-absorb-v2).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import torch

from snapfn.handler.llm.kernels.base import Backend
from snapfn.snapshot.errors import InitFailed

_FACTORIES: dict[str, Callable[[], Backend]] = {}


def register_backend(name: str, factory: Callable[[], Backend]) -> None:
    _FACTORIES[name] = factory


def _torch_factory() -> Backend:
    from snapfn.handler.llm.kernels.torch_ref import TorchBackend

    return TorchBackend()


def _triton_modes() -> dict[str, str]:
    """The triton backend's switches from the environment. NOTE: read when a backend is built,
    never at import."""
    return {
        "deepgemm": os.environ.get("SNAPFN_DEEPGEMM", "auto"),
        "gemv": os.environ.get("SNAPFN_GEMV", "auto"),
        "prefill_indexer": os.environ.get("SNAPFN_PREFILL_INDEXER", "auto"),
        "router": os.environ.get("SNAPFN_MOE_ROUTER", "auto"),
        "indexer_select": os.environ.get("SNAPFN_INDEXER_SELECT", "auto"),
        "gemv_split": os.environ.get("SNAPFN_GEMV_SPLIT", "auto"),
        "cache_stores": os.environ.get("SNAPFN_CACHE_STORES", "auto"),
        "mla_decode": os.environ.get("SNAPFN_MLA_DECODE", "auto"),
        "mla_absorb": os.environ.get("SNAPFN_MLA_ABSORB", "auto"),
        "moe_gemv_rows": os.environ.get("SNAPFN_MOE_GEMV_ROWS", "auto"),
        "fp8_linear_split": os.environ.get("SNAPFN_FP8_LINEAR_SPLIT", "auto"),
    }


def _triton_factory() -> Backend:
    from snapfn.handler.llm.kernels.triton.backend import TritonBackend

    return TritonBackend(**_triton_modes())


def _flashinfer_factory() -> Backend:
    # imports flashinfer (InitFailed, saying how to install it, where it cannot)
    from snapfn.handler.llm.kernels.flashinfer.backend import DECODE_ATTENTION, FlashInferBackend

    decode_attention = os.environ.get("SNAPFN_DECODE_ATTENTION", DECODE_ATTENTION)
    return FlashInferBackend(**_triton_modes(), decode_attention=decode_attention)


register_backend("torch", _torch_factory)
register_backend("triton", _triton_factory)
register_backend("flashinfer", _flashinfer_factory)
# NOTE: correctness before speed: an unverified kernel must not become every CUDA run's
# default. triton: tests/test_triton_kernels.py's GPU cases passed on the H200 (2026-11-30,
# bench/results/2026-11-30-h200-tier1-llama8b-keeper-hold); flashinfer: tests/test_flashinfer.py's
# (2026-11-30, results in commit d1f6db7).
AUTO_CUDA = ("flashinfer", "triton")


def _installed(name: str) -> bool:
    # NOTE: find_spec only: importing triton or flashinfer takes seconds and touches CUDA.
    return importlib.util.find_spec(name) is not None


def available_backends() -> list[str]:
    return sorted(_FACTORIES)


def get_backend(name: str = "auto", device: str = "cpu") -> Backend:
    """Instantiate backend `name`; "auto" picks the best registered one for `device`."""
    if name == "auto":
        if torch.device(device).type == "cuda":
            for candidate in AUTO_CUDA:
                if not _installed(candidate):
                    continue
                try:
                    return _FACTORIES[candidate]()
                except (InitFailed, ImportError):  # e.g. flashinfer without its dependencies
                    continue
        name = "torch"
    if name not in _FACTORIES:
        raise ValueError(f"unknown backend {name!r} (available: {', '.join(available_backends())})")
    return _FACTORIES[name]()
