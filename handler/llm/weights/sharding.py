"""Tensor- and expert-parallel sharding rules: one table per architecture, applied by name.

Every checkpoint tensor name (Hugging Face spelling) matches exactly one rule giving its
`Placement`; a name that matches none is refused, never given a silent default. Kinds:

- `column`: split the output dim (dim 0 of an `nn.Linear` weight, and its bias).
- `row`: split the input dim (dim 1). A row-parallel layer's bias is `replicated`: the model adds
  it once, after the all-reduce.
- `vocab`: split the rows (dim 0) of the embedding and of `lm_head` in blocks of
  `ceil(vocab / tp)` (`vocab_split`: the last rank's block may be short; the model pads it).
- `replicated`: every rank holds the whole tensor.
- `expert`: a routed expert's linear. Whole experts go to ep ranks in contiguous blocks (rank `r`
  owns experts `[r*E/ep, (r+1)*E/ep)`). When `ep_size > 1` ep replaces tp for experts: an owned
  expert is loaded whole, never tp-split. When `ep_size == 1` every rank owns every expert and
  splits it like a dense MLP along `dim` (gate/up: 0, down: 1).

Heads: q (llama) and q_b/kv_b (MLA) are split evenly on dim 0, which is a split by heads only
when the head count divides by tp: the model builder calls `validate_head_split` once. k/v
(`kv`) are split by heads when `num_kv_heads` divides by tp, and replicated when tp divides by
it (fewer k/v heads than ranks: rank `r` holds head `r * num_kv_heads // tp`, the one its q
heads read, as vLLM does); any other count is refused.

MLA: `q_a_proj`, `kv_a_proj_with_mqa` and their layernorms produce the low-rank latent that every
head reads, and the DSA indexer scores tokens once for all heads, so all are replicated.

FP8: `X.weight_scale_inv` follows `X.weight`'s placement on the 128x128 block grid. A split of
an FP8 weight must fall on block boundaries (the per-rank size is a multiple of 128), else it is
refused. Every split must also be even: a dim that does not divide by the rank count is refused.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch

from snapfn.handler.llm.parallel import ParallelConfig
from snapfn.handler.llm.weights.quant import FP8_BLOCK, FP8_DTYPE, scale_shape
from snapfn.snapshot.errors import CheckpointError, UnsupportedModel

KINDS = ("column", "row", "replicated", "expert", "vocab", "kv")
SCALE_SUFFIX = ".weight_scale_inv"


@dataclass(frozen=True)
class Placement:
    """Where a tensor lives across ranks. `dim` is the dim split by tp (None: never split)."""

    kind: str
    dim: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"placement kind {self.kind!r} is not one of {KINDS}")
        if (self.kind == "replicated") != (self.dim is None):
            raise ValueError(
                f"placement {self.kind!r} with dim={self.dim}: only 'replicated' has none"
            )


COLUMN = Placement("column", 0)
ROW = Placement("row", 1)
VOCAB = Placement("vocab", 0)
KV_HEADS = Placement("kv", 0)
REPLICATED = Placement("replicated")
EXPERT_COLUMN = Placement("expert", 0)
EXPERT_ROW = Placement("expert", 1)


_LAYER = r"model\.layers\.\d+\."
# embeddings, the head and the norms: the same in every architecture
_COMMON_RULES = (
    (r"model\.embed_tokens\.weight", VOCAB),
    (r"lm_head\.weight", VOCAB),
    (r"model\.norm\.weight", REPLICATED),
    (_LAYER + r"(input|post_attention)_layernorm\.weight", REPLICATED),
)


def _compile(*rules: tuple[str, Placement]) -> tuple[tuple[re.Pattern[str], Placement], ...]:
    return tuple(
        (re.compile(pattern), placement) for pattern, placement in (*_COMMON_RULES, *rules)
    )


LLAMA_RULES = _compile(
    (_LAYER + r"self_attn\.q_proj\.(weight|bias)", COLUMN),
    (_LAYER + r"self_attn\.[kv]_proj\.(weight|bias)", KV_HEADS),
    (_LAYER + r"self_attn\.o_proj\.weight", ROW),
    (_LAYER + r"self_attn\.o_proj\.bias", REPLICATED),
    (_LAYER + r"self_attn\.[qk]_norm\.weight", REPLICATED),  # per head_dim, shared by heads
    (_LAYER + r"self_attn\.rotary_emb\.inv_freq", REPLICATED),  # old checkpoints carry it
    (_LAYER + r"mlp\.(gate|up)_proj\.(weight|bias)", COLUMN),
    (_LAYER + r"mlp\.down_proj\.weight", ROW),
    (_LAYER + r"mlp\.down_proj\.bias", REPLICATED),
)

GLM_MOE_DSA_RULES = _compile(
    (_LAYER + r"self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.(weight|bias)", REPLICATED),
    (_LAYER + r"self_attn\.(q_a_layernorm|kv_a_layernorm)\.weight", REPLICATED),
    (_LAYER + r"self_attn\.(q_b_proj|kv_b_proj)\.weight", COLUMN),
    (_LAYER + r"self_attn\.o_proj\.weight", ROW),
    (_LAYER + r"self_attn\.o_proj\.bias", REPLICATED),
    (_LAYER + r"self_attn\.indexer\.(wq_b|wk|weights_proj)\.weight", REPLICATED),
    (_LAYER + r"self_attn\.indexer\.k_norm\.(weight|bias)", REPLICATED),
    (_LAYER + r"mlp\.experts\.\d+\.(gate|up)_proj\.weight", EXPERT_COLUMN),
    (_LAYER + r"mlp\.experts\.\d+\.down_proj\.weight", EXPERT_ROW),
    (_LAYER + r"mlp\.gate\.(weight|e_score_correction_bias)", REPLICATED),  # the router
    (_LAYER + r"mlp\.(shared_experts\.)?(gate|up)_proj\.weight", COLUMN),
    (_LAYER + r"mlp\.(shared_experts\.)?down_proj\.weight", ROW),
    # multi-token-prediction layer extras
    (_LAYER + r"(eh_proj|enorm|hnorm|shared_head\.norm)\.weight", REPLICATED),
    (_LAYER + r"(embed_tokens|shared_head\.head)\.weight", VOCAB),
)

RULES_BY_ARCH = MappingProxyType(
    {
        "llama": LLAMA_RULES,
        "qwen2": LLAMA_RULES,
        "qwen3": LLAMA_RULES,
        "mistral": LLAMA_RULES,
        "glm_moe_dsa": GLM_MOE_DSA_RULES,
    }
)

_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")


def placement_for(arch: str, name: str) -> Placement:
    """The placement of checkpoint tensor `name`; a `weight_scale_inv` gets its weight's."""
    rules = RULES_BY_ARCH.get(arch)
    if rules is None:
        raise UnsupportedModel(
            f"no sharding rules for architecture {arch!r} (have: {', '.join(RULES_BY_ARCH)})"
        )
    lookup = name.removesuffix("_scale_inv") if name.endswith(SCALE_SUFFIX) else name
    for pattern, placement in rules:
        if pattern.fullmatch(lookup):
            return placement
    raise CheckpointError(f"tensor {name!r}: no {arch} sharding rule matches this name")


