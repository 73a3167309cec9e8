"""Host↔device copies of managed state: the two transfer streams, their events, and bytes moved per tag.

The residency manager (``memory.residency``) creates one ``Transfers`` per process and hands it to the
components that stream state (the chunked optimizer, module paging, saved-tensor offload), so every
copy of managed state between host and device is issued here, on the stream it belongs to, and counted
under its state class. On CUDA, loads (host → device) run on a load stream and stores (device → host)
on an offload stream, so both directions overlap each other and the compute stream (paper §3.2,
"separate load, update, and offload streams"); the consumer waits on the event a copy returns. On the
CPU there are no streams: copies are synchronous and the events are None.

Who waits on what::

    compute  ──mark()──▶ load stream:    wait(after) → copy host→device → event "loaded"
    compute  ◀─wait(loaded)── ... uses the data ... ──mark()──▶ offload stream:
                                         wait(after) → copy device→host → event "stored"

A device tensor that a load writes must be allocated on the stream that will use it (and the load
told to wait for that stream's ``mark()``), so the caching allocator never hands its block to anyone
before the consumer is done; a device tensor a store reads must not be freed on its stream before the
store's event (wait on it first).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch

Event = torch.cuda.Event | None


class Transfers:
    """Load and offload streams of ``device`` (None on the CPU) and the byte counters.

    Args:
        device: the compute device; streams exist only for CUDA.

    Attributes:
        moved: bytes copied per tag, ``{tag: {"h2d": int, "d2h": int}}``.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.load_stream = torch.cuda.Stream(self.device) if cuda else None
        self.offload_stream = torch.cuda.Stream(self.device) if cuda else None
        self.moved: dict[str, dict[str, int]] = defaultdict(lambda: {"h2d": 0, "d2h": 0})

    def mark(self) -> Event:
        """An event recorded on the current stream (None on the CPU): what a copy must wait for."""
        if self.load_stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait(self, event: Event) -> None:
        """Make the current stream wait for ``event`` (no-op for None)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def load(self, dst: torch.Tensor, src: torch.Tensor, tag: str, after: Iterable[Event] = ()) -> Event:
        """Copy host ``src`` into device ``dst`` (same shape) on the load stream, after ``after``.

        Returns:
            The event of the copy's completion (None on the CPU, where it has completed).
        """
        self.moved[tag]["h2d"] += src.numel() * src.element_size()
        return self._copy(self.load_stream, dst, src, after)

    def store(self, dst: torch.Tensor, src: torch.Tensor, tag: str, after: Iterable[Event] = ()) -> Event:
        """Copy device ``src`` into host ``dst`` on the offload stream, after ``after``; as ``load``."""
        self.moved[tag]["d2h"] += src.numel() * src.element_size()
        return self._copy(self.offload_stream, dst, src, after)

    @staticmethod
    def _copy(stream, dst: torch.Tensor, src: torch.Tensor, after: Iterable[Event]) -> Event:
        if stream is None:
            dst.copy_(src)
            return None
        with torch.cuda.stream(stream):
            for event in after:
                if event is not None:
                    stream.wait_event(event)
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    @staticmethod
    def synchronize(events: Iterable[Event]) -> None:
        """Block the host until every event has completed (host reads of stored state)."""
        for event in events:
            if event is not None:
                event.synchronize()
