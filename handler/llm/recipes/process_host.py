"""The built-in LLM as a process-snapshot host: what the checkpointed worker runs.

    init             cold init (weights and KV pool in releasable regions), the tier-0 files
                     written into the snapshot being built, a replay of a few greedy tokens
    before_snapshot  release the regions' physical memory, empty torch's CUDA cache
    after_restore    remap → stream weights from the snapshot's restore layout → replay check
                     (the same tokens and logprobs as recorded at init, through the captured
                     graphs, else fail closed) → start the engine loop
    handle           "generate" (streams outputs), "cancel", "info", "health"

Args (JSON, from `snapfn init --tier process`): {"model_dir", "init_config": {...}, "root"}.
The resume message carries {"snapshot_dir"}: where this restore reads the weights from.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

from snapfn.snapshot.cuda.stack_limit import StackLimit
from snapfn.snapshot.errors import RestoreFailed
from snapfn.snapshot.stages import StageRunner, StartupManifest

# prefill + 1 decode step: the eager path and a decode graph both exercised (each decode step
# more cost ~0.01 s of the 8B's restore on the H200; the count recorded is the count replayed)
REPLAY_TOKENS = 2
ADOPT_TIMEOUT_S = 60.0  # for the restorer's regions (it may still be filling them)


def log(line: str) -> None:
    print(f"[snapfn worker] {line}", file=sys.stderr, flush=True)


class FilesWriter:
    """The SnapshotWriterLike the function writes its tier-0 files through, in the worker; the
    owner process holds the real SnapshotWriter and registers what is recorded here."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.registered: list[list[Any]] = []

    def register_chunked(self, relpath, chunk_bytes, chunk_sha256, file_sha256) -> None:
        self.registered.append([relpath, chunk_bytes, list(chunk_sha256), file_sha256])


