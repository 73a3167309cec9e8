"""Module paging: a frozen module's parameters released from the device and restored, keeping the tensors.

The reference model is read only in its prefix (Phase 1) and scoring (Phase 2) windows (paper §3.2:
"frozen reference weights are paged into HBM for their Phase-1 prefix and Phase-2 scoring windows and
may be evicted between those windows"; Appendix Table 3, "Reference-model parameters"). The paper keeps
tensor objects valid across an eviction with CUDA VMM because its engines are separate processes; in
one process the same effect is a storage resize, as FSDP2 does for its unsharded parameters: page out
= ``untyped_storage().resize_(0)`` (the device block goes back to the caching allocator; every tensor
keeps its identity, shape and strides), page in = ``resize_`` back to the storage's size and an
asynchronous copy from the module's copy in the pinned host pool. Only the data pointer may change,
which matters only to a CUDA graph captured across the release (the reference has none).

Streams (CUDA): a page-in allocates on the current stream (the compute stream of the step, whose
later allocations — the backward's, the optimizer's — can then reuse the blocks a page-out returns) and
copies on the load stream after everything issued so far on the current stream; consumers wait on the
page-in's event (``wait``) before they read. A page-out releases the blocks on the current stream: call
it on the stream that ran the module's last reader, or after that stream was waited on.

Example:
    pages = PagedModule("reference", ref_model, pool, transfers)   # host copy taken once
    pages.page_out()                                               # device storage released
    pages.prefetch(); ...; pages.wait()                            # restored before the next use
"""

from __future__ import annotations

import torch

from rollplex.memory.host_pool import PinnedHostPool
from rollplex.memory.transfers import Event, Transfers


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over all of ``storage``'s bytes."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),))


class PagedModule:
    """The parameters of ``module``, pageable between the device and the host pool.

    Args:
        tag: the state class (``"reference"``); names the pool views and the counted bytes.
        module: a frozen module; its parameters' storages (each once, tied weights included) are paged.
        pool: the host pool holding one copy of every storage (taken, and filled, here).
        transfers: the residency manager's streams.

    Raises:
        ValueError: the pool has too little room (``PinnedHostPool.take``).
    """

    def __init__(self, tag: str, module: torch.nn.Module, pool: PinnedHostPool, transfers: Transfers):
        self.tag, self.transfers = tag, transfers
        storages: dict[int, torch.UntypedStorage] = {}
        for p in module.parameters():
            storage = p.untyped_storage()
            storages.setdefault(storage.data_ptr(), storage)
        self.storages = list(storages.values())
        self.sizes = [s.nbytes() for s in self.storages]
        self.host = [pool.take(f"{tag}/{i}", (n,), torch.uint8) for i, n in enumerate(self.sizes)]
        for host, storage in zip(self.host, self.storages):
            host.copy_(_bytes_of(storage))
        self.on_device = True
        self.event: Event = None

    @property
    def nbytes(self) -> int:
        """Bytes of the paged storages."""
        return sum(self.sizes)

    def page_out(self) -> None:
        """Release the device storage of every parameter (a no-op when already out). The parameters
        must not be read until ``prefetch`` and ``wait``."""
        if not self.on_device:
            return
        self.wait()
        for storage in self.storages:
            storage.resize_(0)
        self.on_device = False

    def prefetch(self) -> None:
        """Start restoring the device storage (a no-op when on the device): allocate and copy on the
        load stream; ``wait`` orders the current stream after it."""
        if self.on_device:
            return
        for storage, size in zip(self.storages, self.sizes):
            storage.resize_(size)  # on the current stream: its blocks return there when paged out
        after = (self.transfers.mark(),)
        events = [
            self.transfers.load(_bytes_of(storage), host, self.tag, after)
            for storage, host in zip(self.storages, self.host)
        ]
        self.event = events[-1] if events else None  # one stream: the last copy ends after the others
        self.on_device = True

    def wait(self) -> None:
        """Make the current stream wait for the last ``prefetch`` (no-op on the CPU or when none)."""
        self.transfers.wait(self.event)
        self.event = None

    def resident_bytes(self) -> dict[str, int]:
        """``{"device": bytes on the device, "host": bytes of the host copy}``."""
        return {"device": self.nbytes if self.on_device else 0, "host": sum(h.numel() for h in self.host)}
