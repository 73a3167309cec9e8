"""One physical actor copy for training (TP_train) and rollout (TP_rollout = TP_train / q): paper §3.3.

Each rank holds ONE buffer per weight sized for its ROLLOUT shard; its TRAINING shard is a view into
it. Weights are classified once by the paper's criterion (a training element and its rollout element
are the same byte, each shard contiguous):

    Case 1  the rollout shard is the union of q training shards laid out contiguously (or both are
            the full tensor: norms, vision tower): the training parameter is a view at its offset.
    Case 2  row-parallel weights (o_proj, down_proj) split their input dimension, innermost in
            [out, in]: stored transposed, [in, out], every training and rollout shard is a slab of rows;
            the parameter is the transposed view and F.linear uses the GEMM's transpose mode.
    Case 3  anything else: a separate rollout buffer rebuilt after each update.

After an update, ``SharedWeights.refresh`` fills the other q − 1 pieces of each rollout shard: one
in-place ``all_gather`` per segment inside the share group (each rank's input is its own slice of the
output, which NCCL's all-gather supports in place). Because rollplex owns both layouts
(parallel.layout) it chooses them so that Case 3 is empty: each layer's q/k/v weights are ONE rollout
buffer [q_r; k_r; v_r] (likewise their biases) and gate/up ONE [gate_r; up_r], whose segments hold the
training shards contiguously, so the decode step's fused projections read the shared bytes
(``fused_views``) instead of the concatenated copies rollout.decode makes today. The classifier still
handles Case 3: ``classify(..., training=megatron_shards)`` models the paper's Megatron-Core trainer
(fused QKV interleaved per key/value group) against a vLLM-style rollout and reproduces its 60.0 /
32.8 / 7.2 % for Qwen2.5-VL-32B at TP 8 → 4.

Where the run uses it: parallel.runtime binds it when the run is colocated (and on disaggregated
rollout ranks, at q = 1); the chunked optimizer writes the updated values into the training parameters
(views, flattened in storage order: ``storage_view``), then ``refresh()`` runs before rollout reads
θ_{k+1} (parallel.optimizer's ``after_update``); ``decode_tensors(i)``, ``embedding()``, ``lm_head()``
and ``rollout_head()`` are what the decode step reads at TP_rollout (rollout.decode.EngineShard);
``case_rows`` is what the log and ``rollplex plan`` print.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from rollplex.parallel.dist import Comm
from rollplex.parallel.layout import Placement, entry, is_language_model

# --- classification (shapes only; works on the meta device) ---------------------------------------


@dataclass(frozen=True)
class Unit:
    """Parameters one rollout buffer holds (a fused q/k/v or gate/up buffer of a layer, or one tensor).

    Fields: ``name`` (e.g. ``layers.3.qkv``), ``members`` (parameter names in buffer order),
    ``kind`` (qkv, qkv_bias, gate_up, row, column, vocab, replicated), ``sizes`` (rows of each member
    along the split axis: output rows, or input columns for row-parallel), ``params`` (elements),
    ``heads`` (attention heads, key/value heads; qkv units only).
    """

    name: str
    members: tuple[str, ...]
    kind: str
    sizes: tuple[int, ...]
    params: int
    heads: tuple[int, int] = (0, 0)

    @property
    def axis(self) -> int | None:
        """Split axis of the logical [out, in]: 0 rows, 1 input columns, None replicated."""
        return {"row": 1, "replicated": None}.get(self.kind, 0)

    @property
    def language_model(self) -> bool:
        return is_language_model(self.members[0])


Shards = list[list[torch.Tensor]]  # per engine tensor of one rank: its rows, in memory order


def _block(offset: int, size: int, tp: int, rank: int) -> torch.Tensor:
    n = size // tp
    return torch.arange(offset + rank * n, offset + rank * n + n)


def _offsets(sizes: tuple[int, ...]) -> list[int]:
    return [sum(sizes[:i]) for i in range(len(sizes))]


def rollplex_shards(unit: Unit, tp: int, rank: int, role: str) -> Shards:
    """Rows of each tensor ``rank`` holds of ``unit`` in rollplex's layout (parallel.layout): training
    keeps each member its own tensor, rollout one tensor per buffer with the members' blocks in order."""
    if unit.axis is None:
        return [[torch.arange(sum(unit.sizes))]]
    blocks = [_block(o, s, tp, rank) for o, s in zip(_offsets(unit.sizes), unit.sizes, strict=True)]
    return [[b] for b in blocks] if role == "train" else [blocks]


