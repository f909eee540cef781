"""How a MoE layer's tokens meet routed experts held on other ep ranks (`ParallelConfig.ep_dispatch`).

Each ep rank holds a contiguous block of `E / ep_size` routed experts (`local_expert_range`).
`experts(x, topk_ids, topk_weights)` is this rank's `backend.moe`: the weighted sum, per row, of
the row's experts that live here (ids outside the block add nothing).

- `replicated` (`ReplicatedExchange`): every rank runs every token (attention replicated), so
  each rank applies its experts to all rows and the shares are summed by one all-reduce.
- `all_to_all` (`AllToAllExchange`): data-parallel attention. Each rank runs its own requests;
  a MoE layer sends each token once to every rank that holds one of its experts (dispatch),
  that rank returns the token's sum over its experts there, and the sender adds the sums up
  (combine) — DeepEP's dispatch/combine, over `torch.distributed` all-to-alls (NCCL on CUDA,
  gloo on CPU). Every rank must enter every MoE layer's exchange once per forward, a rank with
  nothing to run with no tokens (`CausalLM.idle_forward`), so the engine steps the ranks in
  lock step (`Engine.generate`). Split sizes travel first and are read on the host, so these
  layers cannot be captured in a CUDA graph.
- `deepep` (`DeepEPExchange`): the same data-parallel semantics with DeepEP's (V1, normal mode,
  intranode) `Buffer.dispatch` / `combine` kernels over NVLink in place of the all-to-alls,
  where `deep_ep` is importable (an explicit choice until it has run on two GPUs). Its dispatch
  also waits on the host for the received count, so no graphs here either.
"""

from __future__ import annotations

from typing import Protocol

import torch

from snapfn.handler.llm.parallel import ParallelConfig
from snapfn.snapshot.errors import BadRequest


