"""The memory planner: what every class of state takes, per rank, in each window of an iteration, and
where it should live so the iteration fits the device budget. Pure functions of shapes: no tensor is
allocated and no weight read.

Sizes (per rank; b = bytes per element of the model dtype, t = TP_train, r = TP_rollout; G_t groups per
training rank = ⌈G / dp⌉, G_r per rollout replica = ⌈G / (dp·t / r)⌉, N group size, P prompt tokens,
R response tokens, m groups per micro-batch, L layers, kv_t / kv_r key/value heads per rank, hd head
dim; ``memory.shapes`` counts parameters):

- snapshot: the actor's parameters at min(t, r) (shared: one physical copy sized for the rollout shard,
  paper §3.3) or at t (copied) · b; rollout_weights: the rollout shard · b when copied, else 0.
- reference: the model's parameters at t · b (0 without KL).
- master: trainable parameters at t, divided over the dp ranks (ZeRO-1, ``parallel.shard_optimizer``:
  each data-parallel rank owns ⌈1/dp⌉ of the optimizer state), · 4 (0 when the model is float32: its own master); adam: · 8.
- grads: trainable parameters at t · b (rollplex keeps gradients in the parameters' dtype).
- rollout_kv: 2·L·kv_r·hd·b per token, for G_r·P prompt tokens (once per group; none under prefill
  fusion, where the actor's boundary KV seeds decode) and G_r·N·R own keys.
- decode_graphs: decode's concatenated q/k/v and gate/up copies at r (``rollout.fused_projections``;
  none where the layout makes them views) plus the sampling buffers, G_r·N rows · ⌈V/r⌉ · 4 bytes · 2.
- boundary_kv: 2·L·kv_t·hd·b per prompt token and the last position's log-probs (⌈V/t⌉·4 bytes), per
  role (actor, and reference with KL): every G_t group from Phase 1 to its suffix under the rollplex
  schedule; under serial all G_t groups for the reference's scoring and m groups for the actor.
- prefix_activations: what the actor prefix saves for backward, per group. With gradient checkpointing
  (layer recompute): each decoder layer's input, L·P·H·b, each vision block's input,
  depth·(4·V_tok)·Hv·b, and the patch embedding's and merger's, 4·V_tok·(1176 + 4·Hv)·b; without, every
  layer's saved tensors (``layer_saved``). Under rollplex G_t groups, kept from Phase 1 to the backward;
  under serial m groups, in the backward window.
- suffix_activations: one micro-batch's suffix, m·N·R tokens: each layer's input · H · b with
  checkpointing, every layer's saved tensors without.
- layer_working_set: the largest single layer's transient tensors over the layers a window runs: a
  forward without autograd (``layer_transient`` per token or patch: the prefixes under layer recompute,
  reference scoring of all G_t·N·R rows) or a layer run with autograd, its recompute in backward
  (``layer_saved``: a prefix layer over P tokens, a vision block over a group's patches, a suffix layer
  over the micro-batch's tokens).
- logits: one chunk of ``models.forward.LOGIT_CHUNK_ELEMENTS`` logits (fewer if the whole is smaller):
  model-dtype logits, their float32 log-softmax and its float32 gradient.
- optimizer_staging: the largest parameter's gradient upcast to FP32 (the norm pass), one chunk's FP32
  gradient and one foreach temporary; with host chunks the staging ring, 3 slots of master, exp_avg and
  exp_avg_sq (``memory.chunked_adamw``).
- workspace: ``memory.workspace_gib`` in every window.

Naive peak: every class resident at its largest at once — how the paper's Table 1 counts (§2.4.1).

The plan. Each window (``memory.windows``) sums the classes resident in it; phase-local state is
released at its last use (rollout KV and decode buffers after generation, boundary KV and activations
after the backward) at no cost. While the largest window exceeds the budget, the cheapest move that
shrinks that window is applied. Cost = GiB over the host link per step per GiB of HBM freed, ordered
by whether it is exposed on the critical path (paper §3.2):

    move                         per step                                      exposed
    reference paging             1 load per window that reads it (2 rollplex)  no: prefetched in decode/rewards
    prefix activation offload    1 store + 1 load                              no: stored during decode,
                                                                               loaded during the backward
    optimizer state to host      1 load + 1 store of 12 B/param, per chunk     yes: Phase 3 is serial
    gradient offload             1 store + 1 load                              yes (helps Phase 3 only)

Optimizer state moves chunk by chunk, only as many as the budget needs. Each move also needs room in
the host budget. Where nothing more can move, the plan says by how many GiB the largest window is over
and which settings shrink it.

Example:
    plan = plan_memory(Architecture.from_preset("qwen2.5-vl-3b"),
                       Workload(groups=8, group_size=8, prompt_tokens=3920, vision_tokens=3520,
                                response_tokens=512, gradient_checkpointing=True),
                       Budget(device_gib=72, host_gib=100))
    plan.fits, plan.planned_peak_gib, plan.offload_activations
    print(plan.table())
"""

