"""The chunked optimizer: AdamW over FP32 master weights whose state lives, chunk by chunk, on the device
or in the pinned host pool and streams through the GPU at the step (paper §3.2, "Chunked update").

State. Parameters in bfloat16/float16 get an FP32 master copy (an update of lr·g ≈ 1e-6 vanishes in bf16
arithmetic); float32/float64 parameters are their own masters. Each trainable parameter's flat elements
are laid out, in parameter order, into chunks of ``chunk_elements`` elements (byte-balanced: every chunk
of a kind but the last is full; a parameter larger than a chunk is split into flat slices, which is
exact because AdamW is elementwise). A chunk's state is one tensor ``[F, n]`` (F = 3: master, exp_avg,
exp_avg_sq; F = 2 where the parameters are their own masters) either on the device or in the host pool.

One step (``clip_and_step``):

1. the global gradient norm, before any chunk is touched: per-parameter L2 norms of the gradients upcast
   to the masters' dtype, then the L2 norm of those norms — the formula and kernels of
   ``torch.nn.utils.clip_grad_norm_`` (``torch._foreach_norm`` where torch uses it, else
   ``torch.linalg.vector_norm``). A norm that is not finite commits nothing: every master, moment,
   step count and parameter stays bitwise as it was, and the gradients are dropped.
2. each chunk, in order: its parameters' gradients upcast into an FP32 staging buffer and multiplied by
   ``min(max_norm / (norm + 1e-6), 1)`` (``clip_grads_with_norm_``'s coefficient); AdamW runs on the
   chunk's tensors through ``torch.optim.AdamW`` itself (foreach on CUDA, single-tensor on the CPU, as it
   picks for the all-resident masters; per-parameter step counts as torch keeps them; a parameter whose
   gradient is None is skipped, as torch skips it); the new master is written into the parameter in
   place (its ``data_ptr`` never changes, so CUDA graphs captured on it stay valid); a parameter's
   gradient is freed once its last chunk is done.
3. host chunks stream through a ring of ``STAGING_SLOTS`` device buffers: while chunk j is updated on
   the compute stream, chunk j+1 loads on the load stream and chunk j−1 is written back on the offload
   stream (``memory.transfers``; the streams belong to the residency manager)::

       load:     [j+1 → slot (j+1)%3]          waits: the step's start, slot's previous store
       compute:  [grad j, AdamW j, param j]    waits: load j
       offload:  [slot j%3 → host j]           waits: compute j

So the result is bitwise the all-resident update: ``torch.optim.AdamW`` over FP32 masters after
``torch.nn.utils.clip_grad_norm_`` (tests/memory/test_chunked_adamw.py checks masters, moments,
parameters and norms over several steps, for every chunk size and placement).

Ownership (ZeRO-1, data parallelism: parallel.data_parallel.owned_ranges): with ``owned`` the optimizer
holds state for those element ranges only and updates only them; the caller's ``grad_norm`` turns this
rank's pieces of the gradients into the global norm (a collective) before any chunk commits, and after
the step the caller all-gathers the owned ranges' new values (parallel.data_parallel.gather_owned).

Element order: a parameter is flattened in its storage order, so a row-parallel weight stored
transposed (parallel.weight_sharing, Case 2: a transposed view of a contiguous slab) is updated in
place through that slab; AdamW is elementwise, so the order changes nothing.

The state dict keeps the format of the optimizer rollplex had before (FP32 masters under torch AdamW:
``{"inner": AdamW state dict, "masters": [...]}``), so checkpoints written before it resume.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterator, Sequence

import torch
from torch.utils._foreach_utils import _has_foreach_support

from rollplex.memory.host_pool import PinnedHostPool, pool_bytes
from rollplex.memory.transfers import Event, Transfers

STAGING_SLOTS = 3  # load j+1, update j, store j-1
SHADOWED = (torch.bfloat16, torch.float16)  # parameter dtypes that get an FP32 master
FIELDS = ("master", "exp_avg", "exp_avg_sq")


@dataclasses.dataclass(frozen=True)
class Piece:
    """Flat elements ``[start, stop)`` of parameter ``param``, at ``offset`` in its chunk."""

    param: int
    start: int
    stop: int
    offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One chunk: its pieces, element count, state dtype and whether it holds FP32 masters."""

    index: int
    pieces: tuple[Piece, ...]
    numel: int
    dtype: torch.dtype
    shadow: bool

    @property
    def fields(self) -> tuple[str, ...]:
        return FIELDS if self.shadow else FIELDS[1:]

    @property
    def nbytes(self) -> int:
        """Bytes of the chunk's state (every field)."""
        return len(self.fields) * self.numel * self.dtype.itemsize


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the master and moments of a parameter of ``dtype`` (float32 for bf16/fp16)."""
    return torch.float32 if dtype in SHADOWED else dtype


def chunk_layout(
    params: Sequence[torch.Tensor], chunk_elements: int, owned: Sequence[tuple[int, int, int]] | None = None
) -> list[Chunk]:
    """Byte-balanced chunks over ``params`` in order: a chunk is filled to ``chunk_elements`` elements
    (splitting a parameter at the boundary) and a new one starts where the parameters' kind (dtype)
    changes. With ``owned`` ((param index, start, stop) element ranges, in order), only those ranges.

    Raises:
        ValueError: ``chunk_elements`` < 1.
    """
    if chunk_elements < 1:
        raise ValueError(f"chunk size must be at least 1 element, got {chunk_elements}")
    chunks: list[Chunk] = []
    pieces: list[Piece] = []
    filled, kind = 0, None

    def close() -> None:
        nonlocal pieces, filled
        if pieces:
            chunks.append(Chunk(len(chunks), tuple(pieces), filled, state_dtype(kind), kind in SHADOWED))
        pieces, filled = [], 0

    ranges = owned if owned is not None else [(i, 0, p.numel()) for i, p in enumerate(params)]
    for index, start, stop in ranges:
        p = params[index]
        if p.dtype != kind:
            close()
            kind = p.dtype
        while start < stop:
            take = min(stop - start, chunk_elements - filled)
            pieces.append(Piece(index, start, start + take, filled))
            start, filled = start + take, filled + take
            if filled == chunk_elements:
                close()
    close()
    return chunks


def host_chunks_for(layout: Sequence[Chunk], host_bytes: int) -> frozenset[int]:
    """The chunks placed in the host pool for ``host_bytes`` of state there: the first chunks in order
    until their state reaches ``host_bytes`` (0 = none; at least the total = all)."""
    chosen, total = [], 0
    for chunk in layout:
        if total >= host_bytes:
            break
        chosen.append(chunk.index)
        total += chunk.nbytes
    return frozenset(chosen)


def host_state_bytes(layout: Sequence[Chunk], host_chunks: Collection[int]) -> int:
    """Bytes of the host pool the host chunks' state takes (each chunk an aligned view)."""
    return pool_bytes(c.nbytes for c in layout if c.index in host_chunks)