class ExpertsFn(Protocol):
    def __call__(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor: ...


class Exchange:
    """Checks, on first use, that `torch.distributed` is the ep group (a model may be built and
    loaded without one: one rank's weights, inspected)."""

    lockstep = False

    def __init__(self, parallel: ParallelConfig) -> None:
        self.parallel = parallel
        self._checked = False

    def check_world(self) -> None:
        """BadRequest unless torch.distributed is the `tp_size * ep_size` world; the ep group
        (`tensor_parallel.groups`: None, the default one, at tp 1) is `self.group` after."""
        if self._checked:
            return
        from snapfn.handler.llm.models.tensor_parallel import groups

        self.group = groups(self.parallel)[1]
        self._checked = True


class ReplicatedExchange(Exchange):
    """Every rank holds every token: this rank's experts' share, all-reduced."""

    def __call__(self, x, topk_ids, topk_weights, experts: ExpertsFn) -> torch.Tensor:
        import torch.distributed as dist

        self.check_world()
        out = experts(x, topk_ids, topk_weights)
        dist.all_reduce(out, group=self.group)
        return out


class AllToAllExchange(Exchange):
    """Each rank holds its own tokens: dispatch them to their experts' ranks, combine the sums."""

    lockstep = True

    def __init__(self, parallel: ParallelConfig, experts_per_rank: int) -> None:
        super().__init__(parallel)
        self.ep_size = parallel.ep_size
        self.experts_per_rank = experts_per_rank

    def __call__(self, x, topk_ids, topk_weights, experts: ExpertsFn) -> torch.Tensor:
        self.check_world()
        # x [T, H]; topk_ids [T, k] global expert ids; topk_weights [T, k] float32
        owners = topk_ids.long() // self.experts_per_rank  # [T, k]
        wanted = torch.zeros(x.shape[0], self.ep_size, dtype=torch.bool, device=x.device)
        wanted.scatter_(1, owners, True)  # [T, ep]: which ranks each token goes to
        dest, token = torch.where(wanted.T)  # grouped by destination rank, tokens in order
        send_splits = torch.bincount(dest, minlength=self.ep_size)
        recv_splits = _exchange(send_splits, None, None)
        sends, recvs = send_splits.tolist(), recv_splits.tolist()  # NOTE: a host sync
        # one message per token: its hidden state, then its ids and weights as float32 bits
        routing = torch.cat([topk_ids.float(), topk_weights.float()], dim=1)  # [T, 2k]
        message = torch.cat([x, routing.view(x.dtype)], dim=1)[token]  # [S, H + 2k * 4 / size]
        received = _exchange(message, recvs, sends)
        hidden = x.shape[1]
        recv_x = received[:, :hidden].contiguous()  # [R, H]
        recv_routing = received[:, hidden:].contiguous().view(torch.float32)  # [R, 2k]
        k = topk_ids.shape[1]
        if recv_x.shape[0]:
            ids = recv_routing[:, :k].long()  # exact: expert ids < 2^24
            summed = experts(recv_x, ids, recv_routing[:, k:].contiguous())  # [R, H]
        else:
            summed = recv_x  # nothing routed here: skip the kernels (some refuse 0 rows)
        back = _exchange(summed, sends, recvs)  # [S, H], in dispatch order
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        return out.index_add_(0, token, back.float()).to(x.dtype)


class DeepEPExchange(Exchange):
    """`AllToAllExchange`'s semantics through DeepEP's normal-mode kernels (`deep_ep.Buffer`):
    `get_dispatch_layout` and `dispatch` send each token once to every rank holding one of its
    experts, with its ids made local to that rank (-1 and a zero weight for the others);
    `backend.moe` sums the token's experts there; `combine` adds the ranks' sums back (DeepEP's
    combine does not weight: the sums carry the weights already). DeepEP takes bf16 rows."""

    lockstep = True

    def __init__(self, parallel: ParallelConfig, num_experts: int, deep_ep) -> None:
        super().__init__(parallel)
        self.num_experts = num_experts
        self.experts_per_rank = num_experts // parallel.ep_size
        self._deep_ep = deep_ep
        # NOTE: one buffer for the model (its MoE layers share this exchange): each holds NVLink
        # memory mapped on every rank, sized for a layer's traffic
        self._buffer = None

    def buffer(self, hidden_bytes: int):
        """DeepEP's communication buffer, sized by its configs' hints for rows of
        `hidden_bytes` (DeepEP's README), made at first use and again only if too small."""
        import torch.distributed as dist

        buffer_cls, ranks = self._deep_ep.Buffer, self.parallel.ep_size
        configs = (buffer_cls.get_dispatch_config(ranks), buffer_cls.get_combine_config(ranks))
        nvl = max(c.get_nvl_buffer_size_hint(hidden_bytes, ranks) for c in configs)
        if self._buffer is None or self._buffer.num_nvl_bytes < nvl:
            self._buffer = buffer_cls(dist.group.WORLD, nvl, 0)
        return self._buffer

    def __call__(self, x, topk_ids, topk_weights, experts: ExpertsFn) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise BadRequest(
                f"ep_dispatch='deepep' moves bf16 rows (DeepEP's normal kernels), not {x.dtype}:"
                " run the model in bfloat16, or use ep_dispatch='all_to_all'"
            )
        self.check_world()
        buffer = self.buffer(x.shape[1] * max(x.element_size(), 2))
        ids = topk_ids.to(getattr(self._deep_ep, "topk_idx_t", torch.int64))
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(
            ids, self.num_experts
        )
        recv_x, recv_ids, recv_weights, _, handle, _ = buffer.dispatch(
            x,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=ids,
            topk_weights=topk_weights.float(),
        )
        if recv_x.shape[0]:
            first = self.parallel.ep_rank * self.experts_per_rank
            # DeepEP's -1 (an expert of another rank, weight 0): an id outside this rank's
            # block, which `experts` skips
            elsewhere = (first + self.experts_per_rank) % self.num_experts
            global_ids = torch.where(recv_ids >= 0, recv_ids + first, elsewhere)
            summed = experts(recv_x, global_ids, recv_weights)
        else:
            summed = recv_x  # nothing routed here: skip the kernels (some refuse 0 rows)
        combined, _, _ = buffer.combine(summed, handle)
        return combined


def import_deep_ep():
    """`deep_ep`, or BadRequest saying how to get it."""
    try:
        import deep_ep
    except ImportError as e:
        raise BadRequest(
            f"ep_dispatch='deepep' needs DeepEP (deep_ep), which does not import here ({e}): "
            "build it from https://github.com/deepseek-ai/DeepEP (bench/deepep_build.sh, "
            "docs/kernels.md), or use ep_dispatch='all_to_all'"
        ) from e
    return deep_ep


def _exchange(
    tensor: torch.Tensor, recv_splits: list[int] | None, send_splits: list[int] | None
) -> torch.Tensor:
    """One all-to-all of `tensor`'s rows: `send_splits[r]` rows to rank r, `recv_splits[r]`
    from it (None: equal splits of a tensor the size of this one)."""
    import torch.distributed as dist

    rows = tensor.shape[0] if recv_splits is None else sum(recv_splits)
    out = tensor.new_empty((rows, *tensor.shape[1:]))
    dist.all_to_all_single(out, tensor.contiguous(), recv_splits, send_splits)
    return out


def make_exchange(parallel: ParallelConfig, num_experts: int) -> Exchange | None:
    """The exchange `parallel` asks for, or None at ep_size 1 (every expert is here)."""
    if parallel.ep_size == 1:
        return None
    if parallel.tp_size != 1 and parallel.ep_dispatch != "replicated":
        raise BadRequest(
            f"ep_dispatch={parallel.ep_dispatch!r} with tp_size={parallel.tp_size}: tensor"
            " parallel runs every token on every rank, so its experts meet them 'replicated'"
        )
    if parallel.ep_dispatch == "replicated":
        return ReplicatedExchange(parallel)
    if parallel.ep_dispatch == "deepep":
        return DeepEPExchange(parallel, num_experts, import_deep_ep())
    return AllToAllExchange(parallel, num_experts // parallel.ep_size)
