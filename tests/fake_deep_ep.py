"""A stand-in for DeepEP's `deep_ep` module (V1, 29d31c0: normal-mode intranode kernels) over
`torch.distributed` all-to-alls, for testing `DeepEPExchange` on CPU ranks (gloo). It keeps the
contract of DeepEP's `Buffer` as its docstrings and kernels (`csrc/kernels/intranode.cu`) state it:

- `get_dispatch_layout(topk_idx, num_experts)`: tokens per rank (`int32`, a token counted once
  per rank holding any of its experts), `None` for RDMA ranks (intranode), tokens per expert,
  `is_token_in_rank [T, ranks]` and an event;
- `dispatch(...)`: each rank receives the tokens sent to it, grouped by source rank, with their
  `topk_idx` made local to it (`idx - rank * experts_per_rank`, or -1 for another rank's expert)
  and the weights of the -1 entries zeroed, the received count per local expert, and a handle;
- `combine(x, handle)`: each received row goes back to its source, where the rows of one token
  are added (in float32, no weights: DeepEP's combine reduces, the caller weighted already).

It checks what DeepEP checks that these tests could get wrong: bf16 rows, `topk_idx` of
`topk_idx_t`, float32 weights, the layout's tensors given to `dispatch` as
`get_dispatch_layout` made them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

topk_idx_t = torch.int64


class Config:
    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return hidden_bytes * num_ranks * 64

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0


class EventOverlap:
    def __init__(self, event=None) -> None:
        self.event = event


class Buffer:
    created = 0  # how many buffers this process made (the exchange should make one)

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, **_) -> None:
        assert num_nvl_bytes > 0 and num_rdma_bytes == 0, (num_nvl_bytes, num_rdma_bytes)
        self.group, self.rank, self.group_size = (
            group,
            dist.get_rank(group),
            dist.get_world_size(group),
        )
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        Buffer.created += 1

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config()

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config()

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, **_):
        assert topk_idx.dtype == topk_idx_t, topk_idx.dtype
        per_rank_experts = num_experts // self.group_size
        valid = topk_idx >= 0
        owners = torch.where(valid, topk_idx // per_rank_experts, 0)
        in_rank = torch.zeros(topk_idx.shape[0], self.group_size, dtype=torch.bool)
        in_rank.scatter_(1, owners, valid)  # a -1 entry sets nothing
        per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).int()
        self._layout = (num_experts, in_rank)
        return in_rank.sum(0).int(), None, per_expert, in_rank, EventOverlap()

    def dispatch(
        self,
        x,
        handle=None,
        num_tokens_per_rank=None,
        num_tokens_per_rdma_rank=None,
        is_token_in_rank=None,
        num_tokens_per_expert=None,
        topk_idx=None,
        topk_weights=None,
        **_,
    ):
        assert handle is None and num_tokens_per_rdma_rank is None
        assert x.dtype == torch.bfloat16, x.dtype  # DeepEP's normal kernels: bf16 rows (or FP8)
        num_experts, in_rank = self._layout
        assert is_token_in_rank is in_rank, "is_token_in_rank is not get_dispatch_layout's"
        assert topk_weights.dtype == torch.float32 and topk_idx.dtype == topk_idx_t
        assert torch.equal(num_tokens_per_rank, in_rank.sum(0).int())
        per_rank_experts, k = num_experts // self.group_size, topk_idx.shape[1]
        dest, token = torch.where(in_rank.T)  # grouped by destination, tokens in order
        sends = torch.bincount(dest, minlength=self.group_size)
        recvs = torch.empty_like(sends)
        dist.all_to_all_single(recvs, sends, group=self.group)
        sends, recvs = sends.tolist(), recvs.tolist()
        # each copy's ids made local to its destination (DeepEP does this while sending)
        first = (dest * per_rank_experts)[:, None]
        ids = topk_idx[token]
        local = (ids >= first) & (ids < first + per_rank_experts)
        ids = torch.where(local, ids - first, -1)
        weights = torch.where(local, topk_weights[token], 0.0)
        recv_x = _all_to_all(x[token], recvs, sends, self.group)
        recv_ids = _all_to_all(ids, recvs, sends, self.group)
        recv_weights = _all_to_all(weights, recvs, sends, self.group)
        counts = torch.bincount(recv_ids[recv_ids >= 0], minlength=per_rank_experts).tolist()
        assert recv_ids.shape == (sum(recvs), k)
        return recv_x, recv_ids, recv_weights, counts, (token, sends, recvs), EventOverlap()

    def combine(self, x, handle, topk_weights=None, **_):
        token, sends, recvs = handle
        assert x.shape[0] == sum(recvs), (x.shape, recvs)
        back = _all_to_all(x, sends, recvs, self.group)  # in dispatch order
        out = torch.zeros(self._layout[1].shape[0], x.shape[1], dtype=torch.float32)
        return out.index_add_(0, token, back.float()).to(x.dtype), None, EventOverlap()


def _all_to_all(t: torch.Tensor, recv_splits, send_splits, group) -> torch.Tensor:
    out = t.new_empty((sum(recv_splits), *t.shape[1:]))
    dist.all_to_all_single(out, t.contiguous(), recv_splits, send_splits, group=group)
    return out