def expert_index(name: str) -> int | None:
    """The routed-expert index in `name` (`...mlp.experts.{e}...`), or None."""
    match = _EXPERT_INDEX.search(name)
    return int(match.group(1)) if match else None


def local_expert_range(num_experts: int, parallel: ParallelConfig) -> range:
    """The experts this ep rank owns: a contiguous block of `num_experts / ep_size`."""
    if num_experts % parallel.ep_size:
        raise UnsupportedModel(
            f"{num_experts} experts do not divide across ep_size={parallel.ep_size}"
        )
    per_rank = num_experts // parallel.ep_size
    return range(parallel.ep_rank * per_rank, (parallel.ep_rank + 1) * per_rank)


def validate_head_split(num_heads: int, num_kv_heads: int, parallel: ParallelConfig) -> None:
    """Refuse a tp size that would cut attention heads across ranks: q heads must divide by
    it, k/v heads divide by it or it by them (`local_kv_heads`)."""
    if num_heads % parallel.tp_size:
        raise UnsupportedModel(
            f"num_attention_heads={num_heads} does not divide across tp_size={parallel.tp_size}"
            " (heads are split whole)"
        )
    local_kv_heads(num_kv_heads, parallel)


def local_kv_heads(num_kv_heads: int, tp_size_or_parallel) -> int:
    """The k/v heads a tp rank holds: `num_kv_heads / tp`, or one (replicated) when there are
    fewer heads than ranks and tp divides by them; UnsupportedModel otherwise."""
    tp = getattr(tp_size_or_parallel, "tp_size", tp_size_or_parallel)
    if num_kv_heads % tp == 0:
        return num_kv_heads // tp
    if tp % num_kv_heads == 0:
        return 1
    raise UnsupportedModel(
        f"num_key_value_heads={num_kv_heads} and tp_size={tp}: neither divides the other, so"
        " the k/v heads can be neither split whole nor replicated"
    )


