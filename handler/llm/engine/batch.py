"""ForwardBatch: one engine step's tokens, flattened across requests, with paged-KV metadata.

Tokens of all scheduled requests are concatenated (ragged): request `b` owns flat positions
`cu_q_lens[b]:cu_q_lens[b+1]`. Its cache holds `seq_lens[b]` tokens after this step (the new
ones included); `page_table[b]` lists its pages, `slot_mapping[t]` is where token `t`'s K/V go
(`page * page_size + offset`). Logits are computed only at `logits_indices` (the last new token
of each request) unless `all_logits` is set, as parity tests need.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    seq_lens: torch.Tensor  # [B] int32, cached tokens after this step
    q_lens: torch.Tensor  # [B] int32, new tokens this step
    cu_q_lens: torch.Tensor  # [B+1] int32
    page_table: torch.Tensor  # [B, max_pages] int32 (padded with 0)
    slot_mapping: torch.Tensor  # [T] int64
    logits_indices: torch.Tensor  # [B] int64
    page_size: int
    all_logits: bool = False
    # host copies for the reference path, which loops over requests
    seq_lens_cpu: tuple[int, ...] = ()
    q_lens_cpu: tuple[int, ...] = ()

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode(self) -> bool:
        return all(q == 1 for q in self.q_lens_cpu)

    @classmethod
    def build(
        cls,
        token_ids: list[list[int]],
        start_positions: list[int],
        page_tables: list[list[int]],
        page_size: int,
        device: torch.device | str,
        all_logits: bool = False,
    ) -> ForwardBatch:
        """Build from per-request new tokens, the position of their first one, and page lists."""
        q_lens = [len(t) for t in token_ids]
        seq_lens = [s + q for s, q in zip(start_positions, q_lens, strict=True)]
        positions = [
            p for s, q in zip(start_positions, q_lens, strict=True) for p in range(s, s + q)
        ]
        slots = [
            table[p // page_size] * page_size + p % page_size
            for table, s, q in zip(page_tables, start_positions, q_lens, strict=True)
            for p in range(s, s + q)
        ]
        cu = [0]
        for q in q_lens:
            cu.append(cu[-1] + q)
        max_pages = max(len(t) for t in page_tables)
        table = [t + [0] * (max_pages - len(t)) for t in page_tables]

        def as_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return cls(
            input_ids=as_tensor([t for ids in token_ids for t in ids], torch.int64),
            positions=as_tensor(positions, torch.int64),
            seq_lens=as_tensor(seq_lens, torch.int32),
            q_lens=as_tensor(q_lens, torch.int32),
            cu_q_lens=as_tensor(cu, torch.int32),
            page_table=as_tensor(table, torch.int32),
            slot_mapping=as_tensor(slots, torch.int64),
            logits_indices=as_tensor([c - 1 for c in cu[1:]], torch.int64),
            page_size=page_size,
            all_logits=all_logits,
            seq_lens_cpu=tuple(seq_lens),
            q_lens_cpu=tuple(q_lens),
        )
