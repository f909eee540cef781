"""The built-in LLM function: its init recipe, its tier-0 snapshot, and its restore recipe.

Cold init (each a timed stage):
    runtime_env → prewarm → load_weights → [verify_source] → memory_profile → kv_pool → warmup
    → capture_graphs → tokenizer → grammars → health_check
(`verify_source` when the source is one a refused snapshot recorded, not one the user named:
the loaded model's content hash must be the one the snapshot recorded — sources.py.)
Restore from a portable snapshot (the runtime runs `prepare_runtime` and validates first):
    runtime_env → [validate] → restore_caches → build_model → kv_pool → start_stream → warmup
    → stream_weights (the wait) → capture_graphs → tokenizer → grammars → health_check
    (+ replay check against the token recorded at init)
the pool made and warmed while the weights stream on a side thread (`InitConfig.restore_overlap`,
on by default). In turn with SNAPFN_RESTORE_OVERLAP=0, and always for several ranks, a snapshot
whose caches were dropped (its plan is measured again) or a process snapshot's regions:
    … → build_model → stream_weights → kv_pool → warmup → capture_graphs → …
CUDA's context is made on a side thread from runtime_env on (snapshot/cuda/early_context.py);
the stage before the first CUDA call waits for it (`_cuda_ready`: the cold init's
load_weights, the restore's restore_caches).
`grammars` compiles the structured-output specs configured (`InitConfig.structured_schemas`)
at init, and those the snapshot recorded at restore (llguidance keeps no compiled form to
carry), so a configured schema's first request compiles nothing.
The validate stage ends with `check_manifest`: every field of the "llm" section the restore
reads is checked before use (section.py); `build_model` checks it against the model too.

Snapshot contents (under the snapshot directory):
    weights/rank0.bin   restore layout: every parameter in its final dtype/layout, 2 MiB aligned
    weights/rankK.bin   rank K's, for a snapshot of several tensor/expert-parallel ranks
    model/              config.json, generation_config.json, tokenizer files
    caches/<name>/      compile caches used at init (triton, inductor, flashinfer, deepgemm)
and the "llm" section of manifest.json (memory plan, buckets, tensor table, health record,
the configured grammars' specs).

Several ranks (`parallel.tp_size * ep_size > 1`, every rank an `LLMFunction` in its own
process, `handler/llm/ranks.py`): rank 0 writes the snapshot; every rank writes its own weights
file into rank 0's staging folder (its path broadcast) and sends rank 0 its layout and memory
plan, which the section lists under "ranks" beside "parallel" (`section.py`). At restore every
rank streams its own file; rank 0 alone restores the compile caches (one folder on the machine).
A rank whose restore fails before the collective stages (validation, its weights) tells the
others at `ranks_agree` (or, failing before it, in `join_failed_restore`), and every rank falls
back together.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import replace
from pathlib import Path
from typing import Any

from snapfn.handler.llm.init_config import InitConfig
from snapfn.handler.llm.recipes.section import (
    CheckedSection,
    check_against_model,
    check_config_against_layout,
    check_section,
)
from snapfn.handler.llm.recipes.snapshot_files import (
    config_json,
    copy_model_files,
    loaded_content_hash,
    model_content_hash,
    report_fields,
)
from snapfn.snapshot.errors import RestoreFailed
from snapfn.snapshot.function import Figures, SnapshotWriterLike, Stage
from snapfn.snapshot.imports import import_for_startup
from snapfn.snapshot.portable import compile_caches, triton_key

WEIGHTS_FILE = "weights/rank0.bin"
# how far a restore's replay logprob may move when its caches were dropped (another GPU, driver
# or library: other kernels, another summation order; bf16 moves logprobs by ~1e-3 that way)
REPLAY_LOGPROB_TOLERANCE = 0.05
# Modules a zygote imports before forking restore workers (none of them touches CUDA at import),
# and `module:function` calls it makes after them (fork_safety.preload)
ZYGOTE_PRELOAD = (
    "torch",
    "safetensors",
    "jinja2",
    "tokenizers",
    "snapfn.snapshot.runtime",
    "snapfn.snapshot.layout.writer",
    "snapfn.snapshot.layout.streamer",
    "snapfn.snapshot.portable.pagecache",
    "snapfn.handler.llm.recipes.function",
    "snapfn.handler.llm.build",
    "snapfn.handler.llm.engine.memory",
    "snapfn.handler.llm.engine.warmup",
    "snapfn.handler.llm.engine.engine",
    "snapfn.handler.llm.models.llama",
    "snapfn.handler.llm.models.glm_moe_dsa",
    "snapfn.handler.llm.kernels.torch_ref",
    # a tier-1 restore's own side (criu, the CUDA restore, the keeper's client): 0.05-0.08 s of
    # imports between a fresh process's start and its restore's (2026-12-02, H200)
    "snapfn.handler.llm.recipes.process_restore",
    "snapfn.handler.llm.recipes.process_service",
    "snapfn.snapshot.process.snapshot",
    "snapfn.snapshot.process.client",
    "snapfn.snapshot.keeper.region_prefetch",
    "snapfn.snapshot.cuda.checkpoint",
    # what its validation imports: 9 ms on the CPU machine (validate 0.077 s from a zygote's
    # child with the keeper, 2026-12-07, H100)
    "snapfn.snapshot.keeper.verified_images",
    "snapfn.snapshot.process.criu_image",
    "snapfn.snapshot.process.image_memory",
    "snapfn.snapshot.process.code_identity:code_fingerprint",  # what a tier-1 restore checks
    "snapfn.handler.llm.kernels.triton.warm:warm_compiler",  # Triton's compiler, where installed
)


SHORT_PREFILLS = (8, 48)  # prompt lengths warmed besides the chunk sizes (CUDA only)


class LLMFunction:
    """Holds the engine once up. Build with a model folder (init) and/or a snapshot (restore)."""

    name = "llm"

    def __init__(
        self,
        config: InitConfig,
        model_dir: Path | None = None,
        releasable: bool = False,
        expected_content_hash: str | None = None,
        parallel=None,
        kernel_tuning=None,
    ) -> None:
        """`releasable`: weights and KV pool in releasable regions (for a process snapshot).
        `expected_content_hash`: the cold init verifies that `model_dir` loads as this model
        (a source recorded by a snapshot, not named by the user) before going on.
        `kernel_tuning`: a `tuning.KernelTuning` (default: SNAPFN_KERNEL_TUNING's)."""
        from snapfn.handler.llm.parallel import ParallelConfig

        self.config = config
        self.kernel_tuning = kernel_tuning
        self.parallel = parallel or ParallelConfig(ep_dispatch=config.ep_dispatch)
        self.world_size = self.parallel.tp_size * self.parallel.ep_size  # the compat key's
        self.rank = self.parallel.ep_rank * self.parallel.tp_size + self.parallel.tp_rank
        self.weights_file = f"weights/rank{self.rank}.bin"
        self._agreed = False  # this restore's ranks_agree ran (several ranks)
        self.device = config.device
        self.source = Path(model_dir) if model_dir is not None else None
        self.expected_content_hash = expected_content_hash
        self.source_trusted = expected_content_hash is None  # the runtime reads it (fallback)
        self.cache_drift: str | None = None  # set by the runtime's validate (snapshot/function.py)
        self.arriving = None  # set by the runtime: the snapshot is still being pulled (runtime.py)
        self._checked: CheckedSection | None = None
        self._recorded_source: dict[str, Any] = {}
        self.engine = None
        self.model = None
        self.plan = None
        self.graph_stats = None
        self.health: dict[str, Any] = {}
        self._model_config = None
        self._load_report = None
        self._streamer = None
        self._stream_job = None  # an overlapped restore's stream (stage_start_stream)
        self._switch_interval: float | None = None  # Python's, while that stream runs
        self._ring_wait_s = 0.0  # how long the stream waited for its host ring's pinning
        self.warm_prompts: list[str] = []  # prefilled into the prefix cache (prefix_warm.py)
        self._tokenizer = None  # [the tokenizer or None], loaded ahead by restore_caches
        self._compiler_warm = None  # Triton's start-up work, on a side thread (runtime_env)
        self._cuda = None  # CUDA's init begun in runtime_env, finished before the first CUDA call
        self._checkpoint = None
        self.grammar_specs: list = []  # structured-output specs compiled at start-up
        self.memory = None
        if releasable:
            from snapfn.handler.llm.recipes.releasable import ReleasableMemory

            self.memory = ReleasableMemory(config.device)

    # ---- cold init -------------------------------------------------------------------------
    def init_stages(self) -> list[Stage]:
        if self.source is None:
            raise ValueError("a cold init needs a model folder")
        verify = [("verify_source", self.stage_verify_source)] if self.expected_content_hash else []
        return [
            ("runtime_env", self.stage_runtime_env),
            ("prewarm", self.stage_prewarm),
            ("load_weights", self.stage_load_weights),
            *verify,
            ("memory_profile", self.stage_memory_profile),
            ("kv_pool", self.stage_kv_pool),
            ("warmup", self.stage_warmup),
            ("capture_graphs", self.stage_capture_graphs),
            ("tokenizer", lambda f: self.stage_tokenizer(f, self.source)),
            ("grammars", self.stage_grammars),
            *self._warm_stage(None),
            ("health_check", self.stage_health_check),
        ]

    def stage_runtime_env(self, figures: Figures) -> None:
        # NOTE: first: the compile caches' variables are set before torch is imported (the
        # tuning module's package imports it). CUDA's context is made on a side thread from
        # here on (snapshot/cuda/early_context.py); `_cuda_ready` waits for it before the
        # first stage that calls CUDA.
        # Triton's own hash begins beside torch's import (snapshot/portable/triton_key.py)
        key_started = []
        cuda = self.device.startswith("cuda")
        done, self._cuda = compile_caches.prepare_deferred(
            self.config.cache_dir,
            self.device,
            before_torch=(lambda: key_started.append(triton_key.start())) if cuda else None,
        )
        figures.update(done)
        from snapfn.handler.llm.kernels.triton.tuning import KernelTuning, use_tuning

        tuning = self.kernel_tuning or KernelTuning.from_env(os.environ)
        use_tuning(tuning)
        figures["kernel_tuning"] = tuning.mode
        if cuda:  # joined by the warmup
            from snapfn.handler.llm.kernels.triton.warm import warm_compiler

            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapfn-warm")
            self._compiler_warm = pool.submit(warm_compiler, key_started=key_started[0])
            pool.shutdown(wait=False)
        # the modules the stages after this one run on, with the collector paused (torch's
        # import above froze what existed then: `snapshot/imports.py`); a zygote's child has
        # them already
        figures["imports_s"] = round(import_for_startup(ZYGOTE_PRELOAD), 3)

    def gpu_fields(self, index: int) -> dict[str, Any] | None:
        """The compat key's GPU fields as CUDA's init (still under way) read them, for the
        validate stage (snapshot/function.py); None once it is done, or where it could not."""
        return self._cuda.early.gpu_fields(index) if self._cuda is not None else None

    def _cuda_ready(self, figures: Figures) -> None:
        """CUDA's init, begun in runtime_env, finished (its figures in this stage's)."""
        if self._cuda is not None:
            pending, self._cuda = self._cuda, None
            figures.update(pending.finish())

    def stage_prewarm(self, figures: Figures) -> None:
        from snapfn.handler.llm.weights.checkpoint import Checkpoint
        from snapfn.snapshot.portable.pagecache import prewarm

        self._checkpoint = Checkpoint.open(self.source)  # index + shard headers, read once
        report = prewarm(self._checkpoint.files, num_threads=self.config.prewarm_threads)
        figures.update(report_fields(report))

    def stage_load_weights(self, figures: Figures) -> None:
        from snapfn.handler.llm.build import as_held, build_model
        from snapfn.handler.llm.config import ModelConfig
        from snapfn.handler.llm.weights.loader import load_weights

        self._cuda_ready(figures)
        declared = ModelConfig.from_dir(self.source)
        self._model_config = as_held(declared, self._checkpoint.tensors)
        if self._model_config.num_mtp_layers < declared.num_mtp_layers:
            figures["mtp_layers"] = (
                f"{declared.num_mtp_layers} declared, {self._model_config.num_mtp_layers} in the "
                "checkpoint"
            )
        self.model = build_model(
            self._model_config, self.config.engine_options(parallel=self.parallel)
        )
        self._adopt_parameters(figures)
        report = load_weights(self.model, self._checkpoint)
        self._load_report = report
        figures.update(
            bytes=report.num_bytes,
            tensors=report.num_tensors,
            gb_per_s=round(report.gb_per_s, 3),
            not_loaded=len(report.not_loaded),
        )

    def stage_verify_source(self, figures: Figures) -> None:
        """The model loaded from a recorded source is the one the snapshot recorded."""
        from snapfn.snapshot.runtime import NoTrustedSource

        got = loaded_content_hash(self._model_config.raw, self.model.named_parameters())
        figures.update(content_hash=got, expected=self.expected_content_hash)
        problem = ""
        if got != self.expected_content_hash:
            problem = (
                f"it holds another model (content hash {got[:16]}.., the snapshot recorded "
                f"{self.expected_content_hash[:16]}..; or this configuration loads it with "
                "another dtype)"
            )
        if self.world_size > 1:  # one rank's answer is every rank's
            from snapfn.handler.llm.recipes.sources import first_rank_problem

            problem = first_rank_problem(problem, self.parallel)
        if problem:
            raise NoTrustedSource(problem)
        self.source_trusted = True

    def stage_memory_profile(self, figures: Figures) -> None:
        from snapfn.handler.llm.engine.memory import profile_memory

        c = self.config
        # NOTE: the profile's forward is the first of a cold init: most kernels JIT-compile
        # here (flashinfer's prefill: 104 s of the 8B's cold init on the H200, commit d1f6db7)
        with compile_caches.compiles_counted(c.cache_dir, figures):
            self.plan = profile_memory(
                self.model,
                c.page_size,
                c.max_num_batched_tokens,
                c.mem_fraction_static,
                c.kv_cache_bytes_cpu,
            )
        if self.parallel.tp_size * self.parallel.ep_size > 1:
            # every rank's pool holds the same pages: the least any rank has room for
            from snapfn.handler.llm.models.tensor_parallel import min_over_ranks

            here = self.plan.num_pages
            self.plan = replace(self.plan, num_pages=min_over_ranks(here, self.parallel))
            figures["num_pages_here"] = here
        figures.update(self.plan.to_json())

    def stage_kv_pool(self, figures: Figures) -> None:
        from snapfn.handler.llm.build import allocate_kv
        from snapfn.handler.llm.engine.engine import Engine

        pages, page_size = self.plan.num_pages, self.plan.page_size
        alloc = None
        if self.memory is not None:
            from snapfn.handler.llm.recipes.releasable import kv_region_bytes

            alloc = self.memory.kv_alloc(kv_region_bytes(self.model, pages, page_size))
        kv = allocate_kv(self.model, pages, page_size, alloc)
        self.engine = Engine(self.model, kv, self.config.engine_options().scheduler)
        figures.update(pages=kv.num_pages, bytes=kv.num_bytes, capacity_tokens=kv.capacity_tokens)
        figures["backend"] = self.model.backend.name  # the kernels the engine runs (auto's pick)
        stats = self.engine.prefix_cache_stats()  # a restore's starts empty: KV is not carried
        figures["prefix_cache_pages"] = stats["cached_pages"] if stats is not None else "off"

    def buckets(self) -> list[int]:
        from snapfn.handler.llm.engine.graphs import default_buckets

        most = self.config.max_running_requests
        return default_buckets(
            min(self.config.graph_max_batch, most) if self.config.graph_max_batch > 0 else most
        )

    def uses_graphs(self) -> bool:
        """Decode runs in CUDA graphs: on CUDA, for dense models, and for MoE models where the
        backend's MoE and DSA indexer are sync-free (triton, flashinfer; not the reference).
        With speculative decoding, the verify and draft steps' graphs (`spec_graphs.py`)."""
        if not self.device.startswith("cuda") or self.config.graph_max_batch < 1:
            return False
        from snapfn.handler.llm.engine.graphs import decode_captures

        return decode_captures(self.model)

    def stage_warmup(self, figures: Figures) -> None:
        from snapfn.handler.llm.engine.warmup import warmup

        if self.device.startswith("cuda"):
            # NOTE: graph capture runs every decode bucket twice before capturing it; warming
            # the decode shapes here as well would only repeat that work. Short prefills run
            # kernel variants no chunk-sized one does: the FP8 GEMM's two row tiles (up to 16
            # and up to 64 rows) on weights only prefill multiplies (MLA's kv_b expansion).
            decode = [] if self.uses_graphs() else self.buckets()
            chunks = tuple(dict.fromkeys((*self.config.chunk_sizes, *SHORT_PREFILLS)))
        else:  # the CPU path compiles nothing: touch each code path once, cheaply
            decode, chunks = [1], (min(16, self.config.max_num_batched_tokens),)
        if self._compiler_warm is not None:
            figures["compiler_warm"] = _joined(self._compiler_warm)
            self._compiler_warm = None
        if self.world_size > 1:  # every communicator made and run before graphs capture them
            from snapfn.handler.llm.models.tensor_parallel import warm_collectives

            figures["collectives"] = warm_collectives(self.model, max(self.buckets()))
        with compile_caches.compiles_counted(self.config.cache_dir, figures):
            figures.update(warmup(self.model, self.engine.kv, decode, chunks))
            if self.device.startswith(
                "cuda"
            ):  # a restore's weight checks run it: not compiled there
                from snapfn.snapshot.layout.checksum import warm_kernel

                figures["sum64_kernel"] = warm_kernel(self.device)

    def stage_capture_graphs(self, figures: Figures, restoring: bool = False) -> None:
        if self.config.speculative_tokens > 0:
            figures["speculative_tokens"] = self.config.speculative_tokens
        if self.uses_graphs():
            pool = self.memory.graph_pool() if self.memory is not None else None
            # decode kernels JIT-compile in the run before each capture: a restore must add none
            # a tier-0 restore's caches compile nothing: its decode graphs can wait for their
            # first decode steps (InitConfig.restore_graphs_on_first_use). Not speculation's
            # families, nor several ranks' (whose captures hold collectives): all at once.
            late = (
                restoring
                and self.config.restore_graphs_on_first_use
                and self.config.speculative_tokens == 0
                and self.world_size == 1
            )
            with compile_caches.compiles_counted(self.config.cache_dir, figures):
                max_seq_len = self.config.graph_max_seq_len
                stats = self.engine.capture_graphs(self.buckets(), max_seq_len, pool, late)
            self.graph_stats = stats
            figures.update(buckets=stats.buckets, seconds_capture=round(stats.capture_s, 3))
            if late:
                figures["captured"] = "each bucket at its first decode step"
            if stats.families:  # speculative decoding's: each family's row buckets and count
                figures["families"] = stats.families
                figures["graphs"] = sum(len(b) for b in stats.families.values())
        elif self.device.startswith("cuda") and self.config.graph_max_batch < 1:
            figures["skipped"] = "graph_max_batch=0: decode runs eagerly"
        elif self.device.startswith("cuda"):
            figures["skipped"] = (
                f"{self._model_config.arch}: decode runs eagerly (backend "
                f"{self.model.backend.name}'s MoE syncs the host)"
            )
        else:
            figures["skipped"] = "no CUDA device: decode runs eagerly"

    def stage_tokenizer(self, figures: Figures, folder: Path) -> None:
        from snapfn.handler.llm.tokenizer import load_tokenizer, stop_token_ids

        loaded, self._tokenizer = self._tokenizer, None
        tokenizer = loaded[0] if loaded is not None else load_tokenizer(folder)
        self.engine.attach_tokenizer(tokenizer, stop_token_ids(folder, tokenizer))
        figures.update(
            present=tokenizer is not None, vocab=tokenizer.vocab_size if tokenizer else 0
        )

    def stage_grammars(self, figures: Figures, recorded: list | None = None) -> None:
        """Structured output's compile cache, the configured specs (at restore: the `recorded`
        ones) compiled into it."""
        from snapfn.handler.llm.structured.compiler import GrammarCache
        from snapfn.handler.llm.structured.configured import read_configured_specs
        from snapfn.snapshot.errors import BadRequest, InitFailed

        if self.engine.tokenizer is None:
            figures["skipped"] = "no tokenizer: structured output is refused"
            return
        specs = recorded
        if specs is None and self.config.structured_schemas is not None:
            specs = read_configured_specs(self.config.structured_schemas)
        vocab = self._model_config.vocab_size
        cache = GrammarCache(self.engine.tokenizer, vocab, self.engine.eos_token_ids)
        try:
            if specs:  # NOTE: else nothing here: the first structured request builds the rest
                figures.update(cache.prepare())
            figures.update(cache.preload(specs or []))
        except BadRequest as exc:
            if recorded is None:
                raise InitFailed(
                    f"structured_schemas {self.config.structured_schemas}: {exc}"
                ) from None
            raise RestoreFailed(f"the snapshot's grammars: {exc}") from None
        self.grammar_specs = list(specs or [])
        self.engine.attach_grammars(cache)
        if specs and self.device.startswith("cuda"):
            figures["warmed_s"] = cache.warm_device_picks(specs[0], self.engine.model.device)

    def _warm_stage(self, recorded: list[str] | None) -> list[Stage]:
        """The `prefix_warm` stage where there are prompts to warm: at init the configured
        file's (`InitConfig.prefix_warm`), at restore the snapshot's (`recorded`)."""
        if not (recorded if recorded is not None else self.config.prefix_warm):
            return []
        return [("prefix_warm", lambda f: self.stage_prefix_warm(f, recorded))]

    def stage_prefix_warm(self, figures: Figures, recorded: list[str] | None) -> None:
        from snapfn.handler.llm.recipes.prefix_warm import read_warm_prompts, warm_prefixes

        prompts = recorded if recorded is not None else read_warm_prompts(self.config.prefix_warm)
        figures.update(warm_prefixes(self.engine, prompts))
        self.warm_prompts = list(prompts)

    def stage_health_check(self, figures: Figures) -> None:
        self.health = self.generate_one()
        figures.update(self.health)
        _count_kernel_choices(figures)

    def generate_one(self, max_new_tokens: int = 1, prefill_rows: bool = False) -> dict[str, Any]:
        """One real greedy generation through the whole path (decode graphs when > 1 token).
        Its prompt is prefilled eagerly unless `prefill_rows`, whatever graphs are captured (a
        short prefill replays a captured bucket a row a token, engine.py: another summation
        order), so that a tier-0 restore replays the init's record exactly: its decode graphs
        may not be captured yet. A process image holds the init's graphs: its replay check may."""
        from snapfn.handler.llm.engine.request import SamplingParams

        tok = self.engine.tokenizer
        prompt = tok.encode("Hello") if tok is not None else [0]
        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        with self.engine.prefills_as_rows(prefill_rows):
            (result,) = self.engine.generate([prompt or [0]], params)
        record = {
            "prompt_ids": list(prompt or [0]),
            "token": result.token_ids[0],
            "logprob": result.logprobs[0],
        }
        if max_new_tokens > 1:
            record.update(tokens=list(result.token_ids), logprobs=list(result.logprobs))
        return record

    # ---- snapshot ------------------------------------------------------------------------------
    def write_snapshot(self, writer: SnapshotWriterLike, startup: dict[str, Any]) -> dict[str, Any]:
        from snapfn.snapshot.layout.writer import write_restore_layout

        root = Path(writer.root)
        (root / "weights").mkdir(parents=True, exist_ok=True)
        layout = write_restore_layout(root / WEIGHTS_FILE, self.model.named_parameters())
        writer.register_chunked(
            WEIGHTS_FILE, layout.chunk_bytes, layout.chunk_sha256, layout.file_sha256
        )
        ranks = self._write_ranks(root, layout) if self.world_size > 1 else None
        for k, entry in enumerate(ranks or []):
            file = entry.pop("file")  # rank 0's is registered above
            if k:
                writer.register_chunked(f"weights/rank{k}.bin", *file)
        folder = self.source if self.source is not None else self._restored_from / "model"
        copy_model_files(folder, root / "model")
        caches = compile_caches.save_caches(self.config.cache_dir, root / "caches")
        return {
            "model_content_hash": model_content_hash(self._model_config.raw, layout),
            **self._source_fields(),
            "model_type": self._model_config.model_type,
            "init_config": config_json(self.config),
            "memory_plan": self.plan.to_json(),
            "graph_buckets": self.graph_stats.buckets if self.graph_stats else [],
            "layout": layout.to_json(),
            "health": self.health,
            "compile_caches": caches,
            "grammars": [spec.to_json() for spec in self.grammar_specs],
            **({"prefix_warm": self.warm_prompts} if self.warm_prompts else {}),
            **_kernel_choices(),
            **({"parallel": self._parallel_json(), "ranks": ranks} if ranks else {}),
        }

    def write_rank_files(self) -> list[dict[str, Any]]:
        """Another rank's part of rank 0's `write_snapshot`: its weights file, written into the
        staging folder rank 0 names; every rank's entry (`_write_ranks`)."""
        return self._write_ranks(None, None)

    def _write_ranks(self, root: Path | None, layout: Any) -> list[dict[str, Any]]:
        """Every rank's weights file under rank 0's `root` (rank 0 passes its own `layout`, the
        others None and write theirs); on every rank, each rank's {"layout", "memory_plan",
        "file": (chunk_bytes, chunk_sha256, file_sha256)} in rank order."""
        import json

        from snapfn.handler.llm.models.tensor_parallel import all_gather_texts
        from snapfn.snapshot.layout.writer import write_restore_layout

        root = Path(all_gather_texts(str(root or ""), self.parallel)[0])
        if layout is None:
            layout = write_restore_layout(root / self.weights_file, self.model.named_parameters())
        mine = {
            "model_content_hash": model_content_hash(self._model_config.raw, layout),
            "layout": layout.to_json(),
            "memory_plan": self.plan.to_json(),
            "file": [layout.chunk_bytes, layout.chunk_sha256, layout.file_sha256],
        }
        return [json.loads(t) for t in all_gather_texts(json.dumps(mine), self.parallel)]

    def _parallel_json(self) -> dict[str, Any]:
        p = self.parallel
        return {"tp_size": p.tp_size, "ep_size": p.ep_size, "ep_dispatch": p.ep_dispatch}

    def _source_fields(self) -> dict[str, Any]:
        """Where this model came from, for a fallback to verify by content hash: the folder of a
        cold init (and whether it is the embedded model), else what the restored snapshot said."""
        if self.source is None:
            return {"source_model_dir": None, "source_embedded": False, **self._recorded_source}
        from snapfn.handler.llm.embedded import embedded_model_dir

        embedded = self.source.resolve() == embedded_model_dir().resolve()
        return {"source_model_dir": str(self.source.absolute()), "source_embedded": embedded}

    # ---- restore -------------------------------------------------------------------------------
    def check_manifest(self, snapshot_dir: Path, manifest: dict[str, Any]) -> None:
        """The validate stage's last check: the "llm" section's fields (section.py), this
        rank's where there are several."""
        self._checked = check_section(
            manifest["llm"], manifest["files"], self.config, self.rank, self._parallel_json()
        )

    def restore_stages(self, snapshot_dir: Path, manifest: dict[str, Any]) -> list[Stage]:
        if self._checked is None:
            self.check_manifest(snapshot_dir, manifest)
        section = manifest["llm"]
        self._restored_from = Path(snapshot_dir)
        self._recorded_source = {
            k: section[k] for k in ("source_model_dir", "source_embedded") if k in section
        }
        agree = [("ranks_agree", self.stage_ranks_agree)] if self.world_size > 1 else []
        kv_pool = ("kv_pool", lambda f: self.stage_plan_kv(f, section))
        if self._overlaps_stream():  # the weights stream while the pool is made and warmed
            middle = [kv_pool, ("start_stream", self.stage_start_stream)]
            middle += [("warmup", self.stage_warmup), ("stream_weights", self.stage_join_stream)]
        else:
            middle = [("stream_weights", self.stage_stream_weights), *agree, kv_pool]
            middle += [("warmup", self.stage_warmup)]
        return [
            (
                "restore_caches",
                lambda f: self.stage_restore_caches(f, snapshot_dir, section, manifest["files"]),
            ),
            ("build_model", lambda f: self.stage_build_model(f, snapshot_dir / "model")),
            *middle,
            ("capture_graphs", lambda f: self.stage_capture_graphs(f, restoring=True)),
            ("tokenizer", lambda f: self.stage_tokenizer(f, snapshot_dir / "model")),
            ("grammars", lambda f: self.stage_grammars(f, self._checked.grammars)),
            *self._warm_stage(self._checked.prefix_warm),
            ("health_check", lambda f: self.stage_replay_check(f, self._checked.health)),
        ]

    def stage_ranks_agree(self, figures: Figures) -> None:
        """Several ranks: every rank got this far (the stages after this one are collectives)."""
        failed = self._ranks_agree("")
        figures["ranks"] = self.world_size
        if failed:
            raise RestoreFailed(f"rank {failed[0][0]} could not restore: {failed[0][1]}")

    def join_failed_restore(self, reason: str) -> None:
        """This rank's restore failed before `ranks_agree`: the others hear it there, and every
        rank falls back together (the runtime calls this before its fallback)."""
        if self.world_size > 1 and not self._agreed:
            self._ranks_agree(reason or "failed")

    def _ranks_agree(self, reason: str) -> list[tuple[int, str]]:
        from snapfn.handler.llm.models.tensor_parallel import all_gather_texts

        self._agreed = True
        reasons = all_gather_texts(reason, self.parallel)
        return [(k, r) for k, r in enumerate(reasons) if r]

    def prepare_runtime(self, figures: Figures) -> None:
        """A restore's first stage (before validation): the same environment as a cold init."""
        self.stage_runtime_env(figures)

    def stage_restore_caches(
        self,
        figures: Figures,
        snapshot_dir: Path,
        section: dict[str, Any],
        listed: dict[str, Any] | None = None,
    ) -> None:
        """The snapshot's compile caches into the local cache dir; with `listed` (the manifest's
        files), each copied file's bytes checked against its entry as it is copied."""
        if self.rank > 0:  # one cache folder on the machine: rank 0 restores it
            figures["restored_cache_files"] = "by rank 0"
        elif self.cache_drift is None:
            caches = compile_caches.restore_caches(
                snapshot_dir / "caches", self.config.cache_dir, listed
            )
            figures["restored_cache_files"] = caches
        if self.cache_drift is None:  # the init's kernel configs (made for this GPU) again
            from snapfn.handler.llm.kernels.triton.tuning import pin_choices

            figures["pinned_kernel_choices"] = pin_choices(self._checked.kernel_choices)
        else:  # made for another GPU, driver or library: compiled again here
            figures.update(restored_cache_files=0, dropped=self.cache_drift)
        # NOTE: the tokenizer (0.1 s for a 128k vocabulary, most of it holding the GIL) loads
        # here, while CUDA's context is still being made on its side thread; then the host
        # ring is pinned on a side thread of its own while the model is built, and
        # stream_weights waits for it.
        from snapfn.handler.llm.tokenizer import load_tokenizer

        self._tokenizer = [load_tokenizer(snapshot_dir / "model")]
        self._cuda_ready(figures)
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapfn-restore")
        self._streamer = pool.submit(self._open_streamer, snapshot_dir / self.weights_file)
        pool.shutdown(wait=False)

    def _open_streamer(self, path: Path):
        from snapfn.snapshot.layout.streamer import WeightStreamer

        layout = self._checked.layout
        layout.validate(path.stat().st_size)
        c = self.config
        # NOTE: a snapshot still arriving: each read waits for its chunks to be verified
        following = self.arriving.waiter(self.weights_file) if self.arriving is not None else None
        # A chunk the pull recorded has just been checked against the manifest's sha256 (the
        # digests the layout's table holds too): hashing it again on the host would only halve
        # the cores the download has. On CUDA what lands in device memory is still checked.
        verify = "none" if following is not None and not self.device.startswith("cuda") else "auto"
        streamer = WeightStreamer(
            path,
            layout,
            device=self.device,
            num_threads=c.stream_threads,
            ring_slots=c.stream_ring_slots,
            verify=verify,
            arrivals=following,
            ring_pinning=c.stream_ring_pinning,
        )
        streamer.prepare()
        return streamer

    def stage_build_model(self, figures: Figures, model_folder: Path) -> None:
        from snapfn.handler.llm.build import as_held, build_model
        from snapfn.handler.llm.config import ModelConfig
        from snapfn.snapshot.portable.format import load_json, read_regular_file

        raw = read_regular_file(model_folder, "config.json", 1 << 20)
        try:
            doc = load_json(raw)
        except ValueError as exc:
            raise RestoreFailed(f"the snapshot's model/config.json is {exc}") from None
        # the MTP layers the init built: those its weights held (the layout's parameters)
        self._model_config = as_held(ModelConfig.from_hf(doc), self._checked.layout.tensors)
        check_config_against_layout(self._model_config, self._checked.layout.tensors, self.parallel)
        self.model = build_model(
            self._model_config, self.config.engine_options(parallel=self.parallel)
        )
        check_against_model(self._checked, self._model_config, self.model)
        self._adopt_parameters(figures)
        figures["parameters"] = sum(1 for _ in self.model.parameters())

    def _adopt_parameters(self, figures: Figures) -> None:
        if self.memory is not None:
            figures["weights_region_bytes"] = self.memory.adopt_parameters(self.model)

    def stage_stream_weights(self, figures: Figures) -> None:
        self._stream_figures(figures, self._stream_weights())

    def restore_reads(self, snapshot_dir: Path) -> list[Path]:
        """The big file a tier-0 restore of this rank reads (its weights), for the runtime to
        start into the page cache before the first stage (`InitConfig.restore_read_ahead`)."""
        return [Path(snapshot_dir) / self.weights_file] if self.config.restore_read_ahead else []

    @property
    def restore_read_priority(self) -> str:
        """The read-ahead's I/O priority (`InitConfig.restore_read_ahead_priority`)."""
        return self.config.restore_read_ahead_priority

    def _overlaps_stream(self) -> bool:
        """Whether this restore makes and warms the KV pool while its weights stream
        (`InitConfig.restore_overlap`): one rank (several meet in collectives after agreeing),
        the snapshot's own plan (a plan measured again runs a forward that must see the
        weights), parameters of its own (not in a process snapshot's regions)."""
        return (
            self.config.restore_overlap
            and self.world_size == 1
            and self.cache_drift is None
            and self.memory is None
        )

    def stage_start_stream(self, figures: Figures) -> None:
        """Start the weights' stream on a side thread. The warmup that runs meanwhile reads
        parameters still being filled and keeps nothing it computes from them (kernels load,
        shapes are set up, its KV writes go to pages no request holds). They are zeroed first,
        on every device: from the stray bits of reused memory (NaN) the warmup wrote NaN into
        KV pages, and a later decode's masked read of such a page (0 x NaN) answered NaN.
        NOTE: graph capture waits for the stream: a capture forbids the stream's calls on
        other threads."""
        import torch

        with torch.no_grad():
            for param in self.model.parameters():
                param.zero_()
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)  # the zeros land before any streamed byte
        if self.config.restore_switch_interval_us > 0:
            self._switch_interval = sys.getswitchinterval()  # set back when the stream is joined
            sys.setswitchinterval(self.config.restore_switch_interval_us / 1e6)
            figures["switch_interval_us"] = self.config.restore_switch_interval_us
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapfn-stream")
        self._stream_job = pool.submit(self._stream_weights)
        pool.shutdown(wait=False)
        figures["overlapped_with"] = "warmup"

    def stage_join_stream(self, figures: Figures) -> None:
        """The stream started by `stage_start_stream`, waited for (this stage's seconds are
        the wait; `elapsed_s` the stream's own)."""
        try:
            self._stream_figures(figures, self._stream_job.result())
        finally:
            if self._switch_interval is not None:
                sys.setswitchinterval(self._switch_interval)
                self._switch_interval = None

    def _stream_weights(self):
        import time

        import torch

        start = time.perf_counter()
        streamer = self._streamer.result()  # the ring pinned on its side thread
        self._ring_wait_s = time.perf_counter() - start
        try:
            with torch.no_grad():
                return streamer.stream_into(dict(self.model.named_parameters()))
        finally:
            streamer.close()

    def _stream_figures(self, figures: Figures, report) -> None:
        figures.update(report_fields(report))  # ring_pin_s: restore_caches' side thread's
        figures["ring_wait_s"] = round(self._ring_wait_s, 4)  # the stream's wait for it
        if self.arriving is not None:
            figures["source"] = f"{self.arriving.uri} (overlapped with its pull)"

    def stage_plan_kv(self, figures: Figures, section: dict[str, Any]) -> None:
        from snapfn.handler.llm.engine.memory import MemoryPlan

        if self.cache_drift is None:
            self.plan = MemoryPlan(**self._checked.plan)  # checked in validate and build_model
        else:  # measured on another machine: measured again here
            self.stage_memory_profile(figures)
            figures["plan"] = "measured again"
        self.stage_kv_pool(figures)

    def stage_replay_check(self, figures: Figures, recorded: dict[str, Any]) -> None:
        self.health = self.generate_one()
        figures.update(self.health)
        if self.cache_drift is None:
            close = self.health["logprob"] == recorded["logprob"]
        else:  # another GPU or library sums in another order: the same token, a close logprob
            drift = abs(self.health["logprob"] - recorded["logprob"])
            close = drift <= REPLAY_LOGPROB_TOLERANCE
            figures["replay"] = f"tolerant (caches dropped): logprob off by {drift:.2e}"
        same = self.health["token"] == recorded["token"] and close
        _count_kernel_choices(figures)
        if not same or self.health["prompt_ids"] != recorded["prompt_ids"]:
            raise RestoreFailed(
                f"replay check failed: restored model answered token {self.health['token']} "
                f"(logprob {self.health['logprob']!r}), init recorded {recorded['token']} "
                f"(logprob {recorded['logprob']!r})"
            )

    def release(self) -> None:
        if self._stream_job is not None:  # NOTE: its copies end before their memory is let go
            wait([self._stream_job])
        if self._switch_interval is not None:  # a restore that failed before the stream's join
            sys.setswitchinterval(self._switch_interval)
            self._switch_interval = None
        pending = getattr(self, "_streamer", None)
        if pending is not None and pending.done() and pending.exception() is None:
            pending.result().close()
        self.engine = self.model = self._streamer = self._stream_job = None
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()


def _kernel_choices() -> dict[str, Any]:
    """The snapshot section's `kernel_choices`: every autotuned kernel's config per key, as
    chosen in this process (none on CPU)."""
    from snapfn.handler.llm.kernels.triton.tuning import recorded_choices

    choices = recorded_choices()
    return {"kernel_choices": choices} if choices else {}


def _count_kernel_choices(figures: Figures) -> None:
    from snapfn.handler.llm.kernels.triton.tuning import choice_counts

    counts = choice_counts()
    if counts:
        figures["kernel_choices"] = counts


def _joined(warm) -> dict[str, Any]:
    """The compiler warm's figures; its failure as a figure (the first launch does the work
    then, and raises there if it must)."""
    try:
        return warm.result()
    except Exception as exc:  # noqa: BLE001  (an optimisation's failure, reported)
        return {"error": f"{type(exc).__name__}: {exc}"}
