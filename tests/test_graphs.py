"""DecodeGraphs' host side on CPU: what a replay writes into the captured graphs' inputs.

Capture needs CUDA (the GPU cases in test_triton_kernels / test_flashinfer replay real graphs);
here each bucket's graph is a stand-in that records the static input buffers when "replayed",
so the host mirror, its upload and the padding rows are checked on every CI run.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from snapfn.handler.llm.engine.batch import ForwardBatch
from snapfn.handler.llm.engine.graphs import DecodeGraphs
from snapfn.handler.llm.engine.kv_pool import KVBufferSpec, KVPool
from snapfn.handler.llm.kernels import get_backend

PAGE = 4


def _graphs() -> tuple[DecodeGraphs, list[dict]]:
    kv = KVPool([KVBufferSpec("k", 1, (2, 8))], 10, PAGE, torch.float32, "cpu")
    model = SimpleNamespace(device=torch.device("cpu"), backend=get_backend("torch"))
    graphs = DecodeGraphs(model, kv, [1, 4], max_seq_len=12)  # 3 page-table columns
    seen: list[dict] = []
    for n in graphs.buckets:

        def replay(n=n):
            static = graphs._batches[n]
            seen.append(
                {
                    "ids": static.input_ids.tolist(),
                    "positions": static.positions.tolist(),
                    "slots": static.slot_mapping.tolist(),
                    "seq_lens": static.seq_lens.tolist(),
                    "table": static.page_table.tolist(),
                    "seq_lens_cpu": static.seq_lens_cpu,
                }
            )

        graphs._batches[n] = graphs._static_batch(n)
        graphs._graphs[n] = SimpleNamespace(replay=replay)
        graphs._outputs[n] = torch.arange(n * 3).view(n, 3)
    return graphs, seen


def test_replay_writes_the_batch_and_pads_the_rest_on_the_scratch_page():
    graphs, seen = _graphs()
    s = graphs.kv.scratch_page
    batch = ForwardBatch.build([[7], [9]], [5, 2], [[3, 6], [8]], PAGE, "cpu")
    assert graphs.bucket_for(batch) == 4
    out = graphs.replay(batch, 4)
    assert out.tolist() == [[0, 1, 2], [3, 4, 5]]  # the batch's rows of the bucket's output
    assert seen[-1] == {
        "ids": [7, 9, 0, 0],
        "positions": [5, 2, 0, 0],
        "slots": [6 * PAGE + 1, 8 * PAGE + 2, s * PAGE, s * PAGE],
        "seq_lens": [6, 3, 1, 1],
        # the batch's own columns as built (a short row padded with page 0, never read: a
        # request reads its first ceil(seq_len / page) pages), the captured width's rest scratch
        "table": [[3, 6, s], [8, 0, s], [s, s, s], [s, s, s]],
        "seq_lens_cpu": (6, 3, 1, 1),
    }
    # a smaller batch next: the rows it does not use are padding again, not the last batch's
    graphs.replay(ForwardBatch.build([[4]], [0], [[2]], PAGE, "cpu"), 4)
    assert seen[-1]["ids"] == [4, 0, 0, 0]
    assert seen[-1]["table"] == [[2, s, s], [s, s, s], [s, s, s], [s, s, s]]
    assert seen[-1]["seq_lens_cpu"] == (1, 1, 1, 1)
    assert graphs.stats.replays == 2


def test_a_batch_on_the_device_side_replays_the_same():
    """A batch whose tensors are not host copies (no page_table_cpu) fills the same inputs."""
    graphs, seen = _graphs()
    batch = ForwardBatch.build([[7], [9]], [5, 2], [[3, 6], [8]], PAGE, "cpu")
    graphs.replay(batch, 4)
    moved = ForwardBatch(**{**batch.__dict__, "page_table_cpu": None, "packed": None})
    graphs.replay(moved, 4)
    assert seen[0] == seen[1]


def test_too_wide_or_prefill_batches_run_eagerly():
    graphs, _ = _graphs()
    wide = ForwardBatch.build([[1]], [13], [[1, 2, 3, 4]], PAGE, "cpu")  # 4 pages > 3 columns
    prefill = ForwardBatch.build([[1, 2]], [0], [[1]], PAGE, "cpu")
    too_many = ForwardBatch.build([[1]] * 5, [0] * 5, [[1]] * 5, PAGE, "cpu")
    assert [graphs.bucket_for(b) for b in (wide, prefill, too_many)] == [None, None, None]


def test_first_use_capture_takes_each_bucket_once_over_padding_rows():
    """A bucket captured at its first replay sees every static row on the scratch page, even
    where the last replay left a real request's rows; later replays reuse it."""
    kv = KVPool([KVBufferSpec("k", 1, (2, 8))], 10, PAGE, torch.float32, "cpu")
    model = SimpleNamespace(device=torch.device("cpu"), backend=get_backend("torch"))
    graphs = DecodeGraphs(model, kv, [1, 4], max_seq_len=12)
    graphs.capture_on_first_use()
    captured = []

    def capture_bucket(n, error_mode):
        static = graphs._batches[n] = graphs._static_batch(n)
        captured.append((n, error_mode, static.slot_mapping.tolist(), static.page_table.tolist()))
        graphs._graphs[n] = SimpleNamespace(replay=lambda: None)
        graphs._outputs[n] = torch.arange(n * 3).view(n, 3)

    graphs._capture_bucket = capture_bucket
    s = kv.scratch_page
    two = ForwardBatch.build([[7], [9]], [5, 2], [[3, 6], [8]], PAGE, "cpu")
    assert graphs.replay(two, 4).tolist() == [[0, 1, 2], [3, 4, 5]]
    assert graphs.slot_mapping[:2].tolist() == [6 * PAGE + 1, 8 * PAGE + 2]  # real rows left
    one = ForwardBatch.build([[5]], [9], [[2, 4, 1]], PAGE, "cpu")
    graphs.replay(one, 1)
    assert graphs.slot_mapping[:1].tolist() == [1 * PAGE + 1]  # the replay's own rows after
    graphs.replay(two, 4)
    assert captured == [
        (4, "thread_local", [s * PAGE] * 4, [[s] * 3] * 4),
        (1, "thread_local", [s * PAGE], [[s] * 3]),
    ]
    assert graphs.stats.captured_on_first_use == [4, 1]
    assert graphs.stats.to_json()["captured_on_first_use"] == [4, 1]
