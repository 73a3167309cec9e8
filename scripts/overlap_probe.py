"""Where an overlapped Phase 1 spends its prefix time: per iteration of ``rollplex bench schedule`` rows
(default: overlap, then both), the step time, the device allocations the caching allocator made
(``num_device_alloc``), Eq. 1's terms, and for each reference (detached) or actor (attached) prefix
call of the rollplex schedule (``schedule.rollplex``'s ``prefix_states``; the rollout prefill of a
row without fusion is not among them) the thread it ran on, when the host began and finished issuing
it and when the device finished it, in seconds from the step's start. The first
``schedule.rollplex.CALIBRATION_STEPS`` iterations of a row calibrate (prefixes after decode, on the
main thread); in the others the worker starts with decode.

Usage (CUDA): python scripts/overlap_probe.py [ROW ...]
"""

from __future__ import annotations

import threading
import time

import torch

import rollplex.schedule.rollplex as rollplex_schedule
from rollplex.bench.common import cuda_script_args, one_of
from rollplex.bench.schedule import ROWS, ScheduleBenchConfig, _Workload
from rollplex.observe.metrics import PhaseTimer
from rollplex.schedule import make_step
from rollplex.schedule.rollplex import CALIBRATION_STEPS

ROLLPLEX_ROWS = tuple(name for name in ROWS if name != "serial")  # rows with prefix calls to time
TERMS = ("eq1/T_D", "eq1/T_P", "eq1/T_P_corun", "eq1/delta_D", "eq1/span", "eq1/phase1")


def traced(calls: list, prefix_states):
    """``prefix_states`` that also appends (thread, kind, host start, host end, device event) to ``calls``."""

    def wrapper(model, prompts, **options):
        start = time.perf_counter()
        states = prefix_states(model, prompts, **options)
        done = torch.cuda.Event(enable_timing=True)
        done.record(torch.cuda.current_stream())
        kind = "attached" if options.get("attached") else "detached"
        calls.append((threading.current_thread().name, kind, start, time.perf_counter(), done))
        return states

    return wrapper


def probe_row(
    work: _Workload, cfg: ScheduleBenchConfig, name: str, calls: list, iterations: int = CALIBRATION_STEPS + 2
) -> None:
    """Run ``iterations`` steps of bench row ``name`` and print each step's line and its prefix calls."""
    roles = work.roles(ROWS[name], cfg)
    step = make_step(roles.config, work.device)
    timer = PhaseTimer(sync=torch.cuda.synchronize)
    for i in range(iterations):
        calls.clear()
        torch.cuda.synchronize()
        allocs = torch.cuda.memory_stats().get("num_device_alloc", 0)
        start, begun = time.perf_counter(), torch.cuda.Event(enable_timing=True)
        begun.record()
        *_, extra = step(roles, work.prompts, timer)
        seconds = time.perf_counter() - start
        timer.pop()
        allocs = torch.cuda.memory_stats().get("num_device_alloc", 0) - allocs
        terms = ", ".join(f"{k.removeprefix('eq1/')} {extra.get(k, float('nan')):.3f}" for k in TERMS)
        print(f"{name} iteration {i}: {seconds:.3f} s, device allocations {allocs}, {terms}", flush=True)
        for thread, kind, host_start, host_end, done in calls:
            done.synchronize()
            print(
                f"    {thread:16s} {kind:8s} issued {host_start - start:6.3f} -> {host_end - start:6.3f} s, "
                f"device done {begun.elapsed_time(done) / 1e3:6.3f} s",
                flush=True,
            )


def main(rows: list[str]) -> None:
    """Probe each of ``rows`` (bench row names of the rollplex schedule) in one process."""
    calls: list = []
    rollplex_schedule.prefix_states = traced(calls, rollplex_schedule.prefix_states)
    cfg = ScheduleBenchConfig()
    work = _Workload(cfg, torch.device("cuda"))
    for name in rows or ["overlap", "both"]:
        probe_row(work, cfg, name, calls)


if __name__ == "__main__":
    main(
        cuda_script_args(
            __doc__,
            lambda p: p.add_argument(
                "rows", nargs="*", type=one_of(ROLLPLEX_ROWS), help=f"any of {', '.join(ROLLPLEX_ROWS)}"
            ),
        ).rows
    )