def shard_slice_bounds(
    shape: Sequence[int],
    placement: Placement,
    parallel: ParallelConfig,
    *,
    name: str,
    fp8: bool = False,
    num_experts: int | None = None,
    weight_shape: Sequence[int] | None = None,
    num_kv_heads: int | None = None,
) -> tuple[slice, ...] | None:
    """Index tuple of this rank's part of a tensor of `shape`; None if another ep rank owns it.

    Works on `safe_open(...).get_slice(name)[bounds]` as on tensors. `name` is the checkpoint
    name: it carries the expert index and tells a scale from a weight. `fp8`: the tensor is an FP8
    block-quantized weight, so its split must fall on 128 boundaries. For a `weight_scale_inv`
    (told by `name`), `shape` is the scale grid; pass `weight_shape` to check the split against
    the weight exactly (partial edge blocks included), else the grid is split evenly, which
    matches the weight's split whenever that one passed its own fp8 check.
    `num_experts` is needed for expert tensors when `ep_size > 1`, `num_kv_heads` for k/v
    projections when there may be fewer k/v heads than tp ranks (without it they split evenly).
    """
    if placement.kind == "kv" and parallel.tp_size > 1:
        bounds = _kv_bounds(name, shape, parallel, num_kv_heads, FP8_BLOCK if fp8 else 1)
        if bounds is not None:
            return bounds
        placement = COLUMN  # heads split whole: an even split of the rows
    if name.endswith(SCALE_SUFFIX):
        return _scale_bounds(name, shape, placement, parallel, num_experts, weight_shape)
    return _bounds(name, shape, placement, parallel, FP8_BLOCK if fp8 else 1, num_experts)


def _kv_bounds(
    name: str, shape: Sequence[int], parallel: ParallelConfig, num_kv_heads: int | None, block: int
) -> tuple[slice, ...] | None:
    """The replicated k/v head of this rank (`local_kv_heads`), or None where the heads divide
    by tp (an even split) or their count is not given (the loader always gives it)."""
    if num_kv_heads is None:
        return None
    if local_kv_heads(num_kv_heads, parallel) != 1 or num_kv_heads % parallel.tp_size == 0:
        return None
    if name.endswith(SCALE_SUFFIX) or shape[0] % num_kv_heads:
        raise UnsupportedModel(f"tensor {name!r}: k/v heads replicated across tp: not for FP8")
    rows = shape[0] // num_kv_heads
    if rows % block:
        raise UnsupportedModel(f"tensor {name!r}: an FP8 k/v head of {rows} rows")
    head = parallel.tp_rank * num_kv_heads // parallel.tp_size
    bounds = list(_whole(shape))
    bounds[0] = slice(head * rows, (head + 1) * rows)
    return tuple(bounds)


def shard_tensor(
    name: str,
    tensor: torch.Tensor,
    placement: Placement,
    parallel: ParallelConfig,
    *,
    num_experts: int | None = None,
    weight_shape: Sequence[int] | None = None,
    num_kv_heads: int | None = None,
) -> torch.Tensor | None:
    """This rank's part of `tensor` (a view; `.clone()` to free the rest), or None if not ours.

    An FP8 weight is recognised by its dtype; see `shard_slice_bounds` for the rest.
    """
    bounds = shard_slice_bounds(
        tuple(tensor.shape),
        placement,
        parallel,
        name=name,
        fp8=tensor.dtype == FP8_DTYPE,
        num_experts=num_experts,
        weight_shape=weight_shape,
        num_kv_heads=num_kv_heads,
    )
    return None if bounds is None else tensor[bounds]


