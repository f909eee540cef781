"""A rank of a tensor-parallel LLM that rank 0 started (`ranks.py`) and drives (`lockstep.py`).

    python -m snapfn.handler.llm.follower MODEL_DIR|- [SNAPSHOT_DIR [init]]

Its rank and group come from the environment rank 0 gave it (RANK, WORLD_SIZE, MASTER_*), its
`InitConfig` from the `SNAPFN_*` variables (`InitConfig.to_env`: rank 0's own). It comes up as
rank 0 does (`recipes/ranks_start.py`: a restore of SNAPSHOT_DIR, or a cold init of MODEL_DIR
that writes its part of the snapshot when one is named; `init`: a cold init that writes it
whatever the folder holds, as `snapfn init`; `-`: no model named), then makes the
control channel and follows rank 0's steps until told to stop. Its stage lines go to stderr,
marked with its rank.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (1, 2, 3) or argv[2:] not in ([], ["init"]):
        usage = "usage: python -m snapfn.handler.llm.follower MODEL_DIR|- [SNAPSHOT_DIR [init]]"
        print(usage, file=sys.stderr)
        return 2
    from dataclasses import replace

    from snapfn.handler.llm.init_config import InitConfig
    from snapfn.handler.llm.lockstep import Lockstep, follow
    from snapfn.handler.llm.ranks import parallel_ranks
    from snapfn.handler.llm.recipes.ranks_start import start_rank

    config = InitConfig.from_env(os.environ)
    rank = os.environ.get("RANK", "?")
    model_dir = None if argv[0] == "-" else Path(argv[0])
    snapshot_dir = Path(argv[1]) if len(argv) >= 2 else None
    fresh = argv[2:] == ["init"]

    def log(line: str) -> None:
        print(f"[snapfn rank {rank}] {line}", file=sys.stderr, flush=True)

    ranks = parallel_ranks(config.tp_size, config.ep_size, config.ep_dispatch, config.device)
    with ranks as (parallel, device):
        config = replace(config, device=device)
        fn, _ = start_rank(config, model_dir, snapshot_dir, parallel, log, fresh)
        follow(fn.engine, Lockstep(parallel))
    return 0


if __name__ == "__main__":
    sys.exit(main())
