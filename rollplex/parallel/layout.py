"""The one table of tensor-parallel placements of every Qwen2.5-VL parameter, training and rollout.

Megatron-LM's scheme (Shoeybi et al., arXiv:1909.08053 §3): a linear layer is column-parallel when
its output dimension is split (each rank computes some output features from the whole input) and
row-parallel when its input dimension is split (each rank computes a partial sum of every output
feature, summed by an all-reduce). In a decoder layer q/k/v and gate/up are column-parallel, o_proj and
down_proj row-parallel, so one all-reduce per block suffices; the token embedding and the LM head are
split over vocabulary rows; norms and the whole vision tower (its MLP width, 3420 in 3B/7B, is not
divisible by 8) are replicated.

Training (TP_train) and rollout (TP_rollout) use the same placement at their own degree: shard i of n
rows is rows [i·n/tp, (i+1)·n/tp) — whole query heads for q, whole key/value heads for k/v (the
degree divides both head counts: parallel.dist.check_heads). Rollout shard r is then the union of the
q = TP_train/TP_rollout consecutive training shards r·q … r·q + q − 1, which is what lets one
physical copy serve both (parallel.weight_sharing):

    ``buffer``   the rollout buffer the weight is a segment of: each layer's q/k/v weights share one
                 [q_r; k_r; v_r] buffer ("qkv"), their biases another ("qkv_bias"), gate/up one
                 [gate_r; up_r] ("gate_up"); "" = its own buffer.
    ``storage``  "rows": stored as declared ([out, in]); "transposed": stored [in, out] so that a
                 row-parallel shard (input columns) is a contiguous slab of rows (paper §3.3, Case 2).

Names are the in-memory names of transformers 5 (``model.language_model.*``, ``model.visual.*``,
``lm_head``). A tied LM head (3B) is the embedding parameter itself and has one entry's placement.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum


class Placement(Enum):
    """How a parameter is split across a TP group (``dim`` is the split dimension of [out, in])."""

    COLUMN = "column"  # output rows split (dim 0): q/k/v weights and biases, gate, up
    ROW = "row"  # input columns split (dim 1): o_proj, down_proj; outputs all-reduced
    VOCAB = "vocab"  # vocabulary rows split (dim 0): embed_tokens, lm_head
    REPLICATED = "replicated"  # every rank holds all of it: norms, vision tower, merger

    @property
    def dim(self) -> int | None:
        return {"column": 0, "row": 1, "vocab": 0}.get(self.value)


@dataclass(frozen=True)
class Entry:
    """One row of ``LAYOUT``: parameters whose name fully matches ``pattern``.

    Fields: ``train`` and ``rollout`` placements, ``unit`` (what the split dimension counts), ``buffer``
    and ``storage`` (module docstring).
    """

    pattern: str
    train: Placement
    rollout: Placement
    unit: str
    buffer: str = ""
    storage: str = "rows"


_LAYER = r"model\.language_model\.layers\.\d+\."
C, R, V, X = Placement.COLUMN, Placement.ROW, Placement.VOCAB, Placement.REPLICATED
LAYOUT: tuple[Entry, ...] = (
    Entry(_LAYER + r"self_attn\.q_proj\.weight", C, C, "query heads", "qkv"),
    Entry(_LAYER + r"self_attn\.k_proj\.weight", C, C, "key/value heads", "qkv"),
    Entry(_LAYER + r"self_attn\.v_proj\.weight", C, C, "key/value heads", "qkv"),
    Entry(_LAYER + r"self_attn\.q_proj\.bias", C, C, "query heads", "qkv_bias"),
    Entry(_LAYER + r"self_attn\.k_proj\.bias", C, C, "key/value heads", "qkv_bias"),
    Entry(_LAYER + r"self_attn\.v_proj\.bias", C, C, "key/value heads", "qkv_bias"),
    Entry(_LAYER + r"self_attn\.o_proj\.weight", R, R, "query heads (input)", storage="transposed"),
    Entry(_LAYER + r"mlp\.gate_proj\.weight", C, C, "MLP rows", "gate_up"),
    Entry(_LAYER + r"mlp\.up_proj\.weight", C, C, "MLP rows", "gate_up"),
    Entry(_LAYER + r"mlp\.down_proj\.weight", R, R, "MLP rows (input)", storage="transposed"),
    Entry(_LAYER + r"(input|post_attention)_layernorm\.weight", X, X, "-"),
    Entry(r"model\.language_model\.norm\.weight", X, X, "-"),
    Entry(r"model\.language_model\.embed_tokens\.weight", V, V, "vocabulary rows"),
    Entry(r"lm_head\.weight", V, V, "vocabulary rows"),
    Entry(r"model\.visual\..+", X, X, "-"),
)
_COMPILED = tuple(re.compile(e.pattern) for e in LAYOUT)


def matches(name: str) -> list[Entry]:
    """Every ``LAYOUT`` entry whose pattern fully matches ``name`` (a correct table gives exactly one)."""
    return [e for e, rx in zip(LAYOUT, _COMPILED, strict=True) if rx.fullmatch(name)]


def entry(name: str) -> Entry:
    """The ``LAYOUT`` entry of parameter ``name``.

    Raises:
        ValueError: no entry or several entries match ``name``.
    """
    found = matches(name)
    if len(found) != 1:
        raise ValueError(f"parameter {name!r} matches {len(found)} tensor-parallel layout entries, not 1")
    return found[0]


def is_language_model(name: str) -> bool:
    """Whether ``name`` is a language-model parameter (the paper's Case percentages count only these)."""
    return name.startswith("model.language_model.") or name.startswith("lm_head.")


def _placement(name: str, role: str) -> Placement:
    if role not in ("train", "rollout"):
        raise ValueError(f"layout role {role!r}: expected train or rollout")
    return getattr(entry(name), role)


def shard_bounds(
    name: str, shape: tuple[int, ...], tp: int, rank: int, role: str = "train"
) -> tuple[int, int]:
    """(start, stop) of ``rank``'s shard along the split dimension of parameter ``name`` with full shape
    ``shape`` in a TP group of ``tp``; (0, size of dim 0) for a replicated one.

    Raises:
        ValueError: unknown name, a bad ``rank``, or a split dimension not divisible by ``tp``.
    """
    if not 0 <= rank < tp:
        raise ValueError(f"tensor-parallel rank {rank} outside a group of {tp}")
    dim = _placement(name, role).dim
    if dim is None:
        return 0, shape[0]
    size = shape[dim]
    if size % tp:
        raise ValueError(f"{name}: dimension {dim} of size {size} is not divisible by the TP degree {tp}")
    n = size // tp
    return rank * n, rank * n + n


def shard_shape(
    name: str, shape: tuple[int, ...], tp: int, rank: int, role: str = "train"
) -> tuple[int, ...]:
    """Shape of ``rank``'s shard of parameter ``name`` (full ``shape``) at TP degree ``tp``, in its
    logical orientation ([out, in] for weights; storage may be transposed, ``Entry.storage``).
    ``role`` picks the training or rollout placement (equal in rollplex's table).

    Example: q_proj.weight of 32B, (5120, 5120), tp 8 -> (640, 5120); o_proj.weight -> (5120, 640).

    Raises:
        ValueError: as ``shard_bounds``.
    """
    start, stop = shard_bounds(name, shape, tp, rank, role)
    dim = _placement(name, role).dim
    if dim is None:
        return tuple(shape)
    return tuple(stop - start if d == dim else s for d, s in enumerate(shape))


def shard_index(
    name: str, shape: tuple[int, ...], tp: int, rank: int, role: str = "train"
) -> tuple[slice, ...]:
    """Index of ``rank``'s shard in the full tensor: ``full[shard_index(...)]`` is the shard.

    Raises:
        ValueError: as ``shard_bounds``.
    """
    start, stop = shard_bounds(name, shape, tp, rank, role)
    dim = _placement(name, role).dim
    if dim is None:
        return (slice(None),)
    return (slice(None),) * dim + (slice(start, stop),)


def shard_shapes(
    named_shapes: Iterable[tuple[str, tuple[int, ...]]], tp: int, rank: int, role: str = "train"
) -> dict[str, tuple[int, ...]]:
    """Per-rank shapes of every parameter (what the memory planner sizes): name -> ``shard_shape``."""
    return {name: shard_shape(name, tuple(shape), tp, rank, role) for name, shape in named_shapes}


def undivided_size(text_config, tp: int) -> tuple[str, int] | None:
    """The first language-model size a TP degree ``tp`` must divide and does not, as (what, size):
    attention heads, key/value heads (whole heads per rank: 7B's 3584 query rows split by 8 would be
    448 rows, 3.5 heads), MLP width, vocabulary; None when ``tp`` divides them all."""
    sizes = (
        ("attention heads", text_config.num_attention_heads),
        ("key/value heads", text_config.num_key_value_heads),
        ("MLP width (intermediate_size)", text_config.intermediate_size),
        ("vocabulary size", text_config.vocab_size),
    )
    return next(((what, size) for what, size in sizes if size % tp), None)