def megatron_shards(unit: Unit, tp: int, rank: int, role: str) -> Shards:
    """Megatron-Core's training layout (``transformer/attention.py``, ``get_query_key_value_tensors``:
    ``linear_qkv`` interleaved per key/value group: for
    each group of the rank, its query heads' rows, then its key rows, then its value rows, one tensor);
    gate and up separately addressable (the paper's condition for its Case 1 share); the rest as
    rollplex. Used to check the classifier against the paper's numbers."""
    if unit.kind not in ("qkv", "qkv_bias"):
        return rollplex_shards(unit, tp, rank, role)
    heads, groups = unit.heads
    q_rows, k_rows, _ = unit.sizes
    per_head = q_rows // heads
    rep, per_rank = heads // groups, groups // tp
    rows = []
    for g in range(rank * per_rank, (rank + 1) * per_rank):
        rows.append(torch.arange(g * rep * per_head, (g + 1) * rep * per_head))
        rows.append(q_rows + torch.arange(g * per_head, (g + 1) * per_head))
        rows.append(q_rows + k_rows + torch.arange(g * per_head, (g + 1) * per_head))
    return [rows]


def _contiguous_in(rows: torch.Tensor, position: torch.Tensor) -> bool:
    """Whether logical ``rows`` sit, in order, at consecutive positions of a rollout tensor."""
    at = position[rows]
    return bool((at >= 0).all()) and bool((at == at[0] + torch.arange(len(at))).all())


def _shares(unit: Unit, tp_train: int, tp_rollout: int, training: Callable, rollout: Callable) -> bool:
    """The sharing criterion: every training tensor of the q ranks of each share group is a contiguous,
    in-order run of one rollout tensor of their rollout rank, and together they fill it."""
    q, total = tp_train // tp_rollout, sum(unit.sizes)
    for r in range(tp_rollout):
        for tensor in rollout(unit, tp_rollout, r, "rollout"):
            rows = torch.cat(tensor)
            position = torch.full((total,), -1, dtype=torch.long)
            position[rows] = torch.arange(len(rows))
            filled = torch.zeros(total, dtype=torch.bool)
            for t in range(r * q, r * q + q):
                for mine in training(unit, tp_train, t, "train"):
                    train_rows = torch.cat(mine)
                    if not bool(torch.isin(train_rows, rows).all()):
                        continue  # part of another rollout tensor of this rank
                    if not _contiguous_in(train_rows, position):
                        return False
                    filled[train_rows] = True
            if not bool(filled[rows].all()):
                return False
    return True


def classify_unit(
    unit: Unit,
    tp_train: int,
    tp_rollout: int,
    training: Callable = rollplex_shards,
    rollout: Callable = rollplex_shards,
) -> int:
    """Case 1, 2 or 3 of ``unit`` (module docstring): the criterion holds in row-major storage (split
    rows, or replicated) → 1; for input-column splits, in transposed storage → 2; else 3.

    Raises:
        ValueError: ``tp_rollout`` does not divide ``tp_train``.
    """
    if tp_train % tp_rollout:
        raise ValueError(f"TP_rollout {tp_rollout} does not divide TP_train {tp_train}")
    if not _shares(unit, tp_train, tp_rollout, training, rollout):
        return 3
    return 2 if unit.axis == 1 else 1


_FUSED = {"qkv": "qkv", "qkv_bias": "qkv_bias", "gate_up": "gate_up"}


