"""The pinned host pool: one host allocation of exactly the planned size, carved into named views.

Offloaded state (FP32 master weights and Adam moments of host chunks, the reference model's host copy,
offloaded prefix activations) lives in host memory that the GPU's copy engines read and write directly
(page-locked), so a ``copy_(..., non_blocking=True)`` between it and the device is asynchronous and runs
at the link's speed (paper §3.2, "Stable-address staging": the pool is preallocated at initialisation
and reused; one pool avoids the fragmentation of many large pinned allocations).

Why not ``torch.empty(..., pin_memory=True)``: torch's caching host allocator rounds each pinned request
up to a power of two, so a request just over a power of two takes almost twice its size. The pool is a
plain CPU ``uint8`` tensor of exactly ``nbytes`` that is page-locked in place with ``cudaHostRegister``
(CUDA runtime API; ``torch.cuda.cudart()`` exposes ``cudaHostRegister`` / ``cudaHostUnregister`` in
torch 2.11 and 2.14). Registered memory is page-locked memory to the driver: ``Tensor.is_pinned()``
asks the driver (``cudaPointerGetAttributes``) and reports True for it, and the copy kernels issue
``cudaMemcpyAsync`` from it without staging. On a CPU-only run nothing is registered.

Layout: named views are handed out from the start of the pool by ``take`` (permanent state: the same
name returns the same view every step); ``arena`` reserves a named region whose own bump allocator is
reset each step (transient state: offloaded activations). Every view starts at a multiple of
``ALIGNMENT`` bytes from the pool's start.

Example:
    pool = PinnedHostPool(pool_bytes([4 * 1024, 1 << 20]), pin=False)
    master = pool.take("optimizer/0", (1024,), torch.float32)   # 4 KiB view
    acts = pool.arena("prefix_activations", 1 << 20)
    x = acts.alloc((256, 256), torch.bfloat16)                    # 128 KiB of the arena
    acts.reset()                                                  # next step starts at offset 0 again
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import weakref
from collections.abc import Iterable, Sequence

import torch

log = logging.getLogger("rollplex")

ALIGNMENT = 512  # bytes; a multiple of every dtype's size and of a 64-byte cache line


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of ``ALIGNMENT``."""
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def pool_bytes(requests: Iterable[int]) -> int:
    """Pool size that holds views (or arenas) of the given byte sizes, each at an aligned offset."""
    return sum(aligned(n) for n in requests)


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


@dataclasses.dataclass(frozen=True)
class _Region:
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _register(buffer: torch.Tensor) -> None:
    """Page-lock ``buffer``'s memory in place (``cudaHostRegister``, flags 0 = default).

    Raises:
        RuntimeError: the runtime refused (the message has its error string and the size).
    """
    cudart = torch.cuda.cudart()
    code = cudart.cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
    if code != cudart.cudaError.success:
        raise RuntimeError(
            f"cudaHostRegister of {buffer.numel()} bytes failed: {cudart.cudaGetErrorString(code)}"
        )


def _unregister(buffer: torch.Tensor) -> None:
    """Undo ``_register`` (``cudaHostUnregister``); the memory is freed when ``buffer`` is."""
    cudart = torch.cuda.cudart()
    code = cudart.cudaHostUnregister(buffer.data_ptr())
    if code != cudart.cudaError.success:
        log.warning("cudaHostUnregister failed: %s", cudart.cudaGetErrorString(code))


