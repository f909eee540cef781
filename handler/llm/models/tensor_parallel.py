"""The collectives of a tensor-parallel rank, and the layers that call them.

Ranks are laid out `rank = ep_rank * tp_size + tp_rank` in a world of `tp_size * ep_size`: a
tensor-parallel group is the `tp_size` ranks of one `ep_rank`, an expert-parallel group the
`ep_size` ranks of one `tp_rank`. Where a size is the world's, its group is the default one.
The groups are made on first use (`groups`), which every rank reaches at the same point of the
same forward, as `torch.distributed.new_group` requires; a model built without a process group
(one rank's weights loaded and inspected) never asks for them.

The seed's rules (../shared/seeds/glm-5.3-first-request.txt), and sglang's and vLLM's:
- column-parallel projections (q/k/v, gate/up, MLA's q_b/kv_b) hold their heads' or
  intermediate columns and need no collective;
- row-parallel ones (`RowLinear`: o_proj, down_proj) hold their input rows: each rank's product
  is a partial sum, all-reduced over the tp group, the bias added once after;
- the embedding and `lm_head` are vocab-parallel (`VocabEmbedding`, `gather_vocab`): a rank
  holds `ceil(vocab / tp)` rows (the last rank's past the vocabulary zero); a lookup outside
  them gives zeros and the all-reduce fills it in,
  and each rank's logits are all-gathered into the whole vocabulary, identical on every rank.
At tp 1 none of this runs: the layers are the plain ones.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from snapfn.handler.llm.models.layers import Linear
from snapfn.handler.llm.parallel import ParallelConfig
from snapfn.snapshot.errors import BadRequest

_GROUPS: dict[tuple, tuple] = {}


def groups(parallel: ParallelConfig) -> tuple:
    """`(tp_group, ep_group)` of this rank (None: the default group), made once per process
    group; BadRequest when torch.distributed is not the `tp_size * ep_size` world."""
    import torch.distributed as dist

    tp, ep = parallel.tp_size, parallel.ep_size
    if not dist.is_initialized() or dist.get_world_size() != tp * ep:
        world = dist.get_world_size() if dist.is_initialized() else "no process group"
        raise BadRequest(
            f"tp_size={tp} x ep_size={ep} needs torch.distributed initialised with {tp * ep}"
            f" ranks (world: {world})"
        )

    def make() -> tuple:
        if dist.get_rank() != parallel.ep_rank * tp + parallel.tp_rank:
            raise BadRequest(
                f"rank {dist.get_rank()} is not ep_rank * tp_size + tp_rank ="
                f" {parallel.ep_rank * tp + parallel.tp_rank}"
            )
        tp_group = ep_group = None
        if ep > 1 and tp > 1:  # every rank makes every group, in the same order
            for e in range(ep):
                made = dist.new_group([e * tp + t for t in range(tp)])
                tp_group = made if e == parallel.ep_rank else tp_group
            for t in range(tp):
                made = dist.new_group([e * tp + t for e in range(ep)])
                ep_group = made if t == parallel.tp_rank else ep_group
        return tp_group, ep_group

    return _made_once(_GROUPS, (tp, ep), make)


def _made_once(cache: dict, key: tuple, make):
    """`make()`'s groups, made once per process group: cached under `key` and the world's `id`,
    with a weak reference to that world. A later world can take a destroyed one's `id`; its
    entry's world is then gone (or another object), and the groups are made again rather than
    handed a dead world's, which fail every collective. NOTE: weak: a process group kept alive
    past `destroy_process_group` aborts the interpreter at exit."""
    import torch.distributed as dist

    world = dist.group.WORLD
    entry = cache.get((*key, id(world)))
    if entry is None or entry[0]() is not world:
        entry = cache[(*key, id(world))] = (weakref.ref(world), make())
    return entry[1]


def all_reduce_tp(x: torch.Tensor, parallel: ParallelConfig) -> torch.Tensor:
    """`x` summed over the tp group, in place; `x` itself at tp 1."""
    if parallel.tp_size == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x, group=groups(parallel)[0])
    return x


def gather_vocab(logits: torch.Tensor, parallel: ParallelConfig, vocab_size: int) -> torch.Tensor:
    """Each tp rank's logits `[T, V/tp]` side by side: `[T, vocab_size]` on every rank."""
    if parallel.tp_size == 1:
        return logits
    import torch.distributed as dist

    parts = [torch.empty_like(logits) for _ in range(parallel.tp_size)]
    dist.all_gather(parts, logits.contiguous(), group=groups(parallel)[0])
    return torch.cat(parts, dim=-1)[..., :vocab_size]


def runs_every_request(parallel: ParallelConfig) -> bool:
    """Whether every rank of the world runs the same requests: tensor parallel, and expert
    parallel with the `replicated` exchange (not `all_to_all`: each rank its own)."""
    return parallel.tp_size * parallel.ep_size > 1 and parallel.ep_dispatch == "replicated"


