"""Torch reference backend: plain PyTorch ops, CPU and CUDA, the oracle for faster backends.

Attention loops over requests and gathers each one's pages; softmax runs in float32 like
Hugging Face's eager attention, so parity tests against transformers can use tight tolerances.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from snapfn.handler.llm.config import MoEConfig
from snapfn.handler.llm.kernels.base import Backend, ExpertWeights
from snapfn.handler.llm.weights.quant import dequantize_fp8_block


class TorchBackend(Backend):
    name = "torch"

    def linear(self, x, weight, bias=None, weight_scale_inv=None):
        if weight.dtype == torch.float32 and weight_scale_inv is None:
            x = x.float()  # a float32 module: its product in float32, whatever x's dtype
        return F.linear(x, self._dense_weight(weight, weight_scale_inv, x.dtype), bias)

    def rms_norm(self, x, weight, eps):
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        total = x + residual
        return rms_norm(total, weight, eps), total

    def rope_store_kv(self, q, k, v, cos, sin, interleaved, k_cache, v_cache, batch):
        self.store_kv(k_cache, apply_rotary(k, cos, sin, interleaved), batch)
        self.store_kv(v_cache, v, batch)
        return apply_rotary(q, cos, sin, interleaved)

    def route(self, logits, correction_bias, moe):
        return noaux_tc_route(logits, correction_bias, moe)

    def rope_part(self, x, cos, sin, interleaved, start):
        return rope_part(x, cos, sin, interleaved, start)

    def silu_mul(self, gate_up):
        return silu_mul(gate_up)

    def store_kv(self, cache, values, batch):
        flat = cache.view(-1, *cache.shape[2:])
        flat.index_copy_(0, batch.slot_mapping, values.to(cache.dtype))

    def gather_seq(self, cache, batch, seq):
        seq_len = batch.seq_lens_cpu[seq]
        num_pages = -(-seq_len // batch.page_size)
        pages = batch.page_table[seq, :num_pages].long()
        return cache[pages].flatten(0, 1)[:seq_len]

    def paged_attention(self, q, k_cache, v_cache, batch, scale):
        if batch.is_decode:
            return decode_attention(q, k_cache, v_cache, batch.page_table, batch.seq_lens, scale)
        out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
        start = 0
        for b, (q_len, seq_len) in enumerate(
            zip(batch.q_lens_cpu, batch.seq_lens_cpu, strict=True)
        ):
            k = self.gather_seq(k_cache, batch, b)  # [L, Hkv, D]
            v = self.gather_seq(v_cache, batch, b)
            qb = q[start : start + q_len]  # [q, Hq, D]
            out[start : start + q_len] = causal_attention(qb, k, v, seq_len - q_len, scale)
            start += q_len
        return out

    def moe(self, x, experts: ExpertWeights, topk_ids, topk_weights):
        out = torch.zeros_like(x, dtype=torch.float32)
        local_ids = topk_ids - experts.first_expert
        hit = torch.unique(local_ids[(local_ids >= 0) & (local_ids < experts.num_local)])
        for e in hit.tolist():
            token_idx, slot = torch.where(local_ids == e)
            h = x[token_idx]
            gate = self.linear(h, experts.gate[e], None, _row(experts.gate_scale_inv, e))
            up = self.linear(h, experts.up[e], None, _row(experts.up_scale_inv, e))
            y = self.linear(
                F.silu(gate) * up, experts.down[e], None, _row(experts.down_scale_inv, e)
            )
            out.index_add_(0, token_idx, (y * topk_weights[token_idx, slot, None]).float())
        return out.to(x.dtype)

    def dsa_topk(self, q, weights, k_cache, batch, topk, scale):
        on_cpu = q.device.type == "cpu"
        if batch.is_decode and not on_cpu:
            return _topk_decode(q, weights, k_cache, batch.page_table, batch.seq_lens, topk, scale)
        out = torch.full((q.shape[0], topk), -1, dtype=torch.int32, device=q.device)
        start = 0
        for b, (q_len, seq_len) in enumerate(
            zip(batch.q_lens_cpu, batch.seq_lens_cpu, strict=True)
        ):
            k = self.gather_seq(k_cache, batch, b)  # [L, Di]
            rows, q_offset = slice(start, start + q_len), seq_len - q_len
            scores = self._prefill_index_scores(q[rows], weights[rows], k, q_offset, scale)
            if on_cpu:
                prompt_len = batch.prompt_lens_cpu[b] if batch.prompt_lens_cpu else 0
                out[rows] = pick_as_cpu_topk(scores, q_offset, topk, prompt_len)
            else:
                out[rows] = pick_causal_topk(scores, q_offset, topk)
            start += q_len
        return out

    def _prefill_index_scores(self, q, weights, k, q_offset, scale):
        """`index_scores_one_seq`: the indexer's scores of one request's prefill chunk."""
        return index_scores_one_seq(q, weights, k, q_offset, scale)

    def mla_attention(
        self, q, latent_cache, kv_b_weight, kv_b_scale_inv, batch, scale, topk_indices=None
    ):
        if batch.is_decode:
            latent = latent_cache[batch.page_table.long()].flatten(1, 2)  # [B, W*S, R + Dr]
            w = self._dense_weight(kv_b_weight, kv_b_scale_inv, q.dtype)
            return mla_decode_absorbed(q, latent, w, batch.seq_lens, scale, topk_indices)
        outs, start = [], 0
        for b, (q_len, seq_len) in enumerate(
            zip(batch.q_lens_cpu, batch.seq_lens_cpu, strict=True)
        ):
            latent = self.gather_seq(latent_cache, batch, b)  # [L, R + Dr]
            k, v = self._expand_latent(latent, kv_b_weight, kv_b_scale_inv, q.shape)
            rows = slice(start, start + q_len)
            mask = None if topk_indices is None else topk_mask(topk_indices[rows], seq_len)
            outs.append(causal_attention(q[rows], k, v, seq_len - q_len, scale, mask))
            start += q_len
        return torch.cat(outs)

    def _dense_weight(self, weight, scale_inv, dtype):
        """`weight` in `dtype`, dequantized when it is FP8 (`scale_inv` given)."""
        if scale_inv is not None:
            return dequantize_fp8_block(weight, scale_inv, dtype)
        return weight.to(dtype)

    def _expand_latent(self, latent, kv_b_weight, kv_b_scale_inv, q_shape):
        """`latent [..., L, R + Dr]` -> per-head `k [..., L, H, Dn + Dr]`, `v [..., L, H, Dv]`."""
        num_heads, rank = q_shape[1], kv_b_weight.shape[1]
        rope_dim = latent.shape[-1] - rank
        nope_dim = q_shape[2] - rope_dim
        v_dim = kv_b_weight.shape[0] // num_heads - nope_dim
        kv = self.linear(latent[..., :rank], kv_b_weight, None, kv_b_scale_inv)
        k_nope, v = kv.unflatten(-1, (num_heads, nope_dim + v_dim)).split([nope_dim, v_dim], -1)
        k_rope = latent[..., None, rank:].expand(*k_nope.shape[:-1], rope_dim)
        return torch.cat([k_nope, k_rope], dim=-1), v


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32, the weight applied after casting back (as
    Hugging Face does)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """Rotate `x [T, H, dim]` by per-token `cos/sin [T, dim/2]`: pairs `(x[i], x[i + dim/2])`
    (half-split, Llama) or `(x[2i], x[2i + 1])` (interleaved, written back half-split as
    DeepSeek's MLA expects)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def noaux_tc_route(
    logits: torch.Tensor, correction_bias: torch.Tensor, moe: MoEConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's `noaux_tc` routing of router `logits [T, E]` (float32), as Hugging Face
    runs it: sigmoid scores plus `correction_bias` choose the experts (the best `topk_group` of
    `n_group` groups, each group ranked by its two best experts), while the weights are the
    unbiased scores, renormalised (`norm_topk_prob`) and scaled by `routed_scaling_factor`."""
    scores = logits.sigmoid()  # [T, E]
    choice = scores + correction_bias
    grouped = choice.view(-1, moe.n_group, moe.n_routed_experts // moe.n_group)  # [T, G, E/G]
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
    group_idx = group_scores.topk(moe.topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(-1, moe.n_routed_experts)
    choice = choice.masked_fill(~expert_mask.bool(), float("-inf"))
    topk_ids = choice.topk(moe.num_experts_per_tok, dim=-1, sorted=False)[1]  # [T, k]
    topk_weights = scores.gather(1, topk_ids)
    if moe.norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_ids, topk_weights * moe.routed_scaling_factor


def rope_part(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, start: int
) -> torch.Tensor:
    """`x [T, H, D]` with dims `start : start + dim` rotated by `apply_rotary` (`cos/sin
    [T, dim/2]`) and the others as they were: MLA's and DSA's partial RoPE."""
    end = start + 2 * cos.shape[-1]
    rotated = apply_rotary(x[..., start:end], cos, sin, interleaved)
    return torch.cat([x[..., :start], rotated, x[..., end:]], dim=-1)


def _row(t: torch.Tensor | None, e: int) -> torch.Tensor | None:
    return None if t is None else t[e]


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation of a fused `gate | up` projection: `silu(gate) * up`."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def causal_attention(
    q: torch.Tensor,  # [q, Hq, D]
    k: torch.Tensor,  # [L, Hkv, D]
    v: torch.Tensor,  # [L, Hkv, Dv]
    q_offset: int,
    scale: float,
    extra_mask: torch.Tensor | None = None,  # [q, L] bool, True = may attend
) -> torch.Tensor:  # [q, Hq, Dv]
    """Softmax attention where query `i` (absolute position `q_offset + i`) sees keys `<= i`."""
    num_rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(num_rep, dim=1)
    v = v.repeat_interleave(num_rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k).float() * scale  # [Hq, q, L]
    q_pos = torch.arange(q.shape[0], device=q.device) + q_offset
    allowed = torch.arange(k.shape[0], device=q.device)[None, :] <= q_pos[:, None]
    if extra_mask is not None:
        allowed = allowed & extra_mask
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.einsum("hqk,khd->qhd", probs, v)


def index_scores_one_seq(
    q: torch.Tensor,  # [q, Hi, Di] one request's chunk of rotated indexer queries
    weights: torch.Tensor,  # [q, Hi] float32
    k: torch.Tensor,  # [L, Di] the request's keys
    q_offset: int,  # the chunk's first position
    scale: float,
) -> torch.Tensor:  # [q, L] float32, -inf at keys after each query
    """The DSA indexer's scores of one request's prefill chunk: `sum_h weights[t, h] *
    relu(scale * q[t, h] . k[l])` (the oracle of `triton.indexer.index_scores_prefill`)."""
    # op order as Hugging Face's GlmMoeDsaIndexer, so near-ties resolve alike
    scores = torch.matmul(q.float(), k.float().T) * scale  # [q, Hi, L]
    scores = F.relu(scores)
    index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # [q, L]
    causal = _causal_mask(q.shape[0], k.shape[0], q_offset, q.device)  # [q, L]
    return index_scores.masked_fill(~causal, float("-inf"))


def pick_causal_topk(index_scores: torch.Tensor, q_offset: int, topk: int) -> torch.Tensor:
    """`[q, L]` scores of one request's chunk (-inf after each query) → `[q, topk]` int32 key
    positions as `select_topk` orders them: a query with at most `topk` causal keys gets all of
    them in position order, one with more its `topk` best, highest first, the earlier key first
    among equals; -1 where keys run out."""
    num_q, num_k = index_scores.shape
    causal = _causal_mask(num_q, num_k, q_offset, index_scores.device)  # [q, L]
    # NOTE: exact ties are common (relu zeroes every head's score of many keys); torch.topk
    # breaks them by row length, so chunking would change the selection. A stable sort keeps
    # the earliest tied keys, whatever the chunking. Without ties it picks what topk picks.
    order = index_scores.sort(dim=-1, descending=True, stable=True).indices
    picked = order[:, : min(topk, num_k)]  # [q, k']
    keys = torch.arange(num_q, device=picked.device)[:, None] + q_offset + 1  # causal keys
    in_order = torch.arange(picked.shape[1], device=picked.device)[None, :]
    picked = torch.where(keys <= topk, in_order, picked)
    # rows with fewer causal keys than topk pick masked keys too: drop them
    picked = picked.masked_fill(~causal.gather(1, picked), -1)
    return F.pad(picked, (0, topk - picked.shape[1]), value=-1).to(torch.int32)  # [q, topk]


def pick_as_cpu_topk(
    index_scores: torch.Tensor, q_offset: int, topk: int, prompt_len: int
) -> torch.Tensor:
    """`[q, L]` scores of one request's chunk (-inf after each query) → `[q, topk]` int32 key
    positions (-1 past them), picked as transformers' GlmMoeDsaIndexer picks them on a CPU:
    `torch.topk` over the row its forward scores. A prompt position's row spans the whole
    prompt (`prompt_len` keys, -inf after the position: the prompt's one forward), a generated
    position's its keys so far (a decode step's). NOTE: on a CPU `torch.topk` breaks exact ties
    (common: relu zeroes every head's score of many keys) by its selection algorithm, which
    depends on the row's length; the row here is a function of the position and the prompt's
    length, so chunking, a verify step or a recompute pick what one prompt forward and then
    one decode step a token pick. On a GPU `torch.topk`, and `pick_causal_topk`, keep the
    earlier key."""
    num_q, num_k = index_scores.shape
    positions = list(range(q_offset, q_offset + num_q))
    out = torch.full((num_q, topk), -1, dtype=torch.int32, device=index_scores.device)
    in_prompt = sum(p < prompt_len for p in positions)  # NOTE: the chunk's first rows
    if in_prompt:
        rows = index_scores[:in_prompt, :prompt_len]  # [n, <= P], -inf after each position
        rows = F.pad(rows, (0, prompt_len - rows.shape[1]), value=-torch.inf)  # [n, P]
        picked = rows.topk(min(topk, prompt_len), dim=-1).indices
        out[:in_prompt, : picked.shape[1]] = picked.to(torch.int32)
    for r in range(in_prompt, num_q):
        row = index_scores[r, : positions[r] + 1]  # a decode step's: the keys so far
        picked = row.topk(min(topk, row.shape[0])).indices
        out[r, : picked.shape[0]] = picked.to(torch.int32)
    after = out.long() > torch.tensor(positions, device=out.device)[:, None]  # -inf ones
    return out.masked_fill(after, -1)


def _causal_mask(num_q: int, num_k: int, q_offset: int, device: torch.device) -> torch.Tensor:
    q_pos = torch.arange(num_q, device=device) + q_offset
    return torch.arange(num_k, device=device)[None, :] <= q_pos[:, None]  # [q, L]


def topk_mask(topk_indices: torch.Tensor, num_keys: int) -> torch.Tensor:
    """`[q, topk]` key indices (-1 = none) as a `[q, num_keys]` bool mask, True = selected."""
    slots = topk_indices.long().masked_fill(topk_indices < 0, num_keys)  # -1 -> a spare column
    mask = torch.zeros(
        topk_indices.shape[0], num_keys + 1, dtype=torch.bool, device=topk_indices.device
    )
    return mask.scatter_(1, slots, True)[:, :num_keys]


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D], one new token per request
    k_cache: torch.Tensor,  # [P, S, Hkv, D]
    v_cache: torch.Tensor,  # [P, S, Hkv, Dv]
    page_table: torch.Tensor,  # [B, W] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
) -> torch.Tensor:  # [B, Hq, Dv]
    """Vectorised decode attention with fixed shapes (no host syncs): CUDA-graph capturable."""
    b, hq, d = q.shape
    pages = page_table.long()
    k = k_cache[pages].flatten(1, 2)  # [B, W*S, Hkv, D]
    v = v_cache[pages].flatten(1, 2)  # [B, W*S, Hkv, Dv]
    hkv = k.shape[2]
    qg = q.view(b, hkv, hq // hkv, d)  # [B, Hkv, rep, D]
    scores = torch.einsum("bgrd,blgd->bgrl", qg, k).float() * scale  # [B, Hkv, rep, L]
    valid = torch.arange(k.shape[1], device=q.device)[None, :] < seq_lens[:, None].long()  # [B, L]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.einsum("bgrl,blgd->bgrd", probs, v).reshape(b, hq, v.shape[-1])


def _topk_decode(q, weights, k_cache, page_table, seq_lens, topk, scale):
    """`dsa_topk` for one query per request with fixed shapes (no host syncs)."""
    k = k_cache[page_table.long()].flatten(1, 2)  # [B, W*S, Di]
    scores = F.relu(torch.matmul(q.float(), k.float().transpose(1, 2)) * scale)  # [B, Hi, L]
    index_scores = torch.matmul(weights.unsqueeze(1), scores).squeeze(1)  # [B, L]
    valid = torch.arange(k.shape[1], device=q.device)[None, :] < seq_lens[:, None].long()
    return select_topk(index_scores.masked_fill(~valid, float("-inf")), seq_lens, topk)


def select_topk(index_scores: torch.Tensor, seq_lens: torch.Tensor, topk: int) -> torch.Tensor:
    """`[B, L]` decode index scores (-inf past each request's keys) → `[B, topk]` int32 key
    positions: a request with at most `topk` keys gets them all in position order (attention
    reads the selection as a set, and no sort is needed); one with more gets its `topk` best,
    highest first, the earlier key first among equals. -1 where keys run out."""
    index_scores = F.pad(index_scores, (0, max(0, topk - index_scores.shape[1])), value=-torch.inf)
    picked = index_scores.sort(dim=-1, descending=True, stable=True).indices[:, :topk]  # [B, topk]
    in_order = torch.arange(topk, device=picked.device)[None, :]
    lens = seq_lens[:, None].long()
    picked = torch.where(lens <= topk, in_order, picked)
    return picked.masked_fill(picked >= lens, -1).to(torch.int32)


def absorb_query(q: torch.Tensor, kv_b: torch.Tensor, rank: int, rope: int):
    """`(q_latent [T, H, R], q_pe [T, H, Dr], w_v [H, Dv, R])` of `q [T, H, Dn + Dr]` and the
    dense `kv_b [H * (Dn + Dv), R]`: each head's `W_k^T q_nope` in latent space (a bmm in q's
    dtype, as flashinfer's path computes it), its RoPE part, and its `W_v`."""
    heads, nope = q.shape[1], q.shape[2] - rope
    w = kv_b.view(heads, -1, rank)  # per head: W_k [Dn, R] over W_v [Dv, R]
    q_nope, q_pe = q.split([nope, rope], dim=-1)
    q_latent = torch.bmm(q_nope.transpose(0, 1), w[:, :nope]).transpose(0, 1)
    return q_latent, q_pe, w[:, nope:]


def expand_output(out_latent: torch.Tensor, w_v: torch.Tensor) -> torch.Tensor:
    """Each head's `W_v (sum p c)`: `[T, H, R]` -> `[T, H, Dv]`."""
    return torch.bmm(out_latent.transpose(0, 1), w_v.transpose(1, 2)).transpose(0, 1)


def mla_decode_absorbed(
    q: torch.Tensor,  # [B, H, Dn + Dr], one new token per request
    latent: torch.Tensor,  # [B, L, R + Dr] each request's page row: latents | rotated k_rope
    kv_b: torch.Tensor,  # [H * (Dn + Dv), R] dense
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    topk_indices: torch.Tensor | None = None,  # [B, topk] int32, -1 = none
) -> torch.Tensor:  # [B, H, Dv]
    """MLA decode with `kv_b` absorbed into the query and the output (as FlashMLA does): the
    scores `q_nope . (W_k c) = (W_k^T q_nope) . c` and the output `W_v (sum p c)` read each
    cached latent `c` once, where expanding every latent to per-head keys and values
    costs `L * R * H * (Dn + Dv)` multiply-adds per request and layer.
    The same sums, in float32 (no host syncs: CUDA-graph capturable)."""
    heads, rank = q.shape[1], kv_b.shape[1]
    rope = latent.shape[-1] - rank
    nope = q.shape[2] - rope
    w = kv_b.float().view(heads, -1, rank)  # [H, Dn + Dv, R]
    q_nope, q_rope = q.float().split([nope, rope], dim=-1)
    c, k_rope = latent.float().split([rank, rope], dim=-1)  # [B, L, R], [B, L, Dr]
    q_latent = torch.einsum("bhd,hdr->bhr", q_nope, w[:, :nope])  # [B, H, R]
    scores = torch.einsum("bhr,blr->bhl", q_latent, c) + torch.einsum(
        "bhd,bld->bhl", q_rope, k_rope
    )
    allowed = torch.arange(c.shape[1], device=q.device)[None, :] < seq_lens[:, None].long()
    if topk_indices is not None:
        allowed = allowed & topk_mask(topk_indices, c.shape[1])
    probs = torch.softmax((scores * scale).masked_fill(~allowed[:, None, :], float("-inf")), -1)
    out_latent = torch.einsum("bhl,blr->bhr", probs, c)  # [B, H, R]
    return torch.einsum("bhr,hvr->bhv", out_latent, w[:, nope:]).to(q.dtype)