def units(named_shapes: Iterable[tuple[str, tuple[int, ...]]], heads: tuple[int, int] = (0, 0)) -> list[Unit]:
    """The sharing units of a model's parameters (full shapes): members of one layer's fused buffer
    (``Entry.buffer``) together, every other parameter alone. ``heads`` = (attention, key/value) heads.

    Raises:
        ValueError: a parameter with no layout entry.
    """
    grouped: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, shape in named_shapes:
        e = entry(name)
        key = name.rsplit(".", 3)[0] + "." + e.buffer if e.buffer else name
        grouped.setdefault(key, []).append((name, tuple(shape)))
    return [_unit(key, members, heads) for key, members in grouped.items()]


def _unit(key: str, members: list[tuple[str, tuple[int, ...]]], heads: tuple[int, int]) -> Unit:
    e = entry(members[0][0])
    kind = e.buffer or {Placement.ROW: "row", Placement.COLUMN: "column", Placement.VOCAB: "vocab"}.get(
        e.train, "replicated"
    )
    axis = 1 if kind == "row" else 0
    sizes = tuple(shape[axis] if len(shape) > axis else shape[0] for _, shape in members)
    params = sum(math.prod(shape) for _, shape in members)
    return Unit(key, tuple(n for n, _ in members), kind, sizes, params, heads if "qkv" in kind else (0, 0))


@dataclass(frozen=True)
class CaseRow:
    """One line of the classification: Case ``case`` covers ``tensors`` parameters with ``params``
    elements (``lm_params`` of them in the language model, ``lm_percent`` % of the language model's),
    and takes ``rollout_bytes`` bytes per rank in rollout buffers (for Case 3, memory on top of the
    training shards)."""

    case: int
    label: str
    tensors: int
    params: int
    lm_params: int
    lm_percent: float
    rollout_bytes: int


LABELS = {1: "view (same or nested rows)", 2: "transposed view (row-parallel)", 3: "separate rollout copy"}


def classify(
    named_shapes: Iterable[tuple[str, tuple[int, ...]]],
    tp_train: int,
    tp_rollout: int,
    *,
    heads: tuple[int, int] = (0, 0),
    training: Callable = rollplex_shards,
    rollout: Callable = rollplex_shards,
) -> dict[Unit, int]:
    """Case of every sharing unit of a model given its full parameter shapes (``units``).

    Raises:
        ValueError: a parameter with no layout entry, or ``tp_rollout`` not dividing ``tp_train``.
    """
    memo: dict[tuple, int] = {}  # layers repeat: classify each (kind, sizes) once
    cases = {}
    for unit in units(named_shapes, heads):
        key = (unit.kind, unit.sizes, unit.heads)
        if key not in memo:
            memo[key] = classify_unit(unit, tp_train, tp_rollout, training, rollout)
        cases[unit] = memo[key]
    return cases


