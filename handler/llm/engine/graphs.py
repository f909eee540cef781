"""CUDA graphs of the decode step, one per batch-size bucket, sharing one memory pool.

Capture happens once per process (init or restore). A decode batch of `b` requests replays the
smallest bucket `>= b`: its inputs are copied into static buffers, padded rows point at the KV
pool's scratch page (they read and write nothing real), and the first `b` logits rows are
returned. A batch larger than the largest bucket, or one whose page table is wider than the
captured width, runs eagerly and counts as an eager fallback.

`capture` takes every bucket at once (the init: its eager runs fill the compile caches the
snapshot keeps). `capture_on_first_use` takes none: each bucket is captured by the first
replay that needs it (a tier-0 restore, whose caches compile nothing, leaves capture out of
its time to ready; that replay pays the bucket's capture, tens of ms on an 8B model). Before
such a capture every static row is made padding again, so its eager run and the captured one
touch only the scratch page whatever the last replay left there, and the capture runs in
thread-local mode, so another thread's CUDA calls (a metrics scrape) cannot break it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from snapfn.handler.llm.engine.batch import ForwardBatch
from snapfn.handler.llm.engine.copy_fence import CopyFence
from snapfn.handler.llm.engine.kv_pool import KVPool


def default_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, … up to `max_batch` (which is always included)."""
    buckets, b = [], 1
    while b < max_batch:
        buckets.append(b)
        b *= 2
    return buckets + [max_batch]


def decode_captures(model) -> bool:
    """Whether `model`'s decode step can be held in a CUDA graph: a dense model, or a MoE model
    whose backend's MoE and DSA indexer are sync-free (triton, flashinfer; not the reference).
    (Expert-parallel ranks exchanging tokens all-to-all cannot either: `Engine.capture_graphs`
    refuses them with the reason.)"""
    return model.config.arch == "llama" or model.backend.capturable_moe


@dataclass
class GraphStats:
    buckets: list[int] = field(default_factory=list)
    replays: int = 0
    prefill_replays: int = 0  # of them, steps that are not decode steps (a row a token)
    eager_fallbacks: int = 0
    capture_s: float = 0.0
    # captured by their first replay (`capture_on_first_use`), in that order; None: all at once
    captured_on_first_use: list[int] | None = None
    # speculative decoding's families (spec_graphs.py): each one's buckets, replays per use
    families: dict[str, list[int]] = field(default_factory=dict)
    replays_by_use: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        out = {
            "buckets": self.buckets,
            "replays": self.replays,
            "prefill_replays": self.prefill_replays,
            "eager_fallbacks": self.eager_fallbacks,
            "capture_s": round(self.capture_s, 3),
        }
        if self.captured_on_first_use is not None:
            out["captured_on_first_use"] = self.captured_on_first_use
        if self.families:
            out.update(families=self.families, replays_by_use=self.replays_by_use)
        return out