class LLMProcessHost:
    def __init__(self, args: dict[str, Any]) -> None:
        from snapfn.handler.llm.init_config import InitConfig

        self.args = args
        # NOTE: expandable segments let empty_cache() unmap the free pages of a segment that
        # still holds a live block: fewer bytes for the CUDA checkpoint to save
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        raw = dict(args["init_config"])
        overrides = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
        overrides["cache_dir"] = Path(raw["cache_dir"])
        self.config = InitConfig.from_env({}, **overrides)
        self.uses_cuda = self.config.device.startswith("cuda")
        self.fn = None
        self.service = None
        self.replay: dict[str, Any] = {}
        self.layout = None  # the restore layout's table (RestoreLayout), parsed once at init
        self.stack = StackLimit()  # lowered for the checkpoint, set back after each restore
        # NOTE: by default the streamer's pinned ring is pinned after each restore, on a side
        # thread: on the H200 that restored in 2.55 s, a ring kept in the image in 3.16 s
        self.keep_ring = os.environ.get("SNAPFN_PROCESS_KEEP_RING", "0") == "1"
        self.streamer = None  # with keep_ring: made at init, its ring rides in the image
        self.region_specs: list[dict[str, Any]] = []
        self.diag = os.environ.get("SNAPFN_PROCESS_DIAG", "0") == "1" and self.uses_cuda
        if self.diag:
            from snapfn.handler.llm.recipes.process_diag import start_recording

            start_recording()

    def init(self) -> dict[str, Any]:
        from snapfn.snapshot.layout.table import RestoreLayout
        from snapfn.snapshot.portable.compat import compat_key
        from snapfn.snapshot.runtime import cold_init

        self.fn = self.make_function()
        startup = cold_init(self.fn, self.log)
        self.replay = self.fn.generate_one(REPLAY_TOKENS, prefill_rows=True)
        writer = FilesWriter(Path(self.args["root"]))
        section, layout = self.write_files(writer, startup.to_json())
        self.layout = RestoreLayout.from_json(layout)
        if self.keep_ring:
            self.streamer = self._new_streamer(Path(self.args["root"]) / self.fn.weights_file)
        return {
            "function": self.fn.name,
            "startup": startup.to_json(),
            "section": section,
            "registered": writer.registered,
            "compat": compat_key(self.fn.device, self.fn.world_size),
            "replay": self.replay,
        }

    def make_function(self):
        from snapfn.handler.llm.recipes.function import LLMFunction

        return LLMFunction(self.config, Path(self.args["model_dir"]), releasable=True)

    def log(self, line: str) -> None:
        log(line)

    def write_files(self, writer: FilesWriter, startup: dict[str, Any]) -> tuple[dict, str]:
        """The tier-0 files through `writer`: (the manifest's section, this worker's layout)."""
        section = self.fn.write_snapshot(writer, startup)
        return section, section["layout"]

    def before_snapshot(self) -> list[str]:
        # NOTE: the KV pool's memory does not come back with the image: no page may stay named
        self.fn.engine.clear_prefix_cache()
        hooks = ["forget_prefix_cache", "release_weights_and_kv"]
        hooks += [] if self.keep_ring else ["drop_pinned_ring"]
        # what a restorer may make and fill
        self.region_specs = self.fn.memory.region_specs(self.fn.weights_file)
        released = self.fn.memory.release()
        if self.uses_cuda:
            import torch

            torch.cuda.synchronize()
            # NOTE: cuBLAS keeps a 32 MiB workspace per (thread's handle, stream): 9 of them,
            # 0.3 GB of the GPU state the CUDA checkpoint would copy into the image (census,
            # H200). Freed here, eager matmuls allocate them again; the one a graph captured
            # lives in the graph pool and stays valid (released and remapped like the rest).
            clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_workspaces is not None:
                clear_workspaces()
            torch.cuda.empty_cache()  # warmup's activations need not be in the image
            if not self.keep_ring:  # pinned blocks (the init's too) leave torch's host cache
                empty = getattr(torch._C, "_accelerator_emptyHostCache", None)
                (empty or torch._C._host_emptyCache)()
            stack = self.stack.lower()
            free, total = torch.cuda.mem_get_info()
            self.checkpoint_figures = {
                **stack,
                "device_in_use_bytes": total - free,
                "torch_reserved_bytes": torch.cuda.memory_reserved(),
                "torch_allocated_bytes": torch.cuda.memory_allocated(),
            }
            log(f"at checkpoint: {self.checkpoint_figures}")
            if self.diag:
                from snapfn.handler.llm.recipes.process_diag import report

                for line in report():
                    log(line)
        log(f"released {sum(released.values()) / 1e9:.2f} GB: {released}")
        return hooks

    def after_restore(self, resume: dict[str, Any]) -> dict[str, Any]:
        runner = StageRunner(StartupManifest(kind="restore", tier="process"), clock=time.time)
        t0 = time.time()
        if self.uses_cuda:  # NOTE: the first driver call waits for the CUDA restore to finish
            runner.run("cuda_ready", lambda f: self.stack.restore())  # before any kernel runs
        self.restored_stages(runner, resume)
        if not (resume.get("regions") and runner.run("adopt", lambda f: self._adopt(f, resume))):
            self._remap_and_stream(runner, Path(resume["snapshot_dir"]) / self.fn.weights_file)
        runner.run("replay_check", self._replay_check)
        if self.fn.warm_prompts:  # emptied before the checkpoint: its prompts warmed again
            from snapfn.handler.llm.recipes.prefix_warm import warm_prefixes

            prompts = self.fn.warm_prompts
            runner.run("prefix_warm", lambda f: f.update(warm_prefixes(self.fn.engine, prompts)))
        self.start_serving()
        return {"t0": t0, "stages": [dataclasses.asdict(s) for s in runner.manifest.stages]}

    def restored_stages(self, runner: StageRunner, resume: dict[str, Any]) -> None:
        """Stages of a restore before the weights come back (a rank of several: its
        communicators); none here."""

    def start_serving(self) -> None:
        from snapfn.handler.llm.service import LLMService

        self.service = LLMService(self.fn.engine)

    def _remap_and_stream(self, runner: StageRunner, weights: Path) -> None:
        """Without the restorer's regions: map fresh memory at the regions' addresses and stream
        the weights in. NOTE: two side threads, pinning a fresh host ring (when the image holds
        none) and mapping + zeroing the KV pool (0.4 s for 110 GB on the H200), run while the
        weights stream; the replay check needs both. The KV pool's 110 GB are made only once
        the weights' region, needed first, is mapped."""
        from concurrent.futures import ThreadPoolExecutor

        memory = self.fn.memory
        pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="snapfn-resume")
        ring = None if self.keep_ring else pool.submit(self._new_streamer, weights)
        runner.run("remap", lambda f: memory.remap_weights())
        kv = pool.submit(memory.remap_kv)
        pool.shutdown(wait=False)
        runner.run("stream_weights", lambda f: self._stream(f, weights, ring))
        runner.run("remap_kv", lambda f: f.update(overlapped_s=round(kv.result(), 4)))

    def _adopt(self, figures: dict[str, Any], resume: dict[str, Any]) -> bool:
        """Map the regions the restorer made and filled (snapshot/keeper/region_prefetch.py), then
        check the weights on the GPU against the layout's sum64 table. False, with the reason
        in the figures, when anything is off: the caller then remaps and streams itself (over
        the adopted memory when only the weights' check failed)."""
        from snapfn.snapshot.keeper.region_prefetch import take_regions
        from snapfn.snapshot.layout.checksum import first_bad_chunk

        if not take_regions(resume["regions"], ADOPT_TIMEOUT_S, self.fn.memory.adopt, figures):
            return False
        start, layout = time.perf_counter(), self.layout
        if layout.chunk_sum64 is None:
            figures["fallback"] = "the restore layout has no sum64 table to check the weights with"
            return False
        data = self.fn.memory.weights.base[: layout.file_bytes]
        bad = first_bad_chunk(data, layout.chunk_bytes, layout.chunk_sum64)
        figures["verify_s"] = round(time.perf_counter() - start, 4)
        if bad is not None:
            figures["fallback"] = f"weights chunk {bad} failed its sum64 check"
            return False
        return True

    def _new_streamer(self, path: Path):
        from snapfn.snapshot.layout.streamer import WeightStreamer

        c = self.config
        streamer = WeightStreamer(
            path,
            self.layout,
            device=c.device,
            num_threads=c.stream_threads,
            ring_slots=c.stream_ring_slots,
            # NOTE: the ring may ride in the process image through the CUDA checkpoint, which
            # has restored torch's pinned allocations; registered host memory is untried there
            ring_pinning="alloc",
        )
        streamer.prepare()
        return streamer

    def _stream(self, figures: dict[str, Any], path: Path, ring) -> None:
        """`ring`: a future of a fresh streamer (its ring pinning on a side thread), or None
        to reuse the one whose ring rode in the image."""
        from snapfn.handler.llm.recipes.snapshot_files import report_fields

        if ring is not None:
            self.streamer = None
            start = time.perf_counter()
            self.streamer = ring.result()
            figures["ring_wait_s"] = round(time.perf_counter() - start, 4)
        else:
            self.streamer.retarget(path)
        report = self.streamer.stream_into(dict(self.fn.model.named_parameters()))
        figures.update(report_fields(report), kept_ring=ring is None)

    def _replay_check(self, figures: dict[str, Any]) -> None:
        got = self.fn.generate_one(len(self.replay["tokens"]), prefill_rows=True)
        figures.update(tokens=got["tokens"], recorded=self.replay["tokens"])
        stats = self.fn.engine.prefix_cache_stats()  # emptied before the checkpoint
        figures["prefix_cache_pages"] = stats["cached_pages"] if stats is not None else "off"
        if got["tokens"] != self.replay["tokens"] or got["logprobs"] != self.replay["logprobs"]:
            raise RestoreFailed(
                f"replay check failed: restored worker answered {got['tokens']} "
                f"(logprobs {got['logprobs']}), init recorded {self.replay['tokens']} "
                f"(logprobs {self.replay['logprobs']})"
            )

    # ---- serving -------------------------------------------------------------------------------
    def handle(self, message: dict[str, Any], send) -> None:
        op, rid = message["op"], message.get("id")
        if op == "generate":
            self._generate(message, send)
        elif op == "cancel":
            self.service.cancel(message["request_id"])
        elif op == "info":
            send({"id": rid, "event": "result", **self.info()})
        else:
            raise ValueError(f"unknown op {op!r}")

    def info(self) -> dict[str, Any]:
        return {
            "max_req_input_len": self.service.max_req_input_len,
            "kv_usage": self.service.kv_usage(),
            "prefix_cache": self.service.prefix_cache_stats(),
            "speculative": self.service.spec_stats(),
            "preemptions": self.service.preemptions(),
            "stats": dataclasses.asdict(self.service.stats),
        }

    def _generate(self, message: dict[str, Any], send) -> None:
        from snapfn.handler.llm.engine.request import SamplingParams

        params = SamplingParams.from_json(message["params"])
        stream = self.service.submit(list(message["prompt_ids"]), params)
        rid = message["id"]
        send({"id": rid, "event": "accepted", "request_id": stream.request_id})
        for out in stream:
            send(
                {
                    "id": rid,
                    "event": "output",
                    "tokens": list(out.new_token_ids),
                    "logprobs": list(out.new_logprobs),
                    "text": out.text_delta,
                    "finished": out.finished,
                    "reason": out.finish_reason,
                    "top": [list(map(list, top)) for top in out.new_top_logprobs],
                    "prompt_logprobs": list(out.prompt_logprobs),
                    "prompt_top": [
                        None if top is None else list(map(list, top))
                        for top in out.prompt_top_logprobs
                    ],
                }
            )

    def close(self) -> None:
        if self.service is not None:
            self.service.close()


def make(args: dict[str, Any]) -> LLMProcessHost:
    return LLMProcessHost(args)
