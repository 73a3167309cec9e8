"""Saved-tensor offload: what autograd keeps for the actor prefix's backward goes to the host pool as it
is produced, and comes back for the backward, without cutting the autograd path.

Paper §3.2 ("Training-prefix saved state is offloaded as it is produced") and Appendix Table 3
("Training-prefix activation/checkpoint state: offloaded immediately to PinnedPool ... rematerialized
during backward"): the actor prefix runs in Phase 1, during decode, but its backward runs in Phase 2,
so everything it saves would otherwise sit in HBM across the decode window. Built on
``torch.autograd.graph.saved_tensors_hooks`` (torch docs, "Hooks for saved tensors"): the pack hook
runs when autograd saves a tensor and returns a handle in its place; the unpack hook runs when the
backward needs it and returns a tensor with the same contents. The approach is torchtune's activation
offloading (``torchtune.training._activation_offloading.OffloadActivations``: offload on a side stream,
keep the activation alive until its copy is done, reload on the side stream ahead of use); here the
copies go through the residency manager's streams into the pool's arena (no pinned allocation per
tensor), and a group's tensors are prefetched before its backward.

With ``model.gradient_checkpointing`` and layer recompute, what the prefix saves is each decoder layer's
and vision block's input (``models.recompute``): those are what move. Parameters, buffers and tensors
below ``min_bytes`` stay where they are, and so do non-contiguous tensors (rare; they are counted).

Streams (CUDA)::

    pack:    compute ──mark──▶ offload stream: copy device→host (arena)   the activation is kept
             alive until that copy's event has completed (checked at the next pack, waited at exit)
    prefetch compute (allocates) ──mark──▶ load stream: copy host→device ──event──▶ unpack waits

Example:
    offload = SavedTensorOffload(transfers, arena, keep=actor.parameters())
    for g, prompt in enumerate(prompts):
        with offload.group(g):
            states.append(prefix_states(actor, [prompt], ..., attached=True)[0])
    ...                                   # Phase 2, before group g's backward:
    offload.prefetch(g); loss_g.backward(); offload.release(g)
    offload.reset()                       # end of step: the arena is reused from its start
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Hashable, Iterable, Iterator

import torch

from rollplex.memory.host_pool import Arena
from rollplex.memory.transfers import Event, Transfers

MIN_OFFLOAD_BYTES = 1 << 20  # smaller saved tensors are not worth a copy each way


@dataclasses.dataclass
class _Handle:
    """One offloaded tensor: its host copy, and its device copy once prefetched."""

    host: torch.Tensor
    device: torch.device
    device_copy: torch.Tensor | None = None
    loaded: Event = None


class SavedTensorOffload:
    """Offload of the tensors autograd saves inside ``group(key)`` blocks, into ``arena``.

    Args:
        transfers: the residency manager's streams.
        arena: the host pool region the copies go to (``PinnedHostPool.arena``); ``reset`` empties it.
        keep: tensors never offloaded (the module's parameters and buffers), by storage.
        min_bytes: smaller tensors stay where they are.
        tag: the state class the copies are counted under.

    Attributes:
        offloaded_bytes, kept_bytes: bytes of saved tensors moved to the host / left in place since the
            last ``reset``; overflow_bytes: of the kept ones, those left because the arena was full.
    """

    def __init__(
        self,
        transfers: Transfers,
        arena: Arena,
        *,
        keep: Iterable[torch.Tensor] = (),
        min_bytes: int = MIN_OFFLOAD_BYTES,
        tag: str = "prefix_activations",
    ):
        self.transfers, self.arena, self.min_bytes, self.tag = transfers, arena, min_bytes, tag
        self.keep = {t.untyped_storage().data_ptr() for t in keep}
        self.groups: dict[Hashable, list[_Handle]] = {}
        self.in_flight: list[tuple[torch.Tensor, Event]] = []  # activations whose copy may still run
        self.offloaded_bytes = self.kept_bytes = self.overflow_bytes = 0
        self.last_step = {"offloaded": 0, "overflow": 0}  # the counts ``reset`` found (the step just ended)
        self._current: list[_Handle] | None = None

    @contextlib.contextmanager
    def group(self, key: Hashable) -> Iterator[None]:
        """Offload what autograd saves inside the block, as group ``key``'s tensors. On exit the compute
        stream waits for the group's copies (no host wait), so the activations can be freed."""
        handles = self.groups.setdefault(key, [])
        previous, self._current = self._current, handles
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._current = previous
            for _, event in self.in_flight:
                self.transfers.wait(event)
            self.in_flight.clear()

    def _pack(self, t: torch.Tensor):
        if isinstance(t, torch.nn.Parameter) or t.untyped_storage().data_ptr() in self.keep:
            return t
        small = t.numel() * t.element_size() < self.min_bytes
        if small or not t.is_contiguous() or not self.arena.fits(t.shape, t.dtype):
            # an arena the plan sized too small keeps the rest on the device (counted), never fails
            self.kept_bytes += t.numel() * t.element_size()
            self.overflow_bytes += 0 if small or not t.is_contiguous() else t.numel() * t.element_size()
            return t
        self.in_flight = [(a, e) for a, e in self.in_flight if e is not None and not e.query()]
        host = self.arena.alloc(t.shape, t.dtype)
        event = self.transfers.store(host, t, self.tag, after=(self.transfers.mark(),))
        if event is not None:
            self.in_flight.append((t, event))  # keep it until its copy is done
        self.offloaded_bytes += host.numel() * host.element_size()
        handle = _Handle(host, t.device)
        self._current.append(handle)
        return handle

    def _load(self, handle: _Handle) -> None:
        """Issue the copy of ``handle`` back to the device (allocated on the current stream)."""
        handle.device_copy = torch.empty(handle.host.shape, dtype=handle.host.dtype, device=handle.device)
        handle.loaded = self.transfers.load(
            handle.device_copy, handle.host, self.tag, after=(self.transfers.mark(),)
        )

    def _unpack(self, packed):
        if not isinstance(packed, _Handle):
            return packed
        if packed.device_copy is None:
            self._load(packed)
        self.transfers.wait(packed.loaded)
        out, packed.device_copy, packed.loaded = packed.device_copy, None, None
        return out

    def prefetch(self, key: Hashable) -> None:
        """Start loading group ``key``'s tensors back, on the load stream; call it on the stream that
        will run the group's backward (the copies are allocated there), ahead of the backward."""
        for handle in self.groups.get(key, ()):
            if handle.device_copy is None:
                self._load(handle)

    def release(self, key: Hashable) -> None:
        """Forget group ``key`` after its backward (its arena bytes are reused after ``reset``)."""
        for handle in self.groups.pop(key, ()):
            Transfers.synchronize([handle.loaded])
            handle.device_copy = None

    def reset(self) -> None:
        """End of step: wait for every copy still running, forget every group, empty the arena."""
        Transfers.synchronize([e for _, e in self.in_flight])
        self.in_flight.clear()
        for key in list(self.groups):
            self.release(key)
        self.arena.reset()
        self.last_step = {"offloaded": self.offloaded_bytes, "overflow": self.overflow_bytes}
        self.offloaded_bytes = self.kept_bytes = self.overflow_bytes = 0

    def resident_bytes(self) -> dict[str, int]:
        """``{"device": saved bytes left on the device, "host": arena bytes in use}`` since ``reset``."""
        return {"device": self.kept_bytes, "host": self.arena.used}