def case_rows(cases: dict[Unit, int], tp_rollout: int, bytes_per_element: int = 2) -> list[CaseRow]:
    """The classification summed by case (what ``rollplex plan`` prints): Cases 1, 2 and 3 in order,
    rollout bytes per rank at ``bytes_per_element`` (BF16: 2)."""
    lm_total = sum(u.params for u in cases if u.language_model) or 1
    rows = []
    for case in (1, 2, 3):
        mine = [u for u, c in cases.items() if c == case]
        lm = sum(u.params for u in mine if u.language_model)
        per_rank = sum(u.params if u.axis is None else u.params // tp_rollout for u in mine)
        rows.append(
            CaseRow(
                case,
                LABELS[case],
                sum(len(u.members) for u in mine),
                sum(u.params for u in mine),
                lm,
                100.0 * lm / lm_total,
                per_rank * bytes_per_element,
            )
        )
    return rows


def format_case_rows(rows: list[CaseRow]) -> list[str]:
    """The classification as text lines (a header, then one line per case), e.g.
    ``Case 2  transposed view (row-parallel)   128 tensors  10.74 B params  32.77 % of LM  5.37 GB/rank``."""
    head = ("case", "layout", "tensors", "params", "share of LM", "rollout/rank")
    lines = ["{:<6}  {:<32} {:>7}  {:>10}  {:>11}  {:>15}".format(*head)]
    for r in rows:
        lines.append(
            f"Case {r.case}  {r.label:<32} {r.tensors:>7}  {r.params / 1e9:>8.2f} B  {r.lm_percent:>9.2f} %  "
            f"{r.rollout_bytes / 1e9:>12.2f} GB"
        )
    return lines


def model_heads(model_or_config) -> tuple[int, int]:
    """(attention heads, key/value heads) of a Qwen2.5-VL model or its config."""
    config = getattr(model_or_config, "config", model_or_config)
    text = getattr(config, "text_config", config)
    return text.num_attention_heads, text.num_key_value_heads


# --- the physical copy on one rank ----------------------------------------------------------------


@dataclass(frozen=True)
class FusedViews:
    """One layer's fused rollout buffers (shared bytes, no copy): ``qkv`` [(H + 2·Hkv)·D / Tr, Hd],
    ``qkv_bias`` [(H + 2·Hkv)·D / Tr], ``gate_up`` [2·I / Tr, Hd]."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor
    gate_up: torch.Tensor


def storage_view(param: torch.Tensor) -> torch.Tensor:
    """The contiguous view of a parameter's bytes in storage order: the parameter itself, or for a
    Case 2 (transposed) parameter its transpose. Elementwise updates (AdamW) may run on it."""
    view = param if param.is_contiguous() else param.t()
    assert view.is_contiguous(), "a shared weight is contiguous or a transposed contiguous slab"
    return view


class SharedWeights:
    """The rollout-sized buffers of this rank and the training parameters bound into them.

    Args:
        model: a model sharded by ``tensor_parallel.shard_model`` over ``train`` (TP_train).
        train, share, rollout: this rank's training TP, share and rollout TP groups (parallel.dist):
            training rank t holds piece t mod q of rollout shard t // q.
        copied: keep the rollout buffers apart from the training parameters (a second copy of those
            weights, ``parallel.shared_weights: false``, the baseline of paper §4.5): ``refresh()`` then
            first copies each training shard into its piece. Decode reads the same layout either way.

    After construction every linear weight and bias of the language model's layers, the embedding
    and the LM head is a view into a buffer (the old tensors are released; not with ``copied``), and
    ``refresh()`` has run.
    Norms and the vision tower are replicated: rollout reads the training tensors themselves (Case 1,
    identical placement), and every rank updates them alike.

    Raises:
        ValueError: the groups do not fit each other (sizes or ranks).
    """

    def __init__(self, model: nn.Module, train: Comm, share: Comm, rollout: Comm, *, copied: bool = False):
        if train.size != share.size * rollout.size:
            raise ValueError(f"TP_train {train.size} != share group {share.size} × TP_rollout {rollout.size}")
        if share.rank != train.rank % share.size or rollout.rank != train.rank // share.size:
            raise ValueError(
                f"training rank {train.rank} must be piece {train.rank % share.size} of rollout shard "
                f"{train.rank // share.size}, got share rank {share.rank}, rollout rank {rollout.rank}"
            )
        self.model, self.share, self.rollout = model, share, rollout
        self.q, self.piece, self.copied = share.size, share.rank, copied
        self._segments: list[torch.Tensor] = []
        self._copies: list[tuple[nn.Parameter, torch.Tensor, bool]] = []  # with ``copied``
        self._layers: list[dict[str, torch.Tensor]] = []
        lm = model.model.language_model
        for layer in lm.layers:
            self._layers.append(self._bind_layer(layer))
        self._embed = self._bind_rows([lm.embed_tokens.weight])
        tied = model.lm_head.weight is lm.embed_tokens.weight
        self._head = self._embed if tied else self._bind_rows([model.lm_head.weight])
        self.refresh()

    def _bind_rows(self, params: list[nn.Parameter]) -> torch.Tensor:
        """One rollout buffer [Σ q·rows_i, ...] of segments (one per parameter, in order); each
        parameter becomes the view of its piece of its segment (Case 1)."""
        first = params[0]
        rows = sum(p.shape[0] for p in params) * self.q
        buffer = torch.empty((rows, *first.shape[1:]), dtype=first.dtype, device=first.device)
        offset = 0
        for p in params:
            segment = buffer[offset : offset + self.q * p.shape[0]]
            self._bind(p, segment, transposed=False)
            offset += segment.shape[0]
        return buffer

    def _bind_transposed(self, param: nn.Parameter) -> torch.Tensor:
        """Rollout buffer [q·in_t, out] of a row-parallel weight [out, in_t]; the parameter becomes the
        transpose of its slab of rows (Case 2). Returns the buffer (storage order)."""
        out, width = param.shape
        buffer = torch.empty((self.q * width, out), dtype=param.dtype, device=param.device)
        self._bind(param, buffer, transposed=True)
        return buffer

    def _bind(self, param: nn.Parameter, segment: torch.Tensor, transposed: bool) -> None:
        piece = segment.chunk(self.q)[self.piece]
        piece.copy_(param.detach().t() if transposed else param.detach())
        if self.copied:
            self._copies.append((param, piece, transposed))
        else:
            param.data = piece.t() if transposed else piece
        self._segments.append(segment)

    def _bind_layer(self, layer: nn.Module) -> dict[str, torch.Tensor]:
        a, m = layer.self_attn, layer.mlp
        return {
            "qkv": self._bind_rows([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
            "qkv_bias": self._bind_rows([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]),
            "gate_up": self._bind_rows([m.gate_proj.weight, m.up_proj.weight]),
            "o": self._bind_transposed(a.o_proj.weight),
            "down": self._bind_transposed(m.down_proj.weight),
        }

    @torch.no_grad()
    def refresh(self) -> None:
        """After an update of the training shards: every segment's other q − 1 pieces from the share
        group, in place (one all-gather per segment; nothing to do when q = 1). Call it when nothing
        reads the rollout buffers (the Phase-3 barrier). With ``copied``, each training shard is first
        copied into its piece."""
        for param, piece, transposed in self._copies:
            piece.copy_(param.detach().t() if transposed else param.detach())
        if self.q == 1:
            return
        for segment in self._segments:
            self.share.all_gather_into(segment, segment.chunk(self.q)[self.piece])

    def fused_views(self, layer: int) -> FusedViews:
        """Layer ``layer``'s fused q/k/v, bias and gate/up rollout buffers (the shared bytes)."""
        views = self._layers[layer]
        return FusedViews(views["qkv"], views["qkv_bias"], views["gate_up"])

    def decode_tensors(self, layer: int) -> tuple:
        """Layer ``layer``'s tensors at TP_rollout in rollout.decode's fused ``_layer_tensors`` order:
        (input norm, (qkv,), (qkv bias,), W_o [Hd, H·D/Tr] (transposed view), post norm, (gate_up,),
        W_down [Hd, I/Tr] (transposed view)): all shared bytes, no copy."""
        lm_layer = self.model.model.language_model.layers[layer]
        views = self._layers[layer]
        return (
            lm_layer.input_layernorm.weight,
            (views["qkv"],),
            (views["qkv_bias"],),
            views["o"].t(),
            lm_layer.post_attention_layernorm.weight,
            (views["gate_up"],),
            views["down"].t(),
        )

    def embedding(self) -> torch.Tensor:
        """Rollout shard of the token embedding [V/Tr, Hd]."""
        return self._embed

    def lm_head(self) -> torch.Tensor:
        """Rollout shard of the LM head [V/Tr, Hd] (the embedding's when tied)."""
        return self._head

    def buffers(self) -> list[torch.Tensor]:
        """Every rollout buffer of this rank (each once)."""
        out = [b for views in self._layers for b in views.values()] + [self._embed]
        return out if self._head is self._embed else [*out, self._head]

    def rollout_head(self):
        """The ``TensorParallelHead`` of rollout (TP_rollout group, this rank's rollout vocabulary
        columns, per-rank heads; no LM head module: the decode step computes logits from ``lm_head()``)."""
        from rollplex.parallel.vocab_parallel import TensorParallelHead

        heads, kv_heads = model_heads(self.model)
        rows = self._head.shape[0]
        return TensorParallelHead(
            self.rollout,
            vocab_start=self.rollout.rank * rows,
            full_vocab=rows * self.rollout.size,
            heads=heads // self.rollout.size,
            kv_heads=kv_heads // self.rollout.size,
        )
