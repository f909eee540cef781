"""Tier 1 of several ranks: a process image of each rank of a tensor/expert-parallel LLM.

    init_process_ranks(config, model_dir, dest)   one checkpointable worker per rank (this
                                                  process is none of them); they join a gloo
                                                  group, cold-init together, write the tier-0
                                                  files (every rank its weights file), record a
                                                  replay, close their communicators together
                                                  and are dumped at once
    restore_process_ranks(snapshot, config, log)  every rank's image restored at once; each
                                                  makes its communicators again (stage
                                                  "communicators", on a fresh port), streams its
                                                  own weights, and the ranks replay together;
                                                  then rank 0 serves (ProcessLLMService over its
                                                  channel) and drives the others (lockstep.py)

A restore that fails on any rank kills every rank's worker and raises ProcessRestoreFailed; the
caller falls back to tier 0 for all ranks (`ranks_start.py`). CPU workers only: a CUDA
worker's own network namespace (`isolated`) would cut the ranks' TCP, and NCCL communicators
across a CUDA checkpoint have not run; `init_process_ranks` refuses CUDA with that reason.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from snapfn.handler.llm.init_config import InitConfig
from snapfn.handler.llm.recipes.process_host import FilesWriter, LLMProcessHost, log
from snapfn.snapshot.errors import BadRequest, RestoreFailed

HOST = "snapfn.handler.llm.recipes.process_ranks:make"
Log = Callable[[str], None]


class LLMRankHost(LLMProcessHost):
    """One rank's worker. Args: the single-rank host's, plus "rank" and "master_port"."""

    def __init__(self, args: dict[str, Any]) -> None:
        super().__init__(args)
        from snapfn.handler.llm.ranks import rank_layout

        c = self.config
        self.rank = int(args["rank"])
        self.parallel = rank_layout(c.tp_size, c.ep_size, self.rank, c.ep_dispatch)
        self._follow: threading.Thread | None = None

    def make_function(self):
        from snapfn.handler.llm.recipes.function import LLMFunction

        self._join(int(self.args["master_port"]))  # the cold init's forwards are collectives
        model_dir = Path(self.args["model_dir"])
        return LLMFunction(self.config, model_dir, releasable=True, parallel=self.parallel)

    def log(self, line: str) -> None:
        log(f"rank {self.rank}: {line}")

    def write_files(self, writer: FilesWriter, startup: dict[str, Any]) -> tuple[dict, str]:
        """Rank 0 writes the snapshot's files, the others their weights (`_write_ranks`)."""
        if self.rank == 0:
            return super().write_files(writer, startup)
        return {}, self.fn.write_rank_files()[self.rank]["layout"]

    def before_snapshot(self) -> list[str]:
        import torch.distributed as dist

        from snapfn.handler.llm.models.tensor_parallel import forget_groups

        dist.barrier()  # every rank is here: no collective is in flight
        dist.destroy_process_group()
        forget_groups()
        return [*super().before_snapshot(), "close_communicators"]

    def restored_stages(self, runner, resume: dict[str, Any]) -> None:
        runner.run("communicators", lambda f: self._communicators(f, int(resume["master_port"])))

    def _communicators(self, figures: dict[str, Any], port: int) -> None:
        self._join(port)
        figures.update(ranks=self.fn.world_size, port=port)

    def _join(self, port: int) -> None:
        from datetime import timedelta

        import torch.distributed as dist

        from snapfn.handler.llm.ranks import DEFAULT_TIMEOUT_S

        timeout = float(os.environ.get("SNAPFN_RANK_TIMEOUT_S") or DEFAULT_TIMEOUT_S)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=self.rank,
            world_size=self.config.world_size,
            timeout=timedelta(seconds=timeout),
        )

    def start_serving(self) -> None:
        from snapfn.handler.llm.lockstep import Lockstep, follow
        from snapfn.handler.llm.service import LLMService

        lockstep = Lockstep(self.parallel)
        if self.rank == 0:
            self.service = LLMService(self.fn.engine, lockstep=lockstep)
            return
        self._follow = threading.Thread(
            target=follow, args=(self.fn.engine, lockstep), daemon=True, name="snapfn-follow"
        )
        self._follow.start()

    def handle(self, message: dict[str, Any], send) -> None:
        if self.rank != 0:
            raise BadRequest(f"rank {self.rank} follows rank 0: send requests to rank 0")
        super().handle(message, send)


