"""Where this process sits in the tensor- and expert-parallel groups (`ParallelConfig`), apart
from the sharding rules (`sharding.py`) so that the command line can name its choices without
importing torch."""

from __future__ import annotations

from dataclasses import dataclass

from snapfn.snapshot.errors import BadRequest

EP_DISPATCHES = ("replicated", "all_to_all", "deepep")


@dataclass(frozen=True)
class ParallelConfig:
    """This process's place in the tensor-parallel and expert-parallel groups.

    `ep_dispatch` says how tokens meet experts on other ep ranks (`models/expert_exchange.py`):
    "replicated" (every rank runs every token; the experts' shares are all-reduced) or
    "all_to_all" (each rank runs its own requests; tokens are dispatched to their experts'
    ranks and combined back, and the ranks step in lock step) or "deepep" (the same, with
    DeepEP's NVLink dispatch and combine kernels in place of the all-to-alls)."""

    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    ep_dispatch: str = "replicated"

    def __post_init__(self) -> None:
        for group in ("tp", "ep"):
            size, rank = getattr(self, f"{group}_size"), getattr(self, f"{group}_rank")
            if size < 1 or not 0 <= rank < size:
                raise BadRequest(f"{group}_size={size}, {group}_rank={rank}: need 0 <= rank < size")
        if self.ep_dispatch not in EP_DISPATCHES:
            raise BadRequest(
                f"ep_dispatch={self.ep_dispatch!r}: choose one of {', '.join(EP_DISPATCHES)}"
            )
