"""Phase-1 concurrency: prefix work on a worker thread (and, on CUDA, its own stream) while decode runs.

Who waits on what:

    main thread, main stream:     [rollout prefix]
    main thread, decode stream:                   [capture]──[decode ..............]──sync──join──▶ Phase 2
    worker thread, prefix stream:                          └─start──[ref prefix][actor prefix]──sync─┘
                                                                     join: the main stream waits on the
                                                                     decode and prefix streams; boundary
                                                                     tensors are marked as used by it

Co-running levers: decode on a high-priority stream (``decode_stream``; its CUDA graphs
are captured on a stream of the same priority), the prefix work issued in chunks (the worker
synchronises its stream between chunks, ``SideWork.chunk_barrier``), an SM carve-out that keeps cuBLAS
matrix products launched from ``SideWork.start`` until ``SideWork.decode_done`` off some SMs, and SM
partitioning: the worker issues its kernels on a green-context stream (``green_stream``) whose kernels,
of every kind, run on a fixed subset of the SMs, while decode's may use all of them. The carve-out is
process state: it is meant for captured decode, whose graphs keep the kernels they were captured with,
and is lifted as soon as decode ends so prefix work left over runs on the whole GPU; a green stream is
left at the first chunk barrier after decode ends.

Stream-ordered memory: tensors allocated on the decode or worker stream and later used on the main
stream are safe to free because each Phase 1 starts with those streams waiting on the main stream,
which orders any reuse of their memory after every earlier main-stream use. The caching allocator
reuses freed memory only on the stream that allocated it, so the rollout prefill (without prefill
fusion) runs on the main stream, where Phase 2 can reuse its transient memory, and only decode's own
buffers come from the decode stream. The attached actor
prefix's backward (Phase 2) runs its ops on the worker stream, where their forward ran; autograd orders
those against the main stream itself (so the attached actor prefix never goes on a green stream:
``schedule.prefix_sms`` needs prefill fusion). Without prefill fusion, the attached actor prefix runs on the
worker stream, so the parameters' gradient accumulators receive gradients from both streams; torch
reports that with a warning, which ``cross_stream_backward`` turns off for that backward. The mismatch is
by design, and torch synchronises it (the parameters equal serial's bitwise; on the GPU this was
tested with checkpointing off and under torch's checkpoint, not yet with layer recompute's backward
inside backward).

This module is the only place that creates threads or streams for the schedule; model code never
synchronises. On the CPU the worker is a plain thread (torch releases the GIL inside its kernels), so the
same code path runs, and must give bitwise the same numbers, in the CPU tests.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}
_GREEN: dict[tuple[int, int], tuple[object, torch.cuda.Stream | None, int]] = {}


def side_stream(device: torch.device, priority: int = 0) -> torch.cuda.Stream:
    """The worker stream of ``device`` at ``priority``, created once and reused every step (the caching
    allocator reuses freed memory only on the stream that allocated it)."""
    key = (device.index if device.index is not None else torch.cuda.current_device(), priority)
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(device, priority=priority)
    return _STREAMS[key]


def green_stream(device: torch.device, sms: int) -> tuple[torch.cuda.Stream | None, int]:
    """A stream whose kernels run on a subset of the streaming multiprocessors of ``device``: a CUDA
    green context's stream (torch.cuda.green_contexts; CUDA driver 12.8+) of at least ``sms`` SMs,
    created once per (device, sms) and kept with its context for the life of the process. Kernels on
    other streams of the primary context may still use every SM.

    Returns:
        (stream, SMs it runs on): the driver rounds ``sms`` up to its partition granularity (a multiple
        of a few SMs, which depends on the device), read back from the driver where cuda.bindings can, else
        ``sms``. (None, 0), with a warning the first time, where torch, cuda.bindings or the driver has
        no green contexts or the rounded count is not below the device's SM count (callers then use a
        plain stream).
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, sms)
    if key not in _GREEN:
        _GREEN[key] = _make_green(index, sms)
    _, stream, count = _GREEN[key]
    return stream, count