def _scalar_dtype() -> torch.dtype:
    """The dtype of AdamW's step counts, as torch.optim creates them (float64 under a float64 default)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class ChunkedAdamW:
    """AdamW over FP32 masters of ``params`` with the state in chunks on the device or in the host pool.

    Args:
        params: trainable parameters (contiguous; bf16/fp16 get FP32 masters, float32/float64 are their
            own masters).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        chunk_elements: elements per chunk (each of master, exp_avg, exp_avg_sq).
        host_chunks: indices of the chunks (``chunk_layout``) whose state lives in ``pool``.
        pool: the pinned host pool (required with host chunks).
        transfers: the residency manager's streams (required with host chunks).
        owned: the (param index, start, stop) element ranges, in storage order, this optimizer holds
            state for and updates (ZeRO-1; parallel.data_parallel.owned_ranges); None = everything.
        grad_norm: the global gradient norm from this optimizer's pieces of the gradients, a list of
            (param index, flat piece in the state dtype) (a collective under parallelism:
            parallel.optimizer); None = ``torch.nn.utils.clip_grad_norm_``'s formula over the pieces.

    Raises:
        ValueError: a parameter is neither contiguous nor the transpose of a contiguous 2-D slab; host
            chunks without a pool or transfers; the pool is too small (``PinnedHostPool.take``).
    """

    @classmethod
    def for_model(
        cls,
        model: torch.nn.Module,
        optim,
        *,
        chunk_mib: float = 128,
        host_bytes: int = 0,
        pool: PinnedHostPool | None = None,
        transfers: Transfers | None = None,
    ) -> ChunkedAdamW:
        """Over ``model``'s trainable parameters with the settings of an ``OptimConfig``; chunks of
        ``chunk_mib`` MiB of FP32 masters; the first chunks holding ``host_bytes`` bytes of state in
        ``pool`` (``memory.planner.MemoryPlan.optimizer_host_bytes``)."""
        params = [p for p in model.parameters() if p.requires_grad]
        elements = max(1, int(chunk_mib * 2**20) // 4)
        return cls(
            params,
            lr=optim.lr,
            betas=(optim.beta1, optim.beta2),
            eps=optim.eps,
            weight_decay=optim.weight_decay,
            chunk_elements=elements,
            host_chunks=host_chunks_for(chunk_layout(params, elements), host_bytes),
            pool=pool,
            transfers=transfers,
        )

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        chunk_elements: int,
        host_chunks: Collection[int] = (),
        pool: PinnedHostPool | None = None,
        transfers: Transfers | None = None,
        owned: Sequence[tuple[int, int, int]] | None = None,
        grad_norm: Callable[[list[tuple[int, torch.Tensor]]], torch.Tensor] | None = None,
    ):
        self.params = list(params)
        for i, p in enumerate(self.params):
            if not (p.is_contiguous() or (p.dim() == 2 and p.t().is_contiguous())):
                raise ValueError(
                    f"ChunkedAdamW: parameter {i} {tuple(p.shape)} is neither contiguous nor a transposed "
                    "contiguous slab"
                )
        if host_chunks and (pool is None or transfers is None):
            raise ValueError("ChunkedAdamW: host chunks need the residency manager's pool and transfers")
        self.hyper = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.owned = [tuple(r) for r in owned] if owned is not None else None
        self.grad_norm = grad_norm
        self.layout = chunk_layout(self.params, chunk_elements, self.owned)
        self.host_chunks = frozenset(host_chunks)
        self.transfers = transfers or Transfers(self.device)
        self.state = [self._allocate(c, pool) for c in self.layout]
        self.steps: list[torch.Tensor | None] = [None] * len(self.params)
        self._pending: list[Event] = []  # stores of the last step not yet waited on by the host
        self._init_masters()

    # -- construction -------------------------------------------------------------------------------

    def _allocate(self, chunk: Chunk, pool: PinnedHostPool | None) -> torch.Tensor:
        shape = (len(chunk.fields), chunk.numel)
        if chunk.index in self.host_chunks:
            state = pool.take(f"optimizer/chunk{chunk.index}", shape, chunk.dtype)
            state.zero_()
            return state
        return torch.zeros(shape, dtype=chunk.dtype, device=self.device)

    @torch.no_grad()
    def _init_masters(self) -> None:
        for chunk, state in zip(self.layout, self.state):
            if chunk.shadow:
                for piece in chunk.pieces:
                    state[0, piece.offset : piece.offset + piece.numel].copy_(self._flat(piece))

    def _flat(self, piece: Piece) -> torch.Tensor:
        """The parameter's elements of ``piece`` (a view of its storage, in storage order)."""
        return storage_flat(self.params[piece.param].detach())[piece.start : piece.stop]

    def _flat_grad(self, piece: Piece) -> torch.Tensor:
        """The gradient's elements of ``piece``, in the parameter's storage order."""
        param = self.params[piece.param]
        return in_storage_order(param.grad, param)[piece.start : piece.stop]

    # -- the step -----------------------------------------------------------------------------------

    @property
    def lr(self) -> float:
        return self.hyper["lr"]

    def set_lr(self, lr: float) -> None:
        self.hyper["lr"] = lr

    @torch.no_grad()
    def clip_and_step(self, max_grad_norm: float) -> float:
        """Clip the global gradient norm to ``max_grad_norm`` (0 = no clipping), step every chunk, zero
        the gradients. A norm that is not finite (a NaN or inf in a gradient, or a norm past the
        masters' range) skips the step: nothing is committed.

        Returns:
            The global L2 gradient norm before clipping (float; not finite = the step was skipped).
        """
        if self.owned is None and self.grad_norm is None:
            grads = self._master_dtype_grads()
            norm = _total_norm(grads)
            del grads
        else:
            norm = self._owned_norm()
        if not torch.isfinite(norm):
            self.zero_grad()
            return float(norm)
        max_norm = max_grad_norm if max_grad_norm > 0 else float("inf")
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # clip_grads_with_norm_'s coefficient
        self._step_chunks(coef)
        self.zero_grad()
        return float(norm)

    def _owned_norm(self) -> torch.Tensor:
        """The global norm from this optimizer's pieces of the gradients (``grad_norm``; without it
        ``_total_norm`` of the pieces)."""
        pieces = [
            (piece.param, self._flat_grad(piece).to(chunk.dtype))
            for chunk in self.layout
            for piece in chunk.pieces
            if self.params[piece.param].grad is not None
        ]
        if self.grad_norm is not None:
            return self.grad_norm(pieces)
        return _total_norm([_LazyUpcast(g, g.dtype) for _, g in pieces])

    def _master_dtype_grads(self) -> list[_LazyUpcast | None]:
        """Each parameter's gradient in its state dtype (a transient upcast of bf16 ones, made one at a
        time by ``_total_norm``), or None."""
        return [None if p.grad is None else _LazyUpcast(p.grad, state_dtype(p.dtype)) for p in self.params]

    def _step_chunks(self, coef: torch.Tensor) -> None:
        """Every chunk in order; host chunks through the staging ring (see the module docstring)."""
        last_chunk = {piece.param: chunk.index for chunk in self.layout for piece in chunk.pieces}
        host = [c for c in self.layout if c.index in self.host_chunks]
        ring = _StagingRing(self.transfers, [(c, self.state[c.index]) for c in host], self.device)
        stepped: dict[int, torch.Tensor] = {}
        ring.prefetch()
        for chunk in self.layout:
            if chunk.index in self.host_chunks:
                ring.prefetch()  # chunk j+1 loads while chunk j is updated
                self._update(chunk, ring.acquire(chunk.index), coef, stepped)
                ring.release(chunk.index)
            else:
                self._update(chunk, self.state[chunk.index], coef, stepped)
            for piece in chunk.pieces:
                if last_chunk[piece.param] == chunk.index:
                    self.params[piece.param].grad = None
        self._pending = ring.finish()
        for index, step in stepped.items():
            self.steps[index] = step

    def _update(self, chunk: Chunk, state: torch.Tensor, coef: torch.Tensor, stepped: dict) -> None:
        """AdamW on one chunk whose state ``[F, n]`` is on the device, then the parameters' new values."""
        live = [piece for piece in chunk.pieces if self.params[piece.param].grad is not None]
        if not live:
            return
        grad = torch.empty(chunk.numel, dtype=chunk.dtype, device=self.device)
        tensors, opt_state = [], {}
        for piece in live:
            window = slice(piece.offset, piece.offset + piece.numel)
            grad[window].copy_(self._flat_grad(piece))
            target = state[0, window] if chunk.shadow else self._flat(piece)
            target.grad = grad[window]
            moments = state[-2:, window]
            previous = self.steps[piece.param]
            step = previous.clone() if previous is not None else torch.tensor(0.0, dtype=_scalar_dtype())
            opt_state[target] = {"step": step, "exp_avg": moments[0], "exp_avg_sq": moments[1]}
            stepped[piece.param] = step
            tensors.append(target)
        grad.mul_(coef.to(grad.device))
        inner = torch.optim.AdamW(tensors, **self.hyper)
        inner.state.update(opt_state)
        inner.step()
        if chunk.shadow:
            for piece, target in zip(live, tensors):
                self._flat(piece).copy_(target)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    # -- reading and saving state -------------------------------------------------------------------

    def synchronize(self) -> None:
        """Block the host until the last step's stores to the host pool have completed."""
        Transfers.synchronize(self._pending)
        self._pending = []

    def state_tensors(self) -> Iterator[tuple[int, str, torch.Tensor]]:
        """Every parameter's state: ``(index, "master" | "exp_avg" | "exp_avg_sq", tensor)``, in the
        parameter's shape and state dtype, wherever it lives (a view where the parameter is one piece,
        else a copy on its first piece's device). The master of a parameter that is its own master is
        the parameter; moments of a parameter that has not stepped are left out."""
        self.synchronize()
        for index, p in enumerate(self.params):
            own = p.dtype not in SHADOWED
            yield index, "master", p.detach() if own else self._gather(index, "master")
            if self.steps[index] is not None:
                for name in FIELDS[1:]:
                    yield index, name, self._gather(index, name)

    def _gather(self, index: int, name: str) -> torch.Tensor:
        parts = []
        for chunk, state in zip(self.layout, self.state):
            row = chunk.fields.index(name) if name in chunk.fields else None
            for piece in chunk.pieces:
                if piece.param == index and row is not None:
                    parts.append(state[row, piece.offset : piece.offset + piece.numel])
        flat = parts[0] if len(parts) == 1 else torch.cat([t.to(parts[0].device) for t in parts])
        return from_storage_order(flat, self.params[index])

    def resident_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes of state per class and place: ``{"master" | "adam": {"device": n, "host": n}}``."""
        out = {"master": {"device": 0, "host": 0}, "adam": {"device": 0, "host": 0}}
        for chunk in self.layout:
            where = "host" if chunk.index in self.host_chunks else "device"
            field_bytes = chunk.numel * chunk.dtype.itemsize
            out["master"][where] += field_bytes if chunk.shadow else 0
            out["adam"][where] += 2 * field_bytes
        return out

    def state_dict(self) -> dict:
        """The format of the optimizer rollplex had before: ``{"inner": torch AdamW state dict over parameter indices,
        "masters": [FP32 CPU tensor per parameter]}`` ("masters" only when a parameter is bf16/fp16).
        With ``owned`` ranges (this rank's ZeRO-1 shard): ``{"owned": the ranges, "chunks": each chunk's
        state [F, n] on the CPU, "steps": each parameter's step count or None, "lr"}``."""
        if self.owned is not None:
            self.synchronize()
            return {
                "owned": list(self.owned),
                "chunks": [state.detach().to("cpu", copy=True) for state in self.state],
                "steps": [None if t is None else t.clone() for t in self.steps],
                "lr": self.lr,
            }
        state = {}
        for index, name, tensor in self.state_tensors():
            if name != "master":
                entry = state.setdefault(index, {"step": self.steps[index].clone()})
                entry[name] = tensor.detach().to("cpu", copy=True)
        group = {**self._group_defaults(), "params": list(range(len(self.params)))}
        out = {"inner": {"state": state, "param_groups": [group]}}
        if any(p.dtype in SHADOWED for p in self.params):
            out["masters"] = [self._master_copy(i) for i in range(len(self.params))]
        return out

    def _master_copy(self, index: int) -> torch.Tensor:
        if self.params[index].dtype in SHADOWED:
            return self._gather(index, "master").to("cpu", copy=True)
        return self.params[index].detach().float().cpu()

    def _group_defaults(self) -> dict:
        """The param-group settings torch's AdamW keeps (every key of this torch version)."""
        probe = torch.optim.AdamW([torch.zeros(1)], **self.hyper).param_groups[0]
        return {k: v for k, v in probe.items() if k != "params"}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Load a state dict of ``ChunkedAdamW`` or of the optimizer rollplex had before (the same format).

        Raises:
            ValueError: the saved parameter count or a tensor's shape differs from this optimizer's, or
                the saved owned ranges are not this optimizer's.
        """
        if self.owned is not None or "owned" in state:
            self._load_owned(state)
            return
        inner = state["inner"]
        saved = inner["param_groups"][0]["params"]
        if len(saved) != len(self.params):
            raise ValueError(f"optimizer state has {len(saved)} parameters, the model {len(self.params)}")
        self.synchronize()
        masters = state.get("masters")
        entries = {position: inner["state"].get(key) for position, key in enumerate(saved)}
        for chunk, host in zip(self.layout, self.state):
            for piece in chunk.pieces:
                self._load_piece(chunk, host, piece, entries[piece.param], masters)
        self.steps = [None if e is None else e["step"].clone() for e in entries.values()]
        self.hyper["lr"] = inner["param_groups"][0]["lr"]

    def _load_owned(self, state: dict) -> None:
        """``load_state_dict`` of an owned-ranges state (``state_dict``'s second form)."""
        saved = [tuple(r) for r in state.get("owned", [])]
        if self.owned is None or saved != self.owned:
            raise ValueError(
                "optimizer state of another ownership: it was saved for element ranges "
                f"{saved[:2]}..., this optimizer owns {(self.owned or [])[:2]}... (resume with the same "
                "parallel layout)"
            )
        self.synchronize()
        for target, source in zip(self.state, state["chunks"], strict=True):
            if target.shape != source.shape:
                raise ValueError(
                    f"optimizer chunk of shape {tuple(source.shape)}, expected {tuple(target.shape)}"
                )
            target.copy_(source)
        self.steps = [None if t is None else t.clone() for t in state["steps"]]
        self.hyper["lr"] = state["lr"]
        for chunk, chunk_state in zip(self.layout, self.state):  # the parameters from their masters
            if chunk.shadow:
                for piece in chunk.pieces:
                    self._flat(piece).copy_(chunk_state[0, piece.offset : piece.offset + piece.numel])

    def _load_piece(self, chunk: Chunk, state: torch.Tensor, piece: Piece, entry, masters) -> None:
        window = slice(piece.offset, piece.offset + piece.numel)
        shape = tuple(self.params[piece.param].shape)
        sources = {"exp_avg": None, "exp_avg_sq": None, "master": None}
        if entry is not None:
            sources.update(exp_avg=entry["exp_avg"], exp_avg_sq=entry["exp_avg_sq"])
        if chunk.shadow and masters is not None:
            sources["master"] = masters[piece.param]
        for row, name in enumerate(chunk.fields):
            source = sources[name]
            if source is not None and tuple(source.shape) != shape:
                raise ValueError(
                    f"optimizer state {name} of parameter {piece.param} is {tuple(source.shape)}, "
                    f"the parameter {shape}"
                )
            target = state[row, window]
            if source is not None:
                target.copy_(in_storage_order(source, self.params[piece.param])[piece.start : piece.stop])
            elif name == "master":
                target.copy_(self._flat(piece))
            else:
                target.zero_()


def storage_flat(param: torch.Tensor) -> torch.Tensor:
    """The flat view of a parameter's bytes in storage order: ``param`` contiguous, or the transpose of a
    contiguous 2-D slab (a Case 2 weight, parallel.weight_sharing)."""
    return param.reshape(-1) if param.is_contiguous() else param.t().reshape(-1)


def in_storage_order(tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``tensor`` (``param``'s shape) flattened in ``param``'s storage order (a view where the layouts
    agree, else a copy)."""
    return tensor.reshape(-1) if param.is_contiguous() else tensor.t().reshape(-1)


def from_storage_order(flat: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A flat tensor in ``param``'s storage order as a tensor of ``param``'s shape (a view)."""
    return flat.view(param.shape) if param.is_contiguous() else flat.view(param.t().shape).t()


class _StagingRing:
    """The device buffers host chunks stream through: ``STAGING_SLOTS`` slots used in turn, each
    allocated on the compute stream (so its block is the compute stream's) and sized for the largest
    host chunk of its dtype.

    Args:
        transfers: the residency manager's streams.
        chunks: the host chunks in update order, each with its host state ``[F, n]``.
        device: the compute device.
    """

    def __init__(self, transfers: Transfers, chunks: list[tuple[Chunk, torch.Tensor]], device: torch.device):
        self.transfers, self.device = transfers, device
        self.queue = list(chunks)
        self.slots: list[torch.Tensor | None] = [None] * STAGING_SLOTS
        self.freed: list[Event] = [None] * STAGING_SLOTS  # the last store out of each slot
        self.loaded: dict[int, tuple[int, torch.Tensor, torch.Tensor, Event]] = {}
        self.issued = 0
        self.sizes: dict[torch.dtype, int] = {}
        for _, host in chunks:
            self.sizes[host.dtype] = max(self.sizes.get(host.dtype, 0), host.numel())

    def prefetch(self) -> None:
        """Issue the load of the next host chunk (if any) into the next slot, after that slot's last
        store and after everything issued so far on the compute stream."""
        if self.issued == len(self.queue):
            return
        chunk, host = self.queue[self.issued]
        slot = self.issued % STAGING_SLOTS
        self.issued += 1
        buffer = self.slots[slot]
        if buffer is None or buffer.dtype != host.dtype:
            self.transfers.wait(self.freed[slot])  # the old buffer's store ends before its block is reused
            buffer = self.slots[slot] = torch.empty(
                self.sizes[host.dtype], dtype=host.dtype, device=self.device
            )
        work = buffer[: host.numel()].view_as(host)
        after = (self.transfers.mark(), self.freed[slot])
        self.loaded[chunk.index] = (slot, work, host, self.transfers.load(work, host, "optimizer", after))

    def acquire(self, index: int) -> torch.Tensor:
        """Chunk ``index``'s state on the device, once its load has completed (the compute stream waits)."""
        slot, work, host, event = self.loaded[index]
        self.transfers.wait(event)
        return work

    def release(self, index: int) -> None:
        """Store chunk ``index``'s updated state back to the host after the compute stream's work on it."""
        slot, work, host, _ = self.loaded.pop(index)
        self.freed[slot] = self.transfers.store(host, work, "optimizer", after=(self.transfers.mark(),))

    def finish(self) -> list[Event]:
        """Make the compute stream wait for every store (the slots' blocks are then safe to free there);
        returns the stores' events, for the host to wait on before reading host state."""
        for event in self.freed:
            self.transfers.wait(event)
        return [e for e in self.freed if e is not None]


class _LazyUpcast:
    """A gradient and the dtype its norm is taken in; ``tensor()`` makes the upcast copy."""

    def __init__(self, grad: torch.Tensor, dtype: torch.dtype):
        self.grad, self.dtype = grad, dtype

    def tensor(self) -> torch.Tensor:
        return self.grad if self.grad.dtype == self.dtype else self.grad.to(self.dtype)


def _total_norm(grads: Sequence[_LazyUpcast | None]) -> torch.Tensor:
    """``torch.nn.utils.get_total_norm`` (norm type 2) of the upcast gradients, computed one gradient at
    a time: per-tensor norms with ``torch._foreach_norm`` where torch's own function uses it for the
    tensor's device and dtype, else ``torch.linalg.vector_norm``; the norms stacked in torch's order
    (grouped by device and dtype, in order of first appearance) and their L2 norm taken. An empty list
    gives 0."""
    present = [g for g in grads if g is not None]
    if not present:
        return torch.tensor(0.0)
    first = present[0].grad.device
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in present:
        t = g.tensor()
        norm = (
            torch._foreach_norm([t], 2.0)[0]
            if _has_foreach_support([t], t.device)
            else torch.linalg.vector_norm(t, 2.0)
        )
        groups.setdefault((t.device, t.dtype), []).append(norm)
        del t
    norms = [n.to(first) for group in groups.values() for n in group]
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)
