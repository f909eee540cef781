"""Bandwidth floors: a disk figure for a real file; the H2D figure refuses a device that is not
CUDA (the CUDA figure is measured in test_streamer's GPU test)."""

from __future__ import annotations

import pytest

from snapfn.snapshot.portable.bandwidth import measure_disk_read_gbps, measure_h2d_gbps

from layout_files import write_mixed


def test_disk_figure_and_h2d_refusal(tmp_path):
    path, _, _ = write_mixed(tmp_path)
    assert measure_disk_read_gbps(path) > 0
    with pytest.raises(ValueError):
        measure_h2d_gbps("cpu")