def _partition_sms(index: int, sms: int) -> tuple[int, str]:
    """(SM count the driver gives a green context asked for ``sms``, why not): ``sms`` if it cannot tell
    (no cuda.bindings, another API version), 0 and the driver's error if it refuses the split."""
    try:
        from cuda.bindings import driver

        ok = driver.CUresult.CUDA_SUCCESS
        err, device = driver.cuDeviceGet(index)
        if err == ok:
            err, resource = driver.cuDeviceGetDevResource(
                device, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM
            )
        if err == ok:
            err, groups, count, _ = driver.cuDevSmResourceSplitByCount(1, resource, 0, sms)
        if err != ok or count != 1:
            return 0, f"the driver cannot split {sms} SMs ({getattr(err, 'name', err)})"
        return int(groups[0].sm.smCount), ""
    except Exception:  # noqa: BLE001 - no cuda.bindings, or another API version: keep the request
        return sms, ""


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)


def _make_green(index: int, sms: int) -> tuple[object, torch.cuda.Stream | None, int]:
    total = torch.cuda.get_device_properties(index).multi_processor_count
    count, why = _partition_sms(index, sms) if 0 < sms < total else (0, f"not below the device's {total}")
    if count >= total:
        count, why = 0, f"the driver gives {count} SMs, the device's {total}"
    if count == 0:
        log.warning("prefix SMs %d: %s; prefixes use every SM", sms, why)
        return None, None, 0
    try:
        from torch.cuda.green_contexts import GreenContext

        context = GreenContext.create(num_sms=sms, device_id=index)
        stream = context.Stream()
    except Exception as err:  # noqa: BLE001 - missing module, cuda.bindings, old driver: all mean "not here"
        log.warning("prefix SMs %d: no CUDA green context here (%s); prefixes use every SM", sms, err)
        return None, None, 0
    log.info("prefix work on a green context of %d SMs (%d asked) of %d", count, sms, total)
    return context, stream, count


def decode_stream(device: torch.device) -> torch.cuda.Stream:
    """The high-priority stream decode runs on while prefix work co-runs (created once per device)."""
    return side_stream(device, priority=-1)


@contextlib.contextmanager
def on_stream(stream: torch.cuda.Stream | None):
    """Run the body on ``stream`` (after the current stream's queued work); the current stream then
    waits for it. ``None`` runs the body where it is."""
    if stream is None:
        yield
        return
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        current.wait_stream(stream)


def set_sm_carveout(sms: int | None) -> int | None:
    """Keep ``sms`` streaming multiprocessors free of cuBLAS matrix products launched from now on
    (None = no carve-out); returns the previous setting. A no-op returning None where torch lacks it."""
    getter = getattr(torch._C, "_get_sm_carveout_experimental", None)
    setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if getter is None or setter is None:
        return None
    previous = getter()
    setter(sms)
    return previous


@contextlib.contextmanager
def cross_stream_backward():
    """Turn off torch's "AccumulateGrad node's stream does not match" warning for the body, then restore
    the previous setting. For the actor backward after an overlapped Phase 1 without prefill fusion:
    the attached prefix's forward ran on the worker stream and the suffixes' on the main stream, so
    each parameter's gradient accumulator, made on one of them, receives gradients from the other as
    well; autograd synchronises the two streams there
    (torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch). With fusion the actor prefix
    runs on the main stream and nothing changes. A no-op where torch lacks the setting's getter or
    setter (private torch._C functions)."""
    getter = getattr(torch._C, "_warn_on_accumulate_grad_stream_mismatch", None)
    setter = getattr(torch._C, "_set_warn_on_accumulate_grad_stream_mismatch", None)
    if getter is None or setter is None:
        yield
        return
    previous = getter()
    setter(False)
    try:
        yield
    finally:
        setter(previous)


