"""The residency manager: the one owner of where each class of state lives in each window, and the
only component that moves state between host and device (paper §3.2, Appendix Table 3).

It owns the pinned host pool (``memory.host_pool``), the transfer streams and their byte counters
(``memory.transfers``; on the CPU, synchronous copies), the paged modules (``memory.paging``: the
reference) and the saved-tensor offload of the actor prefix (``memory.saved_offload``); the chunked
optimizer streams its own chunks through the streams and pool it is handed from here. ``where`` is the
plan's table (``MemoryPlan.where``): for every state class (``memory.windows.STATE_CLASSES``), its
place in each window (``memory.windows.WINDOWS``). ``enter(window)`` applies it to the paged modules
and samples the bytes of every class on the device and in the host pool.

Integration (the schedule and loop call these; each call goes on the compute stream, in step order)::

    residency = Residency.from_plan(plan, device)                     # once, at start-up
    residency.page("reference", ref_model)                            # pageable reference
    offload = residency.saved_offload(actor, plan.activation_arena_bytes)   # when plan.offload_activations
    optimizer = ChunkedAdamW.for_model(actor, cfg.optim, chunk_mib=cfg.memory.chunk_mib,
                                       host_bytes=plan.optimizer_host_bytes,
                                       pool=residency.pool, transfers=residency.transfers)
    residency.track_optimizer(optimizer)
    residency.track("rollout_kv", lambda: {"device": engine_kv_bytes(), "host": 0})   # probes of what
    residency.track("grads", grad_bytes_probe)                                        # others allocate
    each step:
      residency.enter("rollout")        # prefetches the reference where it is read in Phase 1
      residency.wait("reference")       # on the reference prefix's stream, before its first kernel
      with offload.group(g): actor prefix of group g (attached)
      residency.enter("scoring")        # reference prefetched
      residency.wait("reference"); reference suffix scoring
      residency.enter("backward")       # reference paged out where the plan pages it
      per micro-batch: offload.prefetch(g) for its groups; suffix forward + backward; offload.release(g)
      residency.enter("update"); optimizer.clip_and_step(max_norm)
      residency.end_step()              # the arena is reused next step
    observe: residency.counter_events(origin) → Chrome trace "C" events (observe.metrics writes them)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping

import torch

from rollplex.memory.host_pool import PinnedHostPool
from rollplex.memory.paging import PagedModule
from rollplex.memory.saved_offload import MIN_OFFLOAD_BYTES, SavedTensorOffload
from rollplex.memory.transfers import Transfers
from rollplex.memory.windows import DEVICE, STATE_CLASSES, WINDOWS

Probe = Callable[[], Mapping[str, int]]  # () -> {"device": bytes, "host": bytes}


@dataclasses.dataclass(frozen=True)
class ResidencySample:
    """Bytes of every tracked state class at one moment.

    Attributes:
        label: the window entered (or another label given to ``sample``).
        time: ``time.perf_counter()`` seconds (the clock of ``observe.metrics`` spans).
        device, host: bytes per state class on the device and in the host pool; on CUDA, ``device`` also
            has "other": what the caching allocator holds beyond the tracked classes (activations,
            KV caches, workspaces).
        moved: bytes copied so far per tag, ``{tag: {"h2d": n, "d2h": n}}`` (cumulative).
    """

    label: str
    time: float
    device: dict[str, int]
    host: dict[str, int]
    moved: dict[str, dict[str, int]]


def counter_events(samples: Iterable[ResidencySample], origin: float, pid: int = 0) -> list[dict]:
    """Chrome Trace Event Format counter events (``"ph": "C"``; one series per state class, GiB) of
    ``samples``: ``"device GiB"``, ``"host GiB"`` and ``"moved GiB"`` (host↔device, cumulative), at
    ``ts`` = µs since ``origin`` (a ``time.perf_counter()`` value: the first span's start)."""
    events = []
    for s in samples:
        ts = (s.time - origin) * 1e6
        moved = {tag: (m["h2d"] + m["d2h"]) / 2**30 for tag, m in s.moved.items()}
        for name, values in (("device GiB", s.device), ("host GiB", s.host), ("moved GiB", moved)):
            args = {k: v / 2**30 if name != "moved GiB" else v for k, v in values.items()}
            events.append({"name": name, "ph": "C", "ts": ts, "pid": pid, "args": args})
    return events


def resident_table(paged: Iterable[str] = ()) -> dict[str, dict[str, str]]:
    """The all-resident table: every class on the device in every window, but ``paged`` classes,
    which are on the device only in the windows that read them (the reference: rollout, scoring)."""
    table = {tag: dict.fromkeys(WINDOWS, DEVICE) for tag in STATE_CLASSES}
    for tag in paged:
        table[tag] = {w: DEVICE if w in ("rollout", "scoring") else "host" for w in WINDOWS}
    return table


class Residency:
    """Owner of the host pool, the transfer streams, paged modules, saved-tensor offload and counters.

    Args:
        device: the compute device.
        host_pool_bytes: size of the pinned host pool (``MemoryPlan.host_pool_bytes``).
        where: ``{state class: {window: "device" | "host" | "-"}}`` (``MemoryPlan.where``); default
            ``resident_table()``.
        pin: page-lock the pool (default: on a CUDA device).
        pool: an existing host pool to use instead of allocating one (``host_pool_bytes`` and ``pin`` are
            then ignored; the caller keeps it and closes it), e.g. one pool for several benchmark rows.
    """

    @classmethod
    def from_plan(cls, plan, device: torch.device | str, pool: PinnedHostPool | None = None) -> Residency:
        """The manager for a ``memory.planner.MemoryPlan``: its host pool size (or ``pool``) and table."""
        return cls(device, host_pool_bytes=plan.host_pool_bytes, where=plan.where(), pool=pool)

    def __init__(
        self,
        device: torch.device | str,
        *,
        host_pool_bytes: int = 0,
        where: Mapping[str, Mapping[str, str]] | None = None,
        pin: bool | None = None,
        pool: PinnedHostPool | None = None,
    ):
        self.device = torch.device(device)
        self.transfers = Transfers(self.device)
        self.owns_pool = pool is None
        if pool is None:
            pool = PinnedHostPool(host_pool_bytes, pin=self.device.type == "cuda" if pin is None else pin)
        self.pool = pool
        self.where = {k: dict(v) for k, v in (where or resident_table()).items()}
        self.pages: dict[str, PagedModule] = {}
        self.offloads: list[SavedTensorOffload] = []
        self.probes: dict[str, Probe] = {}
        self.samples: list[ResidencySample] = []

    # -- registration -------------------------------------------------------------------------------

    def page(self, tag: str, module: torch.nn.Module) -> PagedModule:
        """Make ``module``'s parameters pageable under ``tag`` (their host copy is taken now)."""
        pages = self.pages[tag] = PagedModule(tag, module, self.pool, self.transfers)
        self.probes[tag] = pages.resident_bytes
        return pages

    def saved_offload(
        self, module: torch.nn.Module, arena_bytes: int, *, min_bytes: int = MIN_OFFLOAD_BYTES
    ) -> SavedTensorOffload:
        """The saved-tensor offload of ``module``'s forward passes (its parameters and buffers stay),
        into an arena of ``arena_bytes`` in the pool (``MemoryPlan.activation_arena_bytes``)."""
        arena = self.pool.arena("prefix_activations", arena_bytes)
        keep = [*module.parameters(), *module.buffers()]
        offload = SavedTensorOffload(self.transfers, arena, keep=keep, min_bytes=min_bytes)
        self.offloads.append(offload)
        self.probes["prefix_activations"] = offload.resident_bytes
        return offload

    def track(self, tag: str, probe: Probe) -> None:
        """Sample ``probe()`` (``{"device": bytes, "host": bytes}``) as class ``tag`` (state that other
        components allocate and release: rollout KV, decode buffers, gradients)."""
        self.probes[tag] = probe

    def track_optimizer(self, optimizer) -> None:
        """Sample a ``ChunkedAdamW``'s state as the classes ``master`` and ``adam``."""
        for tag in ("master", "adam"):
            self.probes[tag] = lambda tag=tag: optimizer.resident_bytes()[tag]

    # -- moving -------------------------------------------------------------------------------------

    def enter(self, window: str) -> ResidencySample:
        """Apply the table on entering ``window``: each paged module is prefetched where the window
        reads it, else paged out; returns (and keeps) the sample of every class's bytes.

        Raises:
            ValueError: an unknown window.
        """
        if window not in WINDOWS:
            raise ValueError(f"unknown window {window!r}; expected one of {', '.join(WINDOWS)}")
        for tag, pages in self.pages.items():
            if self.where[tag][window] == DEVICE:
                pages.prefetch()
            else:
                pages.page_out()
        return self.sample(window)

    def prefetch(self, tag: str) -> None:
        """Start bringing paged class ``tag`` to the device (ahead of its use)."""
        self.pages[tag].prefetch()

    def wait(self, tag: str) -> None:
        """Order the current stream after ``tag``'s last prefetch (before its first use)."""
        self.pages[tag].wait()

    def page_out(self, tag: str) -> None:
        """Release paged class ``tag``'s device storage (after its last reader, on that stream)."""
        self.pages[tag].page_out()

    def end_step(self) -> None:
        """End of an iteration: the saved-tensor arenas are emptied for the next step."""
        for offload in self.offloads:
            offload.reset()

    # -- counting -----------------------------------------------------------------------------------

    def sample(self, label: str) -> ResidencySample:
        """The bytes of every tracked class now, kept in ``samples``."""
        values = {tag: probe() for tag, probe in self.probes.items()}
        moved = {tag: dict(m) for tag, m in self.transfers.moved.items()}
        device = {tag: v["device"] for tag, v in values.items()}
        if self.device.type == "cuda":  # what the caching allocator holds beyond the tracked classes
            device["other"] = max(0, torch.cuda.memory_allocated(self.device) - sum(device.values()))
        sample = ResidencySample(
            label, time.perf_counter(), device, {tag: v["host"] for tag, v in values.items()}, moved
        )
        self.samples.append(sample)
        return sample

    def counter_events(self, origin: float, pid: int = 0) -> list[dict]:
        """``counter_events`` of every sample so far."""
        return counter_events(self.samples, origin, pid)

    def restore(self) -> None:
        """Bring every paged module back to the device and wait for it (the state before paging)."""
        for pages in self.pages.values():
            pages.prefetch()
            pages.wait()

    def close(self) -> None:
        """Unregister the host pool it allocated (the manager must not be used afterwards)."""
        if self.owns_pool:
            self.pool.close()