def make(args: dict[str, Any]) -> LLMRankHost:
    return LLMRankHost(args)


def init_process_ranks(config: InitConfig, model_dir: Path, dest: Path, log: Log | None):
    """The snapshot at `dest`, tier 1 for every rank (tier 0 with the reason when any rank's
    checkpoint fails); its startup manifest (rank 0's init, then the checkpoint)."""
    from snapfn.handler.llm.ranks import free_port
    from snapfn.handler.llm.recipes.snapshot_files import config_json
    from snapfn.snapshot.process.snapshot import init_process_snapshot

    if config.device.startswith("cuda"):
        raise BadRequest(
            "--tier process with several ranks runs on CPU ranks only: CUDA ranks' communicators"
            " across a checkpoint have not run; use --tier portable"
        )
    args = {
        "model_dir": str(Path(model_dir).absolute()),
        "init_config": config_json(config),
        "master_port": free_port(),
    }
    startup, _ = init_process_snapshot(
        HOST, args, Path(dest), _process_config(config), log, ranks=config.world_size
    )
    return startup


def restore_process_ranks(snapshot_dir: Path, config: InitConfig, log: Log | None, on_exit=None):
    """(ProcessLLMService of rank 0, startup manifest, the other ranks' workers); every rank
    restored at once, or ProcessRestoreFailed with every worker killed."""
    from snapfn.handler.llm.ranks import free_port
    from snapfn.handler.llm.recipes.process_service import ProcessLLMService
    from snapfn.handler.llm.tokenizer import load_tokenizer
    from snapfn.snapshot.process.client import ProcessClient
    from snapfn.snapshot.process.snapshot import ProcessRestoreFailed, restore_process_snapshot
    from snapfn.snapshot.stages import StageRunner

    world, port = config.world_size, free_port()
    process_config = _process_config(config)
    pids: list[int] = []  # every restored worker, as criu restores it
    failed: list[tuple[int, ProcessRestoreFailed]] = []

    def restored(pid: int) -> None:
        pids.append(pid)
        if failed:  # another rank failed already: this one would wait for it
            _kill(pid)

    def restore(rank: int):
        try:
            return restore_process_snapshot(
                Path(snapshot_dir),
                {"master_port": port},
                device=config.device,
                config=process_config,
                log=log if rank == 0 else None,
                world_size=world,
                rank=rank,
                on_restored=restored,
            )
        except ProcessRestoreFailed as exc:
            failed.append((rank, exc))
            for pid in list(pids):  # the others wait for it in their collectives: stop them
                _kill(pid)
            raise

    with ThreadPoolExecutor(world, thread_name_prefix="snapfn-rank-restore") as pool:
        jobs = [pool.submit(restore, k) for k in range(world)]
        results = [job.result() if job.exception() is None else None for job in jobs]
    if failed:
        for pid in pids:
            _kill(pid)
        rank, exc = min(failed, key=lambda f: f[1].startup.total_s)  # the first cause
        raise ProcessRestoreFailed(exc.step, f"rank {rank}: {exc}", exc.startup) from exc
    (worker, startup, _), others = results[0], [r[0] for r in results[1:]]
    runner = StageRunner(startup, log=log, offset_s=startup.total_s)
    try:
        client = ProcessClient(worker, on_exit=on_exit)
        tokenizer = load_tokenizer(Path(snapshot_dir) / "model")
        service = runner.run("connect", lambda f: ProcessLLMService(client, tokenizer))
    except Exception as exc:
        for w in [worker, *others]:
            w.kill()
        raise ProcessRestoreFailed("connect", str(exc), runner.finish(ok=False)) from exc

    def stop_others() -> None:
        for other in others:
            other.kill()

    service.on_close = stop_others
    startup.info["parallel"] = {"tp_size": config.tp_size, "ep_size": config.ep_size}
    return service, runner.finish(ok=True), others


def _kill(pid: int) -> None:
    import contextlib
    import signal

    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)


def _process_config(config: InitConfig):
    from snapfn.snapshot.process.worker_process import ProcessConfig

    process_config = ProcessConfig.from_env(os.environ).for_device(config.device)
    if process_config.pid_namespace == "isolated":  # the ranks meet over loopback TCP
        raise RestoreFailed("several ranks cannot each have a network namespace of their own")
    return process_config
