"""SNAPFN_PROCESS_DIAG's report helpers (the CUDA half runs only under the diagnosis on a GPU)."""

from __future__ import annotations

from snapfn.handler.llm.recipes.process_diag import _ours


def test_frames_are_named_from_the_package_root_and_others_are_not_ours():
    assert _ours("/tmp/snapfn-dev/snapfn/handler/llm/kernels/torch_ref.py") == (
        "handler/llm/kernels/torch_ref.py"
    )
    assert _ours("/srv/app/snapshot/cuda/regions.py") == "snapshot/cuda/regions.py"
    assert _ours("/usr/lib/python3/site-packages/torch/nn/functional.py") == ""