def stream_sync(device: torch.device) -> None:
    """Wait for the current stream of ``device`` only (not the whole device)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


@dataclass
class SideResult:
    """What a side worker produced, and when it ran (``time.perf_counter`` seconds)."""

    value: object
    start: float
    end: float


class SideWork:
    """Run ``fn()`` on a worker thread, on its own CUDA stream when ``device`` is CUDA.

    Args:
        fn: the work; returns the value ``join`` hands back. Work issued in chunks calls
            ``chunk_barrier`` between them.
        device: where the work runs.
        sm_carveout: SMs kept free of the work's cuBLAS matrix products while it runs (0 = off, CUDA only).
        sms: SMs the work's kernels may use until the first chunk barrier after decode ends (a green
            context, ``green_stream``, rounded up by the driver; ``green_sms`` is what it got, 0 where
            it fell back to every SM; 0 = all, CUDA only). Work under autograd whose backward must not
            run on those SMs does not belong here (autograd runs each backward op on its forward's
            stream).
    """

    def __init__(self, fn: Callable[[], object], device: torch.device, sm_carveout: int = 0, sms: int = 0):
        self.fn, self.device = fn, device
        self.stream = side_stream(device) if device.type == "cuda" else None
        self.sm_carveout = sm_carveout if self.stream is not None else 0
        use_green = sms > 0 and self.stream is not None
        self.green, self.green_sms = green_stream(device, sms) if use_green else (None, 0)
        self._streams = [s for s in (self.stream, self.green) if s is not None]  # all the work may use
        if sms > 0 and self.stream is None:
            _warn_once(f"prefix SMs {sms}: no SM partitioning on {device.type}; the prefixes run as usual")
        self.started = False
        self._carveout_before: int | None = None
        self._carveout_on = False
        self._decode_done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rollplex-prefix", daemon=True)
        self._result: SideResult | None = None
        self._error: BaseException | None = None

    def start(self) -> SideWork:
        if self._streams:
            current = torch.cuda.current_stream(self.device)
            for stream in self._streams:
                stream.wait_stream(current)  # inputs are ready
        if self.sm_carveout > 0:
            self._carveout_before, self._carveout_on = set_sm_carveout(self.sm_carveout), True
        self._thread.start()
        self.started = True
        return self

    def decode_done(self) -> None:
        """Lift the SM carve-out (restoring the previous setting) and let the next chunk barrier leave
        the green stream: the work continues on the whole GPU (on the green stream's SMs until its next
        chunk barrier, to the end when it is issued in one piece)."""
        self._decode_done.set()
        if self._carveout_on:
            set_sm_carveout(self._carveout_before)
            self._carveout_on = False

    def chunk_barrier(self) -> None:
        """Called by ``fn`` on the worker thread between chunks: wait for the chunk's kernels; once decode
        is done, issue the rest on the plain worker stream (every SM) instead of the green one."""
        stream_sync(self.device)
        if self.green is not None and self._decode_done.is_set():
            self.stream.wait_stream(self.green)
            torch.cuda.set_stream(self.stream)  # the worker thread's current stream; _run restores it

    def _run(self) -> None:
        first = self.green if self.green is not None else self.stream
        context = torch.cuda.stream(first) if first is not None else contextlib.nullcontext()
        try:
            with context:
                start = time.perf_counter()
                try:
                    value = self.fn()
                finally:
                    stream_sync(self.device)  # also after an error: nothing of fn stays queued
                    # fn usually closes over this object (its chunk barrier): a reference cycle that would
                    # keep fn's inputs, and the result, allocated until Python's collector finds it
                    self.fn = None
                self._result = SideResult(value, start, time.perf_counter())
        except BaseException as err:  # handed to the main thread by join()
            self._error = err

    def wait(self) -> None:
        """Wait for the worker, if it started, without taking its result (when the main thread failed)."""
        self.decode_done()
        if self.started:
            self._thread.join()
        self._result = self._error = None  # the main thread's error is the one raised
        self.fn = None  # it closes over this object (see _run); unstarted, it never ran to drop it

    def join(self, consumers: Callable[[SideResult], list[torch.Tensor]] = lambda r: []) -> SideResult:
        """Wait for the worker; make the current stream wait for its stream and mark the tensors that
        ``consumers(result)`` lists as used by the current stream (so the allocator never reuses their
        memory while later kernels still read them).

        Raises:
            whatever ``fn`` raised.
        """
        self.decode_done()
        self._thread.join()
        # handed over, not kept: the caller owns the result (or the error and its frames) from here
        result, error, self._result, self._error = self._result, self._error, None, None
        if error is not None:
            raise error
        assert result is not None
        if self._streams:
            current = torch.cuda.current_stream(self.device)
            for stream in self._streams:
                current.wait_stream(stream)
            for tensor in consumers(result):
                tensor.record_stream(current)
        return result
