"""``rollplex bench profile``: one GRPO step of a ``rollplex bench schedule`` row under torch.profiler.

After ``warmup`` unprofiled steps (compilation, graph capture, allocator growth), two profiled steps:

1. without Python stacks: the table of operators and kernels by device time (torch.profiler's
   ``key_averages``, the 60 longest, by self time on the device; on the CPU by self CPU time);
2. with Python stacks: where the device sat idle. Every gap of at least 100 µs between device
   activities is charged to the innermost ``rollplex/...`` profiler range and the operators that
   launched the work ending it, and summed by launcher (``observe.idle.gap_table``). A profile without
   device activity (the CPU) has no such table; the result says so.

Each step prints its wall time and phase times. The garbage collector is tuned as in a training run
(``observe.metrics.GcClock``). The workload is the schedule bench's (``--preset tiny`` with small sizes
runs it on the CPU as a smoke test).

Example:
    rollplex bench profile --out results/profile.json                 # serial row, 3B workload, CUDA
    rollplex bench profile --row both-cascade --out results/cascade.json
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from rollplex.bench.common import Workload, bench_device
from rollplex.bench.schedule import ScheduleBenchConfig, default_row
from rollplex.observe.idle import gap_table
from rollplex.observe.metrics import GcClock, PhaseTimer

OPERATOR_ROWS = 60  # rows of the operator table


@dataclass(frozen=True)
class ProfileBenchConfig(Workload):
    """Workload of ``rollplex bench profile``: the schedule bench's, one row of it (``bench.variants.ROWS``)."""

    row: str = "serial"
    warmup: int = 2  # unprofiled steps first: compilation, graph capture, allocator growth
    overrides: tuple[str, ...] = ()  # config overrides (section.field=value) applied to the row's config


@dataclass
class ProfileBenchResult:
    """Every step's ``{"label", "seconds", "phases": {"time/<phase>": s}}``, and the two tables as text."""

    config: dict
    steps: list[dict] = field(default_factory=list)
    operators: str = ""
    idle: str = ""


def run_profile_bench(cfg: ProfileBenchConfig, out: Path | None = None) -> ProfileBenchResult:
    """Profile one step of row ``cfg.row``; print both tables and write the result as JSON to ``out``.

    Raises:
        ValueError: no CUDA device and a preset other than ``tiny`` (``bench.common.bench_device``).
        KeyError: ``cfg.row`` is not a row of ``bench.variants.ROWS``.
    """
    device = bench_device(cfg.preset)
    workload = ScheduleBenchConfig(
        **{f.name: getattr(cfg, f.name) for f in fields(Workload)}, overrides=cfg.overrides
    )
    work, roles, step = default_row(cfg.row, device, workload)
    timer = PhaseTimer(sync=torch.cuda.synchronize if device.type == "cuda" else None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    result = ProfileBenchResult(config=asdict(cfg))

    def timed_step(label: str) -> None:
        start = timer.now()
        step(roles, work.prompts, timer)
        seconds = timer.now() - start
        phases = {k: round(v, 4) for k, v in timer.pop().items()}
        result.steps.append({"label": label, "seconds": round(seconds, 4), "phases": phases})
        print(f"{label}: {seconds:.3f} s {phases}", flush=True)

    with GcClock() as gc_clock:  # the first step's survivors frozen out of later passes, as in training
        for i in range(cfg.warmup):
            timed_step(f"warm-up {i + 1}")
            gc_clock.step_done()
        # operators first and without Python stacks: a table over a stack-recorded step takes minutes
        with profile(activities=activities) as prof:
            timed_step("profiled: operators")
        sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        result.operators = prof.key_averages().table(
            sort_by=sort, row_limit=OPERATOR_ROWS, max_name_column_width=90
        )
        print(result.operators, flush=True)
        with profile(activities=activities, with_stack=True) as prof:
            timed_step("profiled: idle gaps")
        result.idle = _idle_table(prof.events(), device)
        print(result.idle, flush=True)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(asdict(result), indent=2))
    return result


def _idle_table(events, device: torch.device) -> str:
    """``observe.idle.gap_table`` of a CUDA profile; a line saying why there is none elsewhere."""
    if device.type != "cuda":
        return f"no idle-time table: a profile on {device.type} holds no device activity"
    return gap_table(events)
