"""ForwardBatch: one engine step's tokens, flattened across requests, with paged-KV metadata.

Tokens of all scheduled requests are concatenated (ragged): request `b` owns flat positions
`cu_q_lens[b]:cu_q_lens[b+1]`. Its cache holds `seq_lens[b]` tokens after this step (the new
ones included); `page_table[b]` lists its pages, `slot_mapping[t]` is where token `t`'s K/V go
(`page * page_size + offset`). Logits are computed only at `logits_indices` (the last new token
of each request, or its last `logits_per_seq[b]` ones: a speculative step's verified drafts)
unless `all_logits` is set, as parity tests need.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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
    # each request's prompt length, where the builder gave them (the DSA indexer's CPU tie rule)
    prompt_lens_cpu: tuple[int, ...] = ()
    # the page table on the host (planning reads it there without waiting for the GPU)
    page_table_cpu: torch.Tensor | None = None
    # the int64 and int32 fields above, each group one tensor that they are views of: one copy
    # per group moves a batch to the GPU
    packed: tuple[torch.Tensor, torch.Tensor] | None = None

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
        logits_per_seq: list[int] | None = None,
        prompt_lens: list[int] | None = None,
    ) -> ForwardBatch:
        """Build from per-request new tokens, the position of their first one, and page lists;
        `logits_per_seq`: how many of each request's last tokens get logits (default 1);
        `prompt_lens`: each request's prompt length (default: not known)."""
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
        table = [p for t in page_tables for p in t + [0] * (max_pages - len(t))]
        ids = [t for ids in token_ids for t in ids]
        per_seq = logits_per_seq if logits_per_seq is not None else [1] * len(q_lens)
        rows = [end - m + i for end, m in zip(cu[1:], per_seq, strict=True) for i in range(m)]
        # NOTE: through numpy: torch.tensor(list) costs ~5x np.array(list) on the host, and
        # a decode step's host time adds to its latency
        packed = (
            torch.from_numpy(np.array(ids + positions + slots + rows, dtype=np.int64)),
            torch.from_numpy(np.array(seq_lens + q_lens + cu + table, dtype=np.int32)),
        )
        host = cls._unpack(
            packed, len(ids), len(q_lens), max_pages, page_size, all_logits, len(rows)
        )
        host.seq_lens_cpu, host.q_lens_cpu = tuple(seq_lens), tuple(q_lens)
        host.prompt_lens_cpu = tuple(prompt_lens or ())
        host.page_table_cpu = host.page_table
        return host.to(device)

    def to(self, device: torch.device | str) -> ForwardBatch:
        """This batch with its tensors on `device`: two copies (see `packed`)."""
        if self.packed is None:
            raise ValueError("only a batch made by ForwardBatch.build can be moved")
        if self.packed[0].device == torch.device(device):
            return self
        packed = tuple(t.to(device, non_blocking=True) for t in self.packed)
        moved = self._unpack(
            packed,
            self.input_ids.shape[0],
            self.num_seqs,
            self.page_table.shape[1],
            self.page_size,
            self.all_logits,
            self.logits_indices.shape[0],
        )
        moved.seq_lens_cpu, moved.q_lens_cpu = self.seq_lens_cpu, self.q_lens_cpu
        moved.prompt_lens_cpu = self.prompt_lens_cpu
        moved.page_table_cpu = self.page_table_cpu
        return moved

    @classmethod
    def _unpack(
        cls,
        packed: tuple[torch.Tensor, torch.Tensor],
        tokens: int,
        seqs: int,
        max_pages: int,
        page_size: int,
        all_logits: bool,
        num_logits: int,
    ) -> ForwardBatch:
        longs, ints = packed
        input_ids, positions, slots, logits = longs.split([tokens, tokens, tokens, num_logits])
        seq_lens, q_lens, cu, table = ints.split([seqs, seqs, seqs + 1, seqs * max_pages])
        return cls(
            input_ids=input_ids,
            positions=positions,
            seq_lens=seq_lens,
            q_lens=q_lens,
            cu_q_lens=cu,
            page_table=table.view(seqs, max_pages),
            slot_mapping=slots,
            logits_indices=logits,
            page_size=page_size,
            all_logits=all_logits,
            packed=packed,
        )