def broadcast_tokens(tokens: list[int], parallel: ParallelConfig, device) -> list[int]:
    """Rank 0's `tokens` on every rank that runs the same requests (`runs_every_request`): a
    sampled draw (a generator of its own per rank) must be the same everywhere, or the ranks'
    requests part ways."""
    if not runs_every_request(parallel):
        return tokens
    import torch.distributed as dist

    groups(parallel)  # the world is the one asked for
    t = torch.tensor(tokens, dtype=torch.int64, device=device)
    dist.broadcast(t, src=0)
    return t.tolist()


def warm_collectives(model, rows: int) -> dict[str, float]:
    """Run each collective a step runs once, at its decode shapes, before any graph captures
    one (the seed's rule: a communicator's set-up is the init's, never a request's); the
    seconds each took, as figures."""
    import time

    import torch.distributed as dist

    parallel, cfg = model.parallel, model.config
    figures = {}

    def timed(name: str, fn) -> None:
        start = time.perf_counter()
        fn()
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        figures[f"{name}_s"] = round(time.perf_counter() - start, 4)

    h = torch.zeros(rows, cfg.hidden_size, dtype=model.dtype, device=model.device)
    if parallel.tp_size > 1:
        timed("tp_all_reduce", lambda: all_reduce_tp(h, parallel))
        _, vocab = vocab_rows(cfg.vocab_size, parallel)
        logits = torch.zeros(rows, vocab, dtype=torch.float32, device=model.device)
        timed("vocab_all_gather", lambda: gather_vocab(logits, parallel, cfg.vocab_size))
    if parallel.ep_size > 1 and parallel.ep_dispatch == "replicated":
        timed("ep_all_reduce", lambda: dist.all_reduce(h, group=groups(parallel)[1]))
    timed("cpu_broadcast", lambda: dist.broadcast(torch.zeros(1), src=0, group=cpu_group()))
    return figures


def min_over_ranks(value: int, parallel: ParallelConfig) -> int:
    """The least `value` over every rank of the world (the memory plan's page count)."""
    import torch.distributed as dist

    groups(parallel)
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=cpu_group())
    return int(t.item())


def all_gather_texts(text: str, parallel: ParallelConfig) -> list[str]:
    """Every rank's `text`, in rank order, on every rank (UTF-8 over the gloo group: no pickle)."""
    import torch.distributed as dist

    groups(parallel)
    data = text.encode()
    world = parallel.tp_size * parallel.ep_size
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=cpu_group())
    longest = max(int(s.item()) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
    parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(parts, mine, group=cpu_group())
    return [bytes(p[: int(s.item())].numpy()).decode() for p, s in zip(parts, sizes, strict=True)]


_CPU_GROUPS: dict[tuple, tuple] = {}


def forget_groups() -> None:
    """Drop the groups made for the process group that was just destroyed (a rank about to be
    checkpointed closes its communicators; after its restore they are made again)."""
    _GROUPS.clear()
    _CPU_GROUPS.clear()


def cpu_group():
    """A gloo group of the whole world, for host values (the default group is NCCL on CUDA);
    made the first time, by every rank at the same point."""
    import torch.distributed as dist

    return _made_once(_CPU_GROUPS, (), lambda: dist.new_group(backend="gloo"))


def vocab_rows(vocab_size: int, parallel: ParallelConfig) -> tuple[int, int]:
    """`(start, rows)` of this tp rank's block of the vocabulary (`sharding.vocab_split`),
    `rows` padded: a vocabulary that does not divide by tp ends in zero rows on the last rank,
    whose logits `gather_vocab` drops."""
    from snapfn.handler.llm.weights.sharding import vocab_split

    start, _, padded = vocab_split(vocab_size, parallel.tp_size, parallel.tp_rank)
    return start, padded


class RowLinear(Linear):
    """A row-parallel Linear: this rank's input rows, its partial product all-reduced over the
    tp group, the bias (replicated) added once, after."""

    def __init__(self, *args, parallel: ParallelConfig, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.parallel = parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.float32_fp8:
            x = x.float()
        out = self.backend.linear(x, self.weight, None, self.weight_scale_inv)
        out = all_reduce_tp(out, self.parallel)
        return out if self.bias is None else out + self.bias


class VocabEmbedding(nn.Embedding):
    """This tp rank's rows of the token embedding; `lookup` gives the whole embedding on every
    rank (zeros for ids outside the rows, filled in by the all-reduce)."""

    def __init__(self, vocab_size, hidden_size, parallel: ParallelConfig, *, dtype, device):
        self.start, rows = vocab_rows(vocab_size, parallel)
        # NOTE: given its weight, nn.Embedding skips its own init (a normal_ over the whole
        # table: 3.6 s for the 8B's on CPU, on CUDA a kernel that waited 0.28 s for the
        # restore's ring pinning); the loader or the stream fills it
        weight = torch.empty(rows, hidden_size, dtype=dtype, device=device)
        super().__init__(rows, hidden_size, _weight=weight, _freeze=True)
        self.parallel = parallel

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.num_embeddings)
        h = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        h = h * inside[:, None].to(h.dtype)
        return all_reduce_tp(h, self.parallel)
