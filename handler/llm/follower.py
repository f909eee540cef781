"""A rank of a tensor-parallel LLM that rank 0 started (`ranks.py`) and drives (`lockstep.py`).

    python -m snapfn.handler.llm.follower MODEL_DIR

Its rank and group come from the environment rank 0 gave it (RANK, WORLD_SIZE, MASTER_*), its
`InitConfig` from the `SNAPFN_*` variables (`InitConfig.to_env`: rank 0's own). It runs the cold
init stages rank 0 runs, in the same order (their forwards are collectives), then makes the
control channel and follows rank 0's steps until told to stop. Its stage lines go to stderr,
marked with its rank.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m snapfn.handler.llm.follower MODEL_DIR", file=sys.stderr)
        return 2
    from snapfn.handler.llm.init_config import InitConfig
    from snapfn.handler.llm.lockstep import Lockstep, follow
    from snapfn.handler.llm.ranks import parallel_ranks
    from snapfn.handler.llm.recipes.function import LLMFunction
    from snapfn.snapshot.runtime import cold_init

    config = InitConfig.from_env(os.environ)
    rank = os.environ.get("RANK", "?")

    def log(line: str) -> None:
        print(f"[snapfn rank {rank}] {line}", file=sys.stderr, flush=True)

    ranks = parallel_ranks(config.tp_size, config.ep_size, config.ep_dispatch, config.device)
    with ranks as (parallel, device):
        from dataclasses import replace

        fn = LLMFunction(replace(config, device=device), Path(argv[0]), parallel=parallel)
        cold_init(fn, log)
        follow(fn.engine, Lockstep(parallel))
    return 0


if __name__ == "__main__":
    sys.exit(main())