class PinnedHostPool:
    """One host allocation of exactly ``nbytes`` bytes, page-locked on CUDA, carved into named views.

    Args:
        nbytes: the pool's size in bytes (``pool_bytes`` of what it will hold); never rounded.
        pin: page-lock it with ``cudaHostRegister``; None = when CUDA is available.
        name: for log lines and errors.

    The size and the time the registration took are logged once, at construction. ``close`` (or leaving
    a ``with`` block, or the pool being garbage-collected) unregisters the memory; views must not be
    used after that.

    Raises:
        ValueError: ``nbytes`` is negative.
        RuntimeError: ``cudaHostRegister`` failed.
    """

    def __init__(self, nbytes: int, *, pin: bool | None = None, name: str = "host pool"):
        if nbytes < 0:
            raise ValueError(f"{name}: size must be >= 0 bytes, got {nbytes}")
        self.name = name
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.pinned = bool(torch.cuda.is_available() if pin is None else pin) and nbytes > 0
        self.pin_seconds = 0.0
        if self.pinned:
            start = time.perf_counter()
            _register(self.buffer)
            self.pin_seconds = time.perf_counter() - start
            self._finalizer = weakref.finalize(self, _unregister, self.buffer)
        log.info("%s: %.3f GiB, page-locked in %.2f s", name, nbytes / 2**30, self.pin_seconds)
        self._regions: dict[str, _Region] = {}
        self._cursor = 0

    @property
    def nbytes(self) -> int:
        """The pool's size in bytes (the storage's, exactly as requested)."""
        return self.buffer.untyped_storage().nbytes()

    @property
    def used(self) -> int:
        """Bytes handed out so far (views and arenas, with their alignment padding)."""
        return self._cursor

    def take(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """The view named ``name``: a host tensor of ``shape`` and ``dtype`` in the pool, contiguous,
        ``ALIGNMENT``-aligned from the pool's start. The first call reserves it; later calls with the
        same name return a view of the same bytes (its contents are whatever was last written).

        Raises:
            ValueError: ``name`` was taken with another shape or dtype, or the pool has fewer free bytes
                than the request (the message names both and the shortfall).
        """
        shape = tuple(int(s) for s in shape)
        region = self._regions.get(name)
        if region is None:
            region = self._reserve(name, _nbytes(shape, dtype), shape, dtype)
        elif (region.shape, region.dtype) != (shape, dtype):
            raise ValueError(
                f"{self.name}: {name!r} was taken as {region.shape} {region.dtype}, asked again as "
                f"{shape} {dtype}"
            )
        return self._view(region).view(dtype).view(shape)

    def arena(self, name: str, nbytes: int) -> Arena:
        """An ``Arena`` over a region of ``nbytes`` bytes named ``name`` (the same region each call).

        Raises:
            ValueError: as ``take``.
        """
        region = self._regions.get(name) or self._reserve(name, nbytes, (nbytes,), torch.uint8)
        if region.nbytes != nbytes:
            raise ValueError(f"{self.name}: arena {name!r} has {region.nbytes} bytes, asked for {nbytes}")
        return Arena(f"{self.name}/{name}", self._view(region))

    def _reserve(self, name: str, nbytes: int, shape: tuple[int, ...], dtype: torch.dtype) -> _Region:
        free = self.nbytes - self._cursor
        if nbytes > free:
            raise ValueError(
                f"{self.name}: {name!r} needs {nbytes} bytes but {free} of the pool's {self.nbytes} are "
                f"free: {nbytes - free} bytes short (raise memory.host_budget_gib)"
            )
        region = _Region(self._cursor, nbytes, shape, dtype)
        self._regions[name] = region
        self._cursor = min(self.nbytes, self._cursor + aligned(nbytes))
        return region

    def _view(self, region: _Region) -> torch.Tensor:
        return self.buffer[region.offset : region.offset + region.nbytes]

    def clear(self) -> None:
        """Forget every named view and arena: the pool is handed out from its start again, to a new owner
        (``rollplex bench`` gives one pool to each row in turn). Views taken before must not be used."""
        self._regions.clear()
        self._cursor = 0

    def close(self) -> None:
        """Unregister the memory (CUDA) and drop the pool's reference to it; idempotent."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
        self._regions.clear()

    def __enter__(self) -> PinnedHostPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Arena:
    """A pool region handed out front to back by a bump allocator and emptied by ``reset``.

    Offloaded activations of one step go here; ``reset`` at the end of the step (after every copy into
    or out of the region has finished: the residency manager waits for its events first) makes the next
    step reuse the same bytes.
    """

    def __init__(self, name: str, region: torch.Tensor):
        self.name = name
        self.region = region
        self._cursor = 0
        self.high_water = 0

    @property
    def capacity(self) -> int:
        return self.region.numel()

    @property
    def used(self) -> int:
        return self._cursor

    def alloc(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous host tensor of ``shape`` and ``dtype`` at the next aligned offset.

        Raises:
            ValueError: the arena has fewer free bytes than the request (the message names the
                shortfall).
        """
        nbytes = _nbytes(shape, dtype)
        free = self.capacity - self._cursor
        if nbytes > free:
            raise ValueError(
                f"{self.name}: {nbytes} bytes requested, {free} of {self.capacity} free: "
                f"{nbytes - free} bytes short (raise memory.host_budget_gib)"
            )
        start = self._cursor
        self._cursor = min(self.capacity, start + aligned(nbytes))
        self.high_water = max(self.high_water, self._cursor)
        return self.region[start : start + nbytes].view(dtype).view(tuple(shape))

    def fits(self, shape: Sequence[int], dtype: torch.dtype) -> bool:
        """Whether ``alloc(shape, dtype)`` has room."""
        return _nbytes(shape, dtype) <= self.capacity - self._cursor

    def reset(self) -> None:
        """Hand out the region from its start again (earlier tensors' bytes get overwritten)."""
        self._cursor = 0
