"""Our Triton kernels against the torch reference (`tests/triton_checks.py` holds the cases).

On CPU the cases run in a subprocess under triton's interpreter (`TRITON_INTERPRET=1` must be
set before triton is imported, and this pytest process must not be switched to it); on CUDA
they run compiled, in-process. Both skip when triton is not installed. On CUDA, two fresh
processes over one `TRITON_CACHE_DIR` check that autotune results land there and are reused.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from snapfn.handler.llm.kernels import available_backends, get_backend

import triton_checks

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)"
)
compiles = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1",
    reason="TRITON_INTERPRET=1: kernels would not compile",
)


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, dict]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "triton_checks", "--device", "cpu"],
        cwd=Path(__file__).parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,  # every case interpreted: about 3 minutes on a 2-core CI machine
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    return {r["case"]: r for r in results}


@needs_triton
@pytest.mark.parametrize("case", triton_checks.CASES)
def test_interpreted_kernel_matches_reference(case, interpreted_results):
    assert case in interpreted_results, f"{case} did not run"
    result = interpreted_results[case]
    assert result["ok"], result["error"]


@pytest.mark.gpu
@needs_cuda
@compiles
@needs_triton
@pytest.mark.parametrize("case", triton_checks.CASES)
def test_cuda_kernel_matches_reference(case):
    triton_checks.run_case(case, "cuda")


def _tune_in_fresh_process(cache_dir: Path, mode: str = "init") -> Counter:
    """Each autotuned kernel called once (`triton_checks.run_autotuned_once`) in a new process
    over `cache_dir` under SNAPFN_KERNEL_TUNING=`mode`; returns how many configs each kernel
    timed (triton prints a line per config it benchmarks with TRITON_PRINT_AUTOTUNING=1, none
    for a result read from disk)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(cache_dir), "TRITON_PRINT_AUTOTUNING": "1"}
    env |= {"SNAPFN_KERNEL_TUNING": mode}
    proc = subprocess.run(
        [sys.executable, "-m", "triton_checks", "--device", "cuda", "--autotune-once"],
        cwd=Path(__file__).parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return Counter(re.findall(r"^Autotuning kernel (\w+) with config", proc.stdout, re.M))


def _autotune_results(cache_dir: Path) -> dict[Path, str]:
    # triton's results cache: <TRITON_CACHE_DIR>/<hash of key and configs>/<kernel>.autotune.json
    return {path: path.read_text() for path in cache_dir.rglob("*.autotune.json")}


@pytest.mark.gpu
@needs_cuda
@compiles
@needs_triton
def test_autotune_results_land_in_the_cache_and_a_restore_reuses_them(tmp_path):
    timed = _tune_in_fresh_process(tmp_path)
    assert set(timed) == set(triton_checks.AUTOTUNED_KERNELS), timed
    results = _autotune_results(tmp_path)
    per_kernel = Counter(path.name.removesuffix(".autotune.json") for path in results)
    assert per_kernel == Counter(triton_checks.AUTOTUNED_KERNELS), per_kernel
    # a restore: the same cache in a new process times nothing and writes nothing
    assert not _tune_in_fresh_process(tmp_path), "re-tuned with the results on disk"
    assert _autotune_results(tmp_path) == results


@pytest.mark.gpu
@needs_cuda
@compiles
@needs_triton
def test_the_default_tuning_times_nothing(tmp_path):
    """SNAPFN_KERNEL_TUNING=shipped (the default): every kernel runs its shipped or default
    config at once, so an empty cache is filled with compiles only, never with timings."""
    assert not _tune_in_fresh_process(tmp_path, mode="shipped")
    assert not _autotune_results(tmp_path)


def test_registry_lists_triton():
    assert "triton" in available_backends()
    assert get_backend("triton").name == "triton"


def test_kernel_switches_default_on_and_are_read_from_the_environment(monkeypatch):
    on_by_default = (
        "SNAPFN_GEMV",
        "SNAPFN_PREFILL_INDEXER",
        "SNAPFN_DEEPGEMM",
        "SNAPFN_MOE_ROUTER",
        "SNAPFN_INDEXER_SELECT",
        "SNAPFN_GEMV_SPLIT",
        "SNAPFN_CACHE_STORES",
        "SNAPFN_MOE_GEMV_ROWS",
    )
    for name in on_by_default:
        monkeypatch.delenv(name, raising=False)
    backend = get_backend("triton")
    assert backend._gemv and backend._prefill_indexer and backend._deepgemm_mode == "auto"
    assert backend._router and backend._indexer_select and backend._cache_stores
    assert backend._gemv_splits is None and backend._moe_gemv_rows  # split_count decides
    for name in on_by_default:
        monkeypatch.setenv(name, "off")
    backend = get_backend("triton")
    assert not backend._gemv and not backend._prefill_indexer and backend._deepgemm_mode == "off"
    assert not backend._router and not backend._indexer_select and not backend._cache_stores
    assert backend._gemv_splits == 1 and not backend._moe_gemv_rows
    monkeypatch.setenv("SNAPFN_PREFILL_INDEXER", "on")  # only auto | off
    with pytest.raises(ValueError, match="prefill_indexer must be 'auto' or 'off'"):
        get_backend("triton")


def test_triton_mla_decode_is_on_by_default_and_off_by_its_switch(monkeypatch):
    monkeypatch.delenv("SNAPFN_MLA_DECODE", raising=False)
    assert get_backend("triton")._mla_decode  # faster on the H200 (commit 4314b28)
    monkeypatch.setenv("SNAPFN_MLA_DECODE", "off")
    assert not get_backend("triton")._mla_decode
    monkeypatch.setenv("SNAPFN_MLA_DECODE", "triton")  # the opt-in's spelling before
    assert get_backend("triton")._mla_decode
    monkeypatch.setenv("SNAPFN_MLA_DECODE", "flashmla")
    with pytest.raises(ValueError, match="mla_decode must be 'auto' or 'off', not 'flashmla'"):
        get_backend("triton")


def test_the_fp8_linear_split_is_on_by_default_and_refuses_unknown_values(monkeypatch):
    monkeypatch.delenv("SNAPFN_FP8_LINEAR_SPLIT", raising=False)
    assert get_backend("triton")._fp8_splits == "auto"
    monkeypatch.setenv("SNAPFN_FP8_LINEAR_SPLIT", "off")
    assert get_backend("triton")._fp8_splits == 1
    monkeypatch.setenv("SNAPFN_FP8_LINEAR_SPLIT", "on")
    with pytest.raises(ValueError, match="fp8_linear_split must be 'auto' or 'off'"):
        get_backend("triton")


@needs_triton
def test_fp8_splits_go_to_few_rows_over_few_column_tiles(monkeypatch):
    from snapfn.handler.llm.kernels.triton import kernels as tk

    monkeypatch.setattr(tk, "_sm_count", lambda device: 132)  # an H200's SMs, without a GPU
    cuda = torch.device("cuda", 0)
    # GLM-5's o_proj: 192 tiles of 32 columns, 128 scale blocks of K: 132 * 8 // 192 = 5
    assert tk.fp8_split_count(4, 6144, 16384, cuda) == 5
    assert tk.fp8_split_count(1, 2816, 6144, cuda) == 8  # q_a | kv_a | wk: capped
    assert tk.fp8_split_count(4, 6144, 2048, cuda) == 4  # 16 blocks of K: 4 a split at least
    assert tk.fp8_split_count(1, 24576, 6144, cuda) == 1  # 768 tiles fill the SMs
    assert tk.fp8_split_count(17, 6144, 16384, cuda) == 1  # more than one 16-row tile
    assert tk.fp8_split_count(1, 6144, 16384, torch.device("cpu")) == 1


def test_triton_absorb_is_off_by_default_and_refuses_unknown_values(monkeypatch):
    monkeypatch.delenv("SNAPFN_MLA_ABSORB", raising=False)
    assert not get_backend("triton")._mla_absorb  # the bmms were faster (commit 4314b28)
    monkeypatch.setenv("SNAPFN_MLA_ABSORB", "triton")
    assert get_backend("triton")._mla_absorb
    monkeypatch.setenv("SNAPFN_MLA_ABSORB", "flashmla")
    with pytest.raises(ValueError, match="mla_absorb must be 'auto' or 'triton', not 'flashmla'"):
        get_backend("triton")


def test_auto_is_torch_on_cpu():
    assert get_backend("auto", "cpu").name == "torch"


def test_auto_on_cuda_takes_the_first_installed_backend_that_builds(monkeypatch):
    # get_backend does not touch the device: this runs on CPU-only machines too
    from snapfn.handler.llm import kernels
    from snapfn.snapshot.errors import InitFailed

    monkeypatch.setattr(kernels, "_installed", lambda name: name == "triton" and HAS_TRITON)
    want = "triton" if HAS_TRITON else "torch"
    assert get_backend("auto", "cuda").name == want
    assert get_backend("auto", "cuda:0").name == want
    monkeypatch.setattr(kernels, "_installed", lambda name: True)  # flashinfer "installed"…

    def broken():
        raise InitFailed("flashinfer: its dependencies do not import here")

    monkeypatch.setitem(kernels._FACTORIES, "flashinfer", broken)  # …but not building
    assert get_backend("auto", "cuda").name == want
    monkeypatch.setattr(kernels, "AUTO_CUDA", ())
    assert get_backend("auto", "cuda").name == "torch"


def test_triton_backend_inherits_non_fp8_linear():
    x, w, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
    assert torch.equal(get_backend("triton").linear(x, w, b), get_backend("torch").linear(x, w, b))


def test_importing_the_package_does_not_import_triton():
    code = (
        "import sys\n"
        "import snapfn.handler.llm.build\n"
        "from snapfn.handler.llm.kernels import get_backend\n"
        "get_backend('triton')\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@needs_triton
def test_compiled_kernels_refuse_cpu_tensors():
    code = (
        "import torch\n"
        "from snapfn.handler.llm.kernels.triton import kernels as tk\n"
        "try:\n"
        "    tk.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6)\n"
        "except ValueError as exc:\n"
        "    assert 'CUDA tensors' in str(exc), exc\n"
        "else:\n"
        "    raise AssertionError('no error')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=env)


@needs_triton
def test_gemv_splits_k_only_where_column_tiles_leave_sms_idle(monkeypatch):
    from snapfn.handler.llm.kernels.triton import gemv as tg
    from snapfn.handler.llm.weights.quant import FP8_DTYPE

    monkeypatch.setattr(tg, "_sm_count", lambda device: 132)  # an H200's SMs, without a GPU
    cuda = torch.device("cuda", 0)
    # GLM-5's FP8 kv_a and indexer wk: 72 and 16 tiles of 8 columns, 12 splits of K 6144
    assert tg.split_count(576, 6144, FP8_DTYPE, cuda) == 12
    assert tg.split_count(128, 6144, FP8_DTYPE, cuda) == 12
    # q_a: 256 tiles fill the SMs; bf16 and float32 count tiles of 2 columns
    assert tg.split_count(2048, 6144, FP8_DTYPE, cuda) == 1
    assert tg.split_count(576, 6144, torch.bfloat16, cuda) == 1
    assert tg.split_count(256, 6144, torch.float32, cuda) == 12  # the router: 128 tiles
    assert tg.split_count(32, 1024, torch.float32, cuda) == 2  # at least 512 of K a split
    assert tg.split_count(32, 6144, torch.float32, torch.device("cpu")) == 1