class DecodeGraphs:
    def __init__(
        self, model: torch.nn.Module, kv: KVPool, buckets: list[int], max_seq_len: int
    ) -> None:
        self.model = model
        self.kv = kv
        self.buckets = sorted(set(buckets))
        self.width = kv.pages_for(max_seq_len)  # page-table columns captured
        self.stats = GraphStats(buckets=self.buckets)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, Any] = {}  # each bucket's `_run` output, rewritten by replays
        self.pool = None  # the graphs' memory pool, once captured
        self._batches: dict[int, ForwardBatch] = {}  # each bucket's, over the static buffers
        self._alloc_static(max(self.buckets), model.device)

    def _alloc_static(self, n: int, device: torch.device) -> None:
        """The graphs' inputs, fixed in memory: int64 `input_ids | positions | slot_mapping`
        and int32 `seq_lens | page_table`, each group one device tensor filled by one copy
        per replay from a host mirror (pinned on CUDA) that the next batch is written into."""
        w = self.width
        pinned = device.type == "cuda"
        self._long = torch.zeros(3 * n, dtype=torch.int64, device=device)
        self._int = torch.zeros(n + n * w, dtype=torch.int32, device=device)
        self._host_long = torch.zeros(3 * n, dtype=torch.int64, pin_memory=pinned)
        self._host_int = torch.zeros(n + n * w, dtype=torch.int32, pin_memory=pinned)
        self._copied = CopyFence()  # the last copy out of the host mirror
        self.input_ids, self.positions, self.slot_mapping = self._long.split(n)
        self.seq_lens, table = self._int.split([n, n * w])
        self.page_table = table.view(n, w)
        self._host_table = self._host_int[n:].view(n, w)  # the static batches' page_table_cpu
        # NOTE: written through numpy views: a numpy slice assignment costs about a microsecond
        # of host time, a torch one several, and a decode step's host time adds to its latency
        ids, positions, slots = self._host_long.numpy().reshape(3, n)
        self._host_views = {
            "ids": ids,
            "positions": positions,
            "slots": slots,
            "seq_lens": self._host_int[:n].numpy(),
            "table": self._host_table.numpy(),
        }
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=device)
        self._reset_padding(0)
        self._upload()

    def _reset_padding(self, start: int) -> None:
        """Rows from `start` on become padding (in the host mirror): one token at slot 0 of the
        scratch page."""
        scratch, host = self.kv.scratch_page, self._host_views
        host["ids"][start:] = 0
        host["positions"][start:] = 0
        host["slots"][start:] = scratch * self.kv.page_size
        host["seq_lens"][start:] = 1
        host["table"][start:] = scratch

    def _host_seq_lens(self, n: int) -> tuple[int, ...]:
        return tuple(self._host_views["seq_lens"][:n].tolist())

    def _upload(self) -> None:
        self._long.copy_(self._host_long, non_blocking=True)
        self._int.copy_(self._host_int, non_blocking=True)
        self._copied.mark(self._long.device)

    def _static_batch(self, n: int) -> ForwardBatch:
        ones = torch.ones(n, dtype=torch.int32, device=self.input_ids.device)
        return ForwardBatch(
            input_ids=self.input_ids[:n],
            positions=self.positions[:n],
            seq_lens=self.seq_lens[:n],
            q_lens=ones,
            cu_q_lens=torch.arange(n + 1, dtype=torch.int32, device=ones.device),
            page_table=self.page_table[:n],
            slot_mapping=self.slot_mapping[:n],
            logits_indices=self.logits_indices[:n],
            page_size=self.kv.page_size,
            seq_lens_cpu=self._host_seq_lens(n),
            q_lens_cpu=(1,) * n,
            page_table_cpu=self._host_table[:n],
        )

    def capture(self, pool=None) -> None:
        """Capture every bucket, largest first, into one shared graph memory pool (`pool`: a
        MemPool id to capture into, e.g. one whose memory a process snapshot releases)."""
        start = time.perf_counter()
        self.pool = pool
        for n in sorted(self.buckets, reverse=True):
            self._capture_bucket(n, "global")
        torch.cuda.synchronize()
        self.stats.capture_s = time.perf_counter() - start

    def capture_on_first_use(self, pool=None) -> None:
        """Capture nothing now: each bucket when a replay first needs it, into `pool` (see the
        module docstring)."""
        self.pool = pool
        self.stats.captured_on_first_use = []

    def _capture_late(self, n: int) -> None:
        """Bucket `n`'s capture at its first replay, over static rows that are all padding."""
        start = time.perf_counter()
        self._copied.wait()
        self._reset_padding(0)
        self._upload()
        self._capture_bucket(n, "thread_local")
        self.stats.capture_s += time.perf_counter() - start
        self.stats.captured_on_first_use.append(n)

    def _capture_bucket(self, n: int, error_mode: str) -> None:
        """One warm-up run of bucket `n` outside a graph (allocator pools, lazy kernel loads),
        then its capture into `self.pool`."""
        batch = self._batches[n] = self._static_batch(n)
        self.model.backend.begin_forward(batch, graph=True)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._run(batch, n)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode=error_mode):
            self._outputs[n] = self._run(batch, n)
        self.pool = graph.pool()
        self._graphs[n] = graph

    def _run(self, batch: ForwardBatch, n: int) -> Any:
        """What bucket `n`'s graph holds: the model's decode step over `batch` (its logits)."""
        return self.model(batch, self.kv)

    def _rows(self, out: Any, b: int) -> Any:
        """A replay's result: the first `b` rows of a bucket's output (of each of its tensors,
        where `_run` returns several)."""
        return tuple(t[:b] for t in out) if isinstance(out, tuple) else out[:b]

    def captured(self, n: int) -> bool:
        """Whether bucket `n`'s graph is captured (a replay of one that is not captures it)."""
        return n in self._graphs

    def bucket_for(self, batch: ForwardBatch) -> int | None:
        """The bucket that can replay this batch, or None (then it runs eagerly)."""
        if not batch.is_decode or batch.page_table.shape[1] > self.width:
            return None
        return next((n for n in self.buckets if n >= batch.num_seqs), None)

    def replay(
        self, batch: ForwardBatch, n: int, input_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run decode `batch` (on the host or the device) through bucket `n`'s graph.
        `input_ids` (on the device) replaces the batch's: a step whose tokens the previous
        step produced is launched before the host has seen them."""
        if n not in self._graphs:
            self._capture_late(n)
        self._fill(batch, n, input_ids)
        self._graphs[n].replay()
        self.stats.replays += 1
        return self._rows(self._outputs[n], batch.num_seqs)

    def run_uncaptured(self, batch: ForwardBatch, n: int) -> torch.Tensor:
        """Run `batch` as bucket `n`'s graph would, eagerly, without capturing it: the same
        kernels over the same padded static inputs (the logits its replay would give), at an
        eager forward's host cost, where a capture would cost more than it saves."""
        self._fill(batch, n, None)
        return self._rows(self._run(self._batches[n], n), batch.num_seqs)

    def _fill(self, batch: ForwardBatch, n: int, input_ids: torch.Tensor | None) -> None:
        """Write `batch` into the static inputs (padding the rest of bucket `n`) and plan."""
        b, w = batch.num_seqs, batch.page_table.shape[1]
        self._copied.wait()  # the mirror's last copy must be done before it changes
        host = self._host_views
        host["ids"][:b] = _numpy(batch.input_ids)
        host["positions"][:b] = _numpy(batch.positions)
        host["slots"][:b] = _numpy(batch.slot_mapping)
        host["seq_lens"][:b] = _numpy(batch.seq_lens)
        table = batch.page_table_cpu if batch.page_table_cpu is not None else batch.page_table
        host["table"][:b, :w] = _numpy(table)
        host["table"][:b, w:] = self.kv.scratch_page
        self._reset_padding(b)
        self._upload()
        if input_ids is not None:
            self.input_ids[:b].copy_(input_ids)  # after the upload, in stream order
        static = self._batches.get(n)
        if static is None:  # a bucket run uncaptured (`run_uncaptured`) before its capture
            static = self._batches[n] = self._static_batch(n)
        static.seq_lens_cpu = self._host_seq_lens(n)
        # NOTE: after the inputs are in the static buffers and before the replay: the backend
        # plans from them (flashinfer's page metadata, from the host mirror), which a graph
        # cannot do
        self.model.backend.begin_forward(static, graph=True)


def _numpy(t: torch.Tensor):
    return (t if t.device.type == "cpu" else t.cpu()).numpy()
