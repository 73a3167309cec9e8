"""Python's cyclic garbage collector between training steps, not inside them (``run.step_gc``).

A step of the 3B workload allocates enough Python objects (tensors, autograd nodes, the wrappers of
compiled regions) for the collector to run about 350 automatic passes, and the passes over its oldest
generation scan every object the process holds: the model, transformers' modules, torch.compile's
caches. On one H200 those passes took about 0.6 s of host time in most steps (``scripts/host_probe.py``),
time in which the host issues no kernels, and they fall wherever a threshold is crossed.

``StepCollector`` turns the automatic passes off for the steps it wraps and runs one full pass after
each step, so the garbage of a step is freed before the next one starts. After the first step (which
builds the compiled code and the allocator's pools), what is still alive is frozen out of later passes
(``gc.freeze``): those objects live for the whole run, so scanning them again every step finds nothing.
Freezing does not keep objects alive: reference counting still frees them; only a reference cycle
among frozen objects would wait for the end of the run, when they are unfrozen. The pattern of
disabling automatic passes and collecting at step boundaries is the usual one in training loops.
"""

from __future__ import annotations

import gc


class StepCollector:
    """Context for a run of steps: automatic passes off inside, a full pass at each ``step_done``.

    ``enabled=False`` changes nothing (Python's automatic passes, as configured outside). On exit the
    collector's state before entry is restored, and what was frozen is unfrozen.
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._was_enabled = gc.isenabled()
        self._froze = False

    def __enter__(self) -> StepCollector:
        if self.enabled:
            self._was_enabled = gc.isenabled()
            gc.disable()
        return self

    def step_done(self) -> None:
        """A full pass over what the step left; after the first step, freeze what remains."""
        if not self.enabled:
            return
        gc.collect()
        if not self._froze:
            gc.freeze()
            self._froze = True

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        if self._froze:
            gc.unfreeze()
            self._froze = False
        if self._was_enabled:
            gc.enable()