def _whole(shape: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(0, size) for size in shape)


def _bounds(
    name: str,
    shape: Sequence[int],
    placement: Placement,
    parallel: ParallelConfig,
    block: int,
    num_experts: int | None,
) -> tuple[slice, ...] | None:
    if placement.kind == "expert":
        if not _owns_expert(name, parallel, num_experts):
            return None
        if parallel.ep_size > 1:
            return _whole(shape)
    if placement.dim is None or parallel.tp_size == 1:
        return _whole(shape)
    if placement.kind == "vocab":
        return _vocab_split(shape, parallel)
    return _even_split(name, shape, placement.dim, parallel, block)


def vocab_split(vocab_size: int, tp_size: int, tp_rank: int) -> tuple[int, int, int]:
    """`(start, rows, padded)`: tp rank `tp_rank`'s rows of a vocabulary of `vocab_size` split
    in `ceil(vocab / tp)` blocks (the last may be short, even empty: `rows`) and the rows it
    holds (`padded`, every rank the same; the rows past `rows` are zero)."""
    padded = -(-vocab_size // tp_size)
    start = min(tp_rank * padded, vocab_size)
    return start, min(padded, vocab_size - start), padded


def _vocab_split(shape: Sequence[int], parallel: ParallelConfig) -> tuple[slice, ...]:
    start, rows, _ = vocab_split(shape[0], parallel.tp_size, parallel.tp_rank)
    return (slice(start, start + rows), *_whole(shape)[1:])


def _owns_expert(name: str, parallel: ParallelConfig, num_experts: int | None) -> bool:
    index = expert_index(name)
    if index is None:
        raise CheckpointError(
            f"tensor {name!r}: placed as an expert but has no '.experts.N.' in its name"
        )
    if parallel.ep_size == 1:
        return True
    if num_experts is None:
        raise ValueError(f"shard {name!r} with ep_size={parallel.ep_size}: pass num_experts")
    if index >= num_experts:
        raise CheckpointError(f"tensor {name!r}: expert {index} but the model has {num_experts}")
    return index in local_expert_range(num_experts, parallel)


def _even_split(
    name: str, shape: Sequence[int], dim: int, parallel: ParallelConfig, block: int
) -> tuple[slice, ...]:
    if dim >= len(shape):
        raise CheckpointError(f"tensor {name!r} of shape {tuple(shape)} has no dim {dim} to split")
    size, tp = shape[dim], parallel.tp_size
    if size % tp:
        raise UnsupportedModel(
            f"tensor {name!r}: dim {dim} of size {size} (shape {tuple(shape)}) does not divide "
            f"across tp_size={tp}"
        )
    per_rank = size // tp
    if per_rank % block:
        raise UnsupportedModel(
            f"tensor {name!r}: FP8 split of dim {dim} (size {size}, shape {tuple(shape)}) into "
            f"{per_rank} per rank across tp_size={tp}: not a multiple of the {block}-wide scale blocks"
        )
    bounds = list(_whole(shape))
    bounds[dim] = slice(parallel.tp_rank * per_rank, (parallel.tp_rank + 1) * per_rank)
    return tuple(bounds)


def _scale_bounds(
    name: str,
    shape: Sequence[int],
    placement: Placement,
    parallel: ParallelConfig,
    num_experts: int | None,
    weight_shape: Sequence[int] | None,
) -> tuple[slice, ...] | None:
    if weight_shape is None:
        # an even split of the grid is the weight's split whenever the weight passes its fp8 check
        return _bounds(name, shape, placement, parallel, 1, num_experts)
    if tuple(shape) != scale_shape(tuple(weight_shape)):
        raise CheckpointError(
            f"tensor {name!r}: scale shape {tuple(shape)} does not match weight shape "
            f"{tuple(weight_shape)} (expected {scale_shape(tuple(weight_shape))})"
        )
    weight_name = name.removesuffix("_scale_inv")
    weight_bounds = _bounds(weight_name, weight_shape, placement, parallel, FP8_BLOCK, num_experts)
    if weight_bounds is None:
        return None
    # [a, b) on the weight -> [a/128, ceil(b/128)) on the grid; a is block-aligned (checked)
    return tuple(slice(s.start // FP8_BLOCK, -(-s.stop // FP8_BLOCK)) for s in weight_bounds)