from __future__ import annotations

import dataclasses
import math

from rollplex.memory.host_pool import ALIGNMENT
from rollplex.memory.shapes import Architecture
from rollplex.memory.windows import ABSENT, DEVICE, HOST, PHASE, STATE_CLASSES, WINDOWS

GIB = 2**30
MIB = 2**20
LOGIT_CHUNK_ELEMENTS = 2**28  # models.forward.LOGIT_CHUNK_ELEMENTS (a test keeps them equal)
LOGIT_BYTES_PER_ELEMENT = 4 + 4  # float32 log-softmax and its gradient (the model-dtype logits added)
STAGING_SLOTS, STATE_FIELDS = 3, 3  # memory.chunked_adamw: load j+1, update j, store j-1; master, m, v
# The plan keeps its peak this fraction under the budget: room for what it does not count (the caching
# allocator's fragmentation, CUDA graph pools, compiled kernels' buffers, library workspaces beyond
# memory.workspace_gib).
PLAN_HEADROOM = 0.05
SCHEDULES = ("serial", "rollplex", "auto")


@dataclasses.dataclass(frozen=True)
class Workload:
    """One training step's shapes.

    Attributes:
        groups: prompt groups per step over all ranks, G (``rollout.prompts_per_step``).
        group_size: responses per group, N.
        prompt_tokens: prompt length in tokens, P (text and vision; ``data.max_prompt_tokens``).
        vision_tokens: merged vision tokens per prompt (the vision tower sees 4× as many patches).
        response_tokens: response budget, R.
        micro_batch_groups: groups per micro-batch, m (0 = all of a rank's groups).
        schedule: serial, rollplex or auto (rollplex with prefill fusion).
        prefill_fusion: the actor's boundary KV seeds decode (rollplex; needs TP_train == TP_rollout).
        gradient_checkpointing: layer inputs kept, the rest recomputed in backward.
        reference: a reference model is scored (KL coefficient > 0).
        freeze_vision: the vision tower and merger are not trained.
        fused_projections: decode runs q/k/v and gate/up as one product each (``rollout.fused_projections``).
        fused_views: those concatenations are views of the weights (a layout that stores them so), not
            copies.
        dtype_bytes: bytes per element of the model dtype (2 = bf16; 4 = float32, its own master).
    """

    groups: int
    group_size: int
    prompt_tokens: int
    vision_tokens: int
    response_tokens: int
    micro_batch_groups: int = 1
    schedule: str = "rollplex"
    prefill_fusion: bool = True
    gradient_checkpointing: bool = True
    reference: bool = True
    freeze_vision: bool = False
    fused_projections: bool = True
    fused_views: bool = False
    dtype_bytes: int = 2

    def check(self) -> None:
        """Raise ValueError naming the field of a value the planner cannot use."""
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r}: expected one of {', '.join(SCHEDULES)}")
        if not 0 <= self.vision_tokens <= self.prompt_tokens:
            raise ValueError(
                f"vision tokens ({self.vision_tokens}) must lie in [0, prompt tokens ({self.prompt_tokens})]"
            )
        for name in ("groups", "group_size", "prompt_tokens", "response_tokens", "dtype_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    @property
    def overlapped(self) -> bool:
        """Prefixes run in Phase 1 (the rollplex schedule, or auto)."""
        return self.schedule != "serial"


@dataclasses.dataclass(frozen=True)
class Layout:
    """The parallel layout: training data-parallel degree, TP_train, TP_rollout, whether rollout
    reads the actor's weights in place (one physical copy) or keeps its own copy, and whether the
    optimizer state is split over the data-parallel ranks."""

    dp: int = 1
    tp_train: int = 1
    tp_rollout: int = 1
    shared_weights: bool = True
    shard_optimizer: bool = True  # ZeRO-1: each dp rank holds 1/dp of its shard's optimizer state

    @property
    def world(self) -> int:
        return self.dp * self.tp_train

    def check(self, arch: Architecture) -> None:
        """Raise ValueError naming the field of a degree the model or the world size cannot take."""
        if self.dp < 1:
            raise ValueError(f"parallel.dp={self.dp} must be at least 1")
        arch.check_tp(self.tp_train, "parallel.tp_train")
        arch.check_tp(self.tp_rollout, "parallel.tp_rollout")
        if self.world % self.tp_rollout:
            raise ValueError(
                f"parallel.tp_rollout={self.tp_rollout} does not divide the {self.world} GPUs "
                f"(parallel.dp={self.dp} x parallel.tp_train={self.tp_train})"
            )


@dataclasses.dataclass(frozen=True)
class Budget:
    """What the plan must fit, and the user's placement choices (``memory:`` config).

    Attributes:
        device_gib: device memory the plan may use per GPU, GiB.
        host_gib: host memory the pinned pool may take per GPU process, GiB.
        chunk_mib: optimizer chunk size, MiB of FP32 masters.
        workspace_gib: library workspaces and graph pools kept free in every window, GiB.
        optimizer_offload: auto | on (all chunks on the host) | off (none).
        reference_paging: auto | resident | paged.
        offload_activations: auto | on | off.
    """

    device_gib: float
    host_gib: float = math.inf
    chunk_mib: float = 128
    workspace_gib: float = 1.0
    optimizer_offload: str = "auto"
    reference_paging: str = "auto"
    offload_activations: str = "auto"


@dataclasses.dataclass(frozen=True)
class Row:
    """One class of state: its device GiB per window (planned), where it lives, its host GiB."""

    name: str
    state_class: str
    naive_gib: float
    gib: dict[str, float]
    where: dict[str, str]
    host_gib: float = 0.0


@dataclasses.dataclass(frozen=True)
class Move:
    """A placement the plan applied: what moved, GiB moved over the link per step, whether hidden."""

    what: str
    traffic_gib: float
    hidden: bool


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What lives where in each window, and the decisions the runtime applies.

    Attributes:
        rows: one ``Row`` per state class (names of ``memory.windows.STATE_CLASSES``).
        budget_gib, host_budget_gib: what the plan had to fit.
        naive_gib: every class resident at its largest, summed.
        planned_gib: device GiB per window after the moves; planned_peak_gib: their maximum.
        fits: planned_peak_gib ≤ budget and the host pool ≤ the host budget.
        shortfall_gib: GiB over the budget (device, else host) when it does not fit, else 0.
        advice: which settings to change when it does not fit ('' when it does).
        optimizer_host_fraction, optimizer_host_bytes: the optimizer state in the host pool (whole
            chunks; ``ChunkedAdamW.for_model(host_bytes=...)``).
        reference_paging: "resident", "paged" or "none" (no reference).
        offload_activations: the actor prefix's saved tensors go to the host pool.
        offload_grads: gradients go to the host at the end of the backward (planned; the chunked
            optimizer reads them on the device).
        activation_arena_bytes: the arena for offloaded activations.
        host_pool_bytes: the pinned host pool to allocate (``Residency.from_plan``).
        moves: the moves in the order applied.
    """

    rows: tuple[Row, ...]
    budget_gib: float
    host_budget_gib: float
    naive_gib: float
    planned_gib: dict[str, float]
    planned_peak_gib: float
    fits: bool
    shortfall_gib: float
    advice: str
    optimizer_host_fraction: float
    optimizer_host_bytes: int
    reference_paging: str
    offload_activations: bool
    offload_grads: bool
    activation_arena_bytes: int
    host_pool_bytes: int
    moves: tuple[Move, ...]

    def where(self) -> dict[str, dict[str, str]]:
        """``{state class: {window: "device" | "host" | "-"}}`` for ``memory.residency.Residency``."""
        return {row.name: dict(row.where) for row in self.rows}

    def to_json(self) -> dict:
        """A JSON-able dict: ``naive_gib``, ``planned_peak_gib``, ``fits``, ``rows`` (name, class,
        naive and per-window GiB, where, host GiB) and the decisions."""
        out = dataclasses.asdict(self)
        out["moves"] = [dataclasses.asdict(m) for m in self.moves]
        return out

    def table(self) -> str:
        """What lives where in each window, in GiB (one line per class; ``h`` = in the host pool)."""
        head = f"{'state':<20}" + "".join(f"{w + ' (P' + str(PHASE[w]) + ')':>16}" for w in WINDOWS)
        lines = [head + f"{'naive':>9}{'host':>8}"]
        for row in self.rows:
            cells = "".join(f"{_cell(row.gib[w], row.where[w]):>16}" for w in WINDOWS)
            lines.append(f"{row.name:<20}{cells}{row.naive_gib:>9.2f}{row.host_gib:>8.2f}")
        total = "".join(f"{self.planned_gib[w]:>16.2f}" for w in WINDOWS)
        lines.append(f"{'total':<20}{total}{self.naive_gib:>9.2f}{self.host_pool_bytes / GIB:>8.2f}")
        lines.append(self._summary())
        return "\n".join(lines)

    def _summary(self) -> str:
        verdict = "fits" if self.fits else f"does not fit: {self.advice}"
        moves = "; ".join(
            f"{m.what} ({m.traffic_gib:.1f} GiB/step, {'hidden' if m.hidden else 'exposed'})"
            for m in self.moves
        )
        return (
            f"budget {self.budget_gib:.1f} GiB, planned peak {self.planned_peak_gib:.2f} GiB, naive "
            f"{self.naive_gib:.2f} GiB: {verdict}\nmoves: {moves or 'none (everything resident)'}"
        )


def _cell(gib: float, where: str) -> str:
    if where == HOST:
        return "h"
    return "-" if where == ABSENT else f"{gib:.2f}"


# -- component sizes, bytes per rank -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Shapes:
    """Derived per-rank counts shared by the component functions."""

    arch: Architecture
    work: Workload
    layout: Layout
    budget: Budget

    @property
    def b(self) -> int:
        return self.work.dtype_bytes

    @property
    def target_gib(self) -> float:
        """The device GiB a plan may reach: the budget less ``PLAN_HEADROOM``."""
        return self.budget.device_gib * (1 - PLAN_HEADROOM)

    @property
    def groups_train(self) -> int:
        return -(-self.work.groups // self.layout.dp)

    @property
    def groups_rollout(self) -> int:
        replicas = self.layout.world // self.layout.tp_rollout
        return -(-self.work.groups // replicas)

    @property
    def micro(self) -> int:
        m = self.work.micro_batch_groups
        return self.groups_train if m <= 0 else min(m, self.groups_train)

    @property
    def fusion(self) -> bool:
        same = self.layout.tp_train == self.layout.tp_rollout
        return self.work.overlapped and same and (self.work.prefill_fusion or self.work.schedule == "auto")

    @property
    def patches(self) -> int:
        return self.work.vision_tokens * self.arch.merge**2

    def trainable(self) -> int:
        rank = self.arch.rank_parameters(self.layout.tp_train)
        return rank.language + (0 if self.work.freeze_vision else rank.vision)

    def kv_per_token(self, tp: int) -> int:
        return 2 * self.arch.layers * self.arch.kv_heads_per_rank(tp) * self.arch.head_dim * self.b


def layer_saved(arch: Architecture, tp: int) -> tuple[int, int]:
    """Elements a decoder layer saves for backward per token, and a vision block per patch, counted from
    the tensors autograd keeps (input norm's input; the normed input shared by q/k/v; q, k, v before and
    after RoPE; attention output; o's input; the post-attention norm's input and output; gate and up
    outputs; the SiLU output; the product into down): 4·H + 4·(heads/t)·hd + 4·K/t + 4·I/t per token;
    the vision block likewise 8·Hv + 4·Iv per patch."""
    attn = arch.heads // tp * arch.head_dim
    kv = arch.kv_heads_per_rank(tp) * arch.head_dim
    decoder = 4 * arch.hidden + 4 * attn + 4 * kv + 4 * (arch.intermediate // tp)
    vision = 8 * arch.vision_hidden + 4 * arch.vision_intermediate
    return decoder, vision


def layer_transient(arch: Architecture, tp: int) -> tuple[int, int]:
    """Elements live at once per token in a decoder layer run without autograd (the residual stream
    and the normed input, 2·H, beside the MLP's gate, up and gated product, 3·I/t), and per patch in a
    vision block (2·Hv + 3·Iv)."""
    return 2 * arch.hidden + 3 * (
        arch.intermediate // tp
    ), 2 * arch.vision_hidden + 3 * arch.vision_intermediate


def _prefix_group_bytes(s: _Shapes) -> int:
    """Bytes the attached actor prefix of one group keeps for its backward."""
    arch, p = s.arch, s.work.prompt_tokens
    decoder, vision = layer_saved(arch, s.layout.tp_train)
    vision_rows = 0 if s.work.freeze_vision else s.patches
    if s.work.gradient_checkpointing:
        per_token, per_patch = arch.layers * arch.hidden, arch.vision_depth * arch.vision_hidden
    else:
        per_token, per_patch = arch.layers * decoder, arch.vision_depth * vision
    edges = arch.patch_dim + 4 * arch.vision_hidden  # patch embedding input, merger's saved tensors
    return (p * per_token + vision_rows * (per_patch + edges)) * s.b


def _suffix_tokens(s: _Shapes) -> int:
    return s.micro * s.work.group_size * s.work.response_tokens


def _sizes(s: _Shapes) -> dict[str, dict[str, int]]:
    """Device bytes of every class in every window where it is resident (before any move)."""
    arch, work, lay, b = s.arch, s.work, s.layout, s.b
    train, rollout = arch.rank_parameters(lay.tp_train), arch.rank_parameters(lay.tp_rollout)
    shard = arch.rank_parameters(min(lay.tp_train, lay.tp_rollout)) if lay.shared_weights else train
    state_bytes = 4 if b < 4 else b
    decoder, vision = layer_saved(arch, lay.tp_train)
    owned = -(-s.trainable() // lay.dp) if lay.shard_optimizer else s.trainable()  # ZeRO-1's slice
    every = dict.fromkeys(WINDOWS)
    sizes = {
        "snapshot": _all(shard.total * b),
        "rollout_weights": _all(0 if lay.shared_weights else rollout.total * b),
        "reference": _all(train.total * b if work.reference else 0),
        "master": _all(owned * 4 if b < 4 else 0),
        "adam": _all(owned * 2 * state_bytes),
        "grads": {"backward": s.trainable() * b, "update": s.trainable() * b},
        "rollout_kv": {"rollout": _rollout_kv(s)},
        "decode_graphs": {"rollout": _decode_buffers(s, rollout)},
        "boundary_kv": _boundary(s),
        "prefix_activations": _prefix_activations(s),
        "suffix_activations": {"backward": _suffix_saved(s, decoder)},
        "layer_working_set": _working_sets(s, decoder, vision),
        "logits": _logits(s),
        "optimizer_staging": {"update": _staging(s, train, host_chunks=False)},
        "workspace": _all(int(s.budget.workspace_gib * GIB)),
    }
    return {name: {w: v.get(w) or 0 for w in every} for name, v in sizes.items()}


def _bytes(gib: float) -> int:
    """``gib`` in bytes; an unbounded budget (inf) as more bytes than any plan can hold."""
    return int(gib * GIB) if math.isfinite(gib) else 2**62


def _all(nbytes: int) -> dict[str, int]:
    return dict.fromkeys(WINDOWS, nbytes)


def _rollout_kv(s: _Shapes) -> int:
    per_token = s.kv_per_token(s.layout.tp_rollout)
    prompt = 0 if s.fusion else s.groups_rollout * s.work.prompt_tokens
    own = s.groups_rollout * s.work.group_size * s.work.response_tokens
    return per_token * (prompt + own)


def _decode_buffers(s: _Shapes, rollout) -> int:
    copies = rollout.qkv_gate_up * s.b if s.work.fused_projections and not s.work.fused_views else 0
    rows = s.groups_rollout * s.work.group_size
    return copies + rows * -(-s.arch.vocab // s.layout.tp_rollout) * 4 * 2


def _boundary(s: _Shapes) -> dict[str, int]:
    """Actor and reference boundary KV (with the prefixes' last-position log-probs) per window."""
    per_group = s.kv_per_token(s.layout.tp_train) * s.work.prompt_tokens
    per_group += -(-s.arch.vocab // s.layout.tp_train) * 4
    reference = per_group * s.groups_train if s.work.reference else 0
    if s.work.overlapped:
        actor = per_group * s.groups_train
        return {"rollout": actor + reference, "scoring": actor + reference, "backward": actor}
    return {"scoring": reference, "backward": per_group * s.micro}


def _prefix_activations(s: _Shapes) -> dict[str, int]:
    per_group = _prefix_group_bytes(s)
    if s.work.overlapped:
        kept = per_group * s.groups_train
        return {"rollout": kept, "scoring": kept, "backward": kept}
    return {"backward": per_group * s.micro}


def _suffix_saved(s: _Shapes, decoder: int) -> int:
    per_token = s.arch.hidden if s.work.gradient_checkpointing else decoder
    return s.arch.layers * _suffix_tokens(s) * per_token * s.b


def _working_sets(s: _Shapes, decoder: int, vision: int) -> dict[str, int]:
    """One layer's transient tensors, the largest over the layers a window runs: forwards without
    autograd (the prefixes under layer recompute, reference scoring of all B rows) hold
    ``layer_transient``; a layer run with autograd (its recompute in backward) holds ``layer_saved``."""
    plain_decoder, plain_vision = layer_transient(s.arch, s.layout.tp_train)
    p, patches = s.work.prompt_tokens, s.patches
    prefix = max(p * plain_decoder, patches * plain_vision) * s.b
    rows = s.groups_train * s.work.group_size * s.work.response_tokens
    scoring = max(prefix, rows * plain_decoder * s.b)
    backward = max(p * decoder, patches * vision, _suffix_tokens(s) * decoder) * s.b
    return {"rollout": prefix if s.work.overlapped else 0, "scoring": scoring, "backward": backward}


def _logits(s: _Shapes) -> dict[str, int]:
    vocab = -(-s.arch.vocab // s.layout.tp_train)
    per_element = LOGIT_BYTES_PER_ELEMENT + s.b
    train = min(LOGIT_CHUNK_ELEMENTS, _suffix_tokens(s) * vocab) * per_element
    rows = s.groups_train * s.work.group_size * s.work.response_tokens
    score = min(LOGIT_CHUNK_ELEMENTS, rows * vocab) * (4 + s.b)
    return {"scoring": score, "backward": train}


def _chunk_bytes(s: _Shapes) -> int:
    """One optimizer chunk's FP32 masters, bytes (no more than all of them: one chunk then)."""
    return min(int(s.budget.chunk_mib * MIB), s.trainable() * 4)


def _staging(s: _Shapes, train, host_chunks: bool) -> int:
    """The optimizer step's transient device bytes (module docstring)."""
    largest = train.largest * 4
    ring = STAGING_SLOTS * STATE_FIELDS * _chunk_bytes(s) if host_chunks else 0
    return largest + 2 * _chunk_bytes(s) + ring


# -- the plan ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Placement:
    """The mutable decisions while planning."""

    optimizer_chunks: int = 0  # chunks of optimizer state in the host pool
    reference_paged: bool = False
    activations: bool = False
    grads: bool = False
    moves: list[Move] = dataclasses.field(default_factory=list)


def plan_memory(
    arch: Architecture, work: Workload, budget: Budget, layout: Layout | None = None
) -> MemoryPlan:
    """The ``MemoryPlan`` of ``work`` on ``arch`` under ``layout`` (default one GPU) and ``budget``.

    Raises:
        ValueError: a workload field, parallel degree or budget choice the planner cannot use (the
            message names it).
    """
    layout = layout or Layout()
    work.check()
    layout.check(arch)
    _check_budget(budget)
    s = _Shapes(arch, work, layout, budget)
    sizes = _sizes(s)
    place = _Placement()
    _apply_forced(s, sizes, place)
    while True:
        window, excess = _worst(s, sizes, place)
        if excess <= 0 or not _move(s, sizes, place, window, excess):
            break
    plan = _plan(s, sizes, place)
    if plan.fits or math.isinf(budget.host_gib):
        return plan
    return _with_host_advice(
        plan, plan_memory(arch, work, dataclasses.replace(budget, host_gib=math.inf), layout)
    )


def _with_host_advice(plan: MemoryPlan, unbounded: MemoryPlan) -> MemoryPlan:
    """``plan`` (which does not fit), its advice led by the host budget that would make it fit when a
    larger pinned pool alone would (``unbounded``: the same plan with no host limit)."""
    if not unbounded.fits or plan.host_budget_gib >= unbounded.host_pool_bytes / GIB:
        return plan
    need = math.ceil(unbounded.host_pool_bytes / GIB * 10) / 10
    host = f"or, alone, memory.host_budget_gib={need:.1f} where the machine has that much host memory"
    return dataclasses.replace(plan, advice=f"{plan.advice}; {host} (the pinned pool takes the rest)")


def _check_budget(budget: Budget) -> None:
    choices = (
        ("memory.optimizer_offload", budget.optimizer_offload, ("auto", "on", "off")),
        ("memory.reference_paging", budget.reference_paging, ("auto", "resident", "paged")),
        ("memory.offload_activations", budget.offload_activations, ("auto", "on", "off")),
    )
    for field, value, allowed in choices:
        if value not in allowed:
            raise ValueError(f"{field}={value!r} is not one of {', '.join(allowed)}")
    if budget.device_gib <= 0:
        raise ValueError(f"memory.device_budget_gib must be positive, got {budget.device_gib}")


def _optimizer_chunks(s: _Shapes, sizes) -> tuple[int, int]:
    """(number of chunks, bytes of state per chunk) of the optimizer state."""
    total = sizes["master"]["update"] + sizes["adam"]["update"]
    fields = STATE_FIELDS if sizes["master"]["update"] else STATE_FIELDS - 1
    per_chunk = fields * _chunk_bytes(s)
    return -(-total // per_chunk), per_chunk


def _optimizer_fraction(s: _Shapes, sizes, place: _Placement) -> float:
    """The fraction of the optimizer state in the host pool (whole chunks; the last may be partial)."""
    total = sizes["master"]["update"] + sizes["adam"]["update"]
    return min(1.0, place.optimizer_chunks * _optimizer_chunks(s, sizes)[1] / total) if total else 0.0


def _device(s: _Shapes, sizes, place: _Placement) -> dict[str, dict[str, int]]:
    """Device bytes per class and window under ``place``."""
    out = {name: dict(v) for name, v in sizes.items()}
    fraction = _optimizer_fraction(s, sizes, place)
    for name in ("master", "adam"):
        out[name] = {w: round(v * (1 - fraction)) for w, v in out[name].items()}
    if place.optimizer_chunks:
        train = s.arch.rank_parameters(s.layout.tp_train)
        out["optimizer_staging"]["update"] = _staging(s, train, host_chunks=True)
    if place.reference_paged:
        reads = ("rollout", "scoring") if s.work.overlapped else ("scoring",)
        out["reference"] = {w: v if w in reads else 0 for w, v in out["reference"].items()}
    if place.activations:
        reloaded = _prefix_group_bytes(s) * min(s.groups_train, 2 * s.micro)
        out["prefix_activations"] = {"rollout": 0, "scoring": 0, "backward": reloaded, "update": 0}
    if place.grads:
        out["grads"]["update"] = 0
    return out


def _host(s: _Shapes, sizes, place: _Placement) -> dict[str, int]:
    """Host pool bytes per class under ``place`` (aligned views: one per tensor or chunk)."""
    chunks, per_chunk = _optimizer_chunks(s, sizes)
    total_opt = sizes["master"]["update"] + sizes["adam"]["update"]
    tensors = s.arch.rank_parameters(s.layout.tp_train).tensors
    layer_inputs = s.groups_train * (s.arch.layers + s.arch.vision_depth + 4)
    return {
        "optimizer": min(total_opt, place.optimizer_chunks * per_chunk) + place.optimizer_chunks * ALIGNMENT,
        "reference": sizes["reference"]["scoring"] + tensors * ALIGNMENT if place.reference_paged else 0,
        "prefix_activations": (
            _prefix_group_bytes(s) * s.groups_train + layer_inputs * ALIGNMENT if place.activations else 0
        ),
        "grads": sizes["grads"]["update"] + tensors * ALIGNMENT if place.grads else 0,
    }


def _totals(s: _Shapes, sizes, place: _Placement) -> dict[str, int]:
    device = _device(s, sizes, place)
    return {w: sum(v[w] for v in device.values()) for w in WINDOWS}


def _worst(s: _Shapes, sizes, place: _Placement) -> tuple[str, int]:
    """The window furthest over the budget and by how many bytes (≤ 0 when all fit)."""
    totals = _totals(s, sizes, place)
    window = max(WINDOWS, key=lambda w: totals[w])
    return window, totals[window] - _bytes(s.target_gib)


def _host_room(s: _Shapes, sizes, place: _Placement) -> float:
    return s.budget.host_gib * GIB - sum(_host(s, sizes, place).values())


def _apply_forced(s: _Shapes, sizes, place: _Placement) -> None:
    """The placements the user set to on/paged (auto ones are decided by ``_move``)."""
    b = s.budget
    if b.optimizer_offload == "on":
        _move_optimizer(s, sizes, place, math.inf)
    if b.reference_paging == "paged" and s.work.reference:
        _page_reference(s, sizes, place)
    if b.offload_activations == "on" and s.work.overlapped:
        _offload_activations(s, sizes, place)


def _move(s: _Shapes, sizes, place: _Placement, window: str, excess: int) -> bool:
    """Apply the cheapest move that shrinks ``window`` and fits the host room; False when none does."""
    candidates = (
        (s.budget.reference_paging == "auto", _page_reference),
        (s.budget.offload_activations == "auto", _offload_activations),
        (s.budget.optimizer_offload == "auto", _move_optimizer),
        (True, _offload_grads),
    )
    before = _totals(s, sizes, place)[window]
    for allowed, move in candidates:
        if not allowed:
            continue
        trial = dataclasses.replace(place, moves=list(place.moves))
        if not move(s, sizes, trial, excess):
            continue
        if _totals(s, sizes, trial)[window] < before and _host_room(s, sizes, trial) >= 0:
            place.__dict__.update(trial.__dict__)
            return True
    return False


def _page_reference(s: _Shapes, sizes, place: _Placement, excess: float = 0) -> bool:
    if place.reference_paged or not s.work.reference:
        return False
    place.reference_paged = True
    loads = 2 if s.work.overlapped else 1
    place.moves.append(Move("reference paging", loads * sizes["reference"]["scoring"] / GIB, True))
    return True


def _offload_activations(s: _Shapes, sizes, place: _Placement, excess: float = 0) -> bool:
    if place.activations or not s.work.overlapped:
        return False
    place.activations = True
    moved = 2 * _prefix_group_bytes(s) * s.groups_train
    place.moves.append(Move("prefix activation offload", moved / GIB, True))
    return True


def _move_optimizer(s: _Shapes, sizes, place: _Placement, excess: float) -> bool:
    """More optimizer chunks to the host: enough for ``excess`` bytes (all for inf), within host room."""
    chunks, per_chunk = _optimizer_chunks(s, sizes)
    free = _host_room(s, sizes, place)
    room = chunks if math.isinf(free) else max(0, int(free // (per_chunk + ALIGNMENT)))
    wanted = chunks if math.isinf(excess) else -(-int(excess) // per_chunk)
    add = min(chunks - place.optimizer_chunks, wanted, room)
    if add <= 0:
        return False
    place.optimizer_chunks += add
    place.moves = [m for m in place.moves if m.what != "optimizer state to host"]
    moved = 2 * min(place.optimizer_chunks * per_chunk, sizes["master"]["update"] + sizes["adam"]["update"])
    place.moves.append(Move("optimizer state to host", moved / GIB, False))
    return True


def _offload_grads(s: _Shapes, sizes, place: _Placement, excess: float = 0) -> bool:
    if place.grads:
        return False
    place.grads = True
    place.moves.append(Move("gradient offload", 2 * sizes["grads"]["update"] / GIB, False))
    return True


def _plan(s: _Shapes, sizes, place: _Placement) -> MemoryPlan:
    device = _device(s, sizes, place)
    host = _host(s, sizes, place)
    totals = {w: sum(v[w] for v in device.values()) / GIB for w in WINDOWS}
    peak = max(totals.values())
    host_gib = sum(host.values()) / GIB
    over_device, over_host = peak - s.target_gib, host_gib - s.budget.host_gib
    fits = over_device <= 0 and over_host <= 0
    total_opt = sizes["master"]["update"] + sizes["adam"]["update"]
    return MemoryPlan(
        rows=_rows(sizes, device, host, _optimizer_fraction(s, sizes, place)),
        budget_gib=s.budget.device_gib,
        host_budget_gib=s.budget.host_gib,
        naive_gib=sum(max(v.values()) for v in sizes.values()) / GIB,
        planned_gib=totals,
        planned_peak_gib=peak,
        fits=fits,
        shortfall_gib=0.0 if fits else max(over_device, over_host),
        advice="" if fits else _advice(s, totals, over_device, over_host),
        optimizer_host_fraction=_optimizer_fraction(s, sizes, place),
        optimizer_host_bytes=min(total_opt, place.optimizer_chunks * _optimizer_chunks(s, sizes)[1]),
        reference_paging="none" if not s.work.reference else "paged" if place.reference_paged else "resident",
        offload_activations=place.activations,
        offload_grads=place.grads,
        activation_arena_bytes=host["prefix_activations"],
        host_pool_bytes=sum(host.values()),
        moves=tuple(place.moves),
    )


_HOST_OF = {"master": "optimizer", "adam": "optimizer", "reference": "reference", "grads": "grads"}


def _rows(sizes, device, host, optimizer_fraction: float) -> tuple[Row, ...]:
    rows = []
    for name, resident in sizes.items():
        planned = device[name]
        where = {w: DEVICE if planned[w] else (HOST if resident[w] else ABSENT) for w in WINDOWS}
        if name in ("master", "adam"):
            on_host = resident["update"] * optimizer_fraction
        elif name == "prefix_activations":
            on_host = host["prefix_activations"]
        else:
            on_host = host.get(_HOST_OF.get(name, ""), 0)
        if not on_host:
            where = {w: DEVICE if resident[w] else ABSENT for w in WINDOWS}
        rows.append(
            Row(
                name=name,
                state_class=STATE_CLASSES[name][0],
                naive_gib=max(resident.values()) / GIB,
                gib={w: planned[w] / GIB for w in WINDOWS},
                where=where,
                host_gib=on_host / GIB,
            )
        )
    return tuple(rows)


def _advice(s: _Shapes, totals: dict[str, float], over_device: float, over_host: float) -> str:
    """The shortfall and the settings that shrink it."""
    if over_device <= 0:
        return f"needs {over_host:.1f} GiB more host memory: raise memory.host_budget_gib"
    window = max(WINDOWS, key=lambda w: totals[w])
    options = ["raise memory.device_budget_gib", "lower rollout.prompts_per_step"]
    if window == "rollout":
        options.append("lower rollout.max_response_tokens")
        if s.work.fused_projections:
            options.append("set rollout.fused_projections: false")
    if window in ("backward", "scoring") and not s.work.gradient_checkpointing:
        options.append("set model.gradient_checkpointing: true")
    if window == "backward" and s.micro > 1:
        options.append("lower algo.micro_batch_groups")
    if over_host > 0:
        options.append("raise memory.host_budget_gib")
    options.append("raise parallel.tp_train")
    where = f"the {window} window (Phase {PHASE[window]})"
    return f"needs {over_device:.1f} GiB more in {where}: " + ", ".join(options)
