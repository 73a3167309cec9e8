"""Profile one serial GRPO step of the ``rollplex bench schedule`` workload (3B architecture, 8 groups of
3,920-token video prompts, N = 8, 512-token responses): the phase times of two warm-up steps and of the
profiled one; a torch.profiler table of the profiled step's operators and kernels by device time; and
where the device sat idle: every gap of at least 100 µs between device activities, each charged to the
innermost ``rollplex/...`` profiler range (phase, prefix, suffix, vision) and the operators (and Python
frames, where the profiler's events carry them) that launched the work ending it, summed by launcher.

Usage (CUDA): python scripts/step_profile.py OUT_PREFIX     # writes OUT_PREFIX.gaps.txt, OUT_PREFIX.ops.txt
"""

from __future__ import annotations

import bisect
import sys
from collections import defaultdict

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from rollplex.bench.schedule import ROWS, ScheduleBenchConfig, _Workload
from rollplex.observe.metrics import PhaseTimer
from rollplex.schedule import make_step

MIN_GAP_US = 100.0
OUR_FRAMES = ("rollplex/", "transformers/", "torch/utils/checkpoint", "torch/autograd", "torch/optim")


def _step(step, roles, work, timer, label: str) -> None:
    start = timer.now()
    step(roles, work.prompts, timer)
    phases = {k: round(v, 3) for k, v in timer.pop().items() if isinstance(v, float)}
    print(label, round(timer.now() - start, 3), "s", phases, flush=True)


def busy_and_gaps(
    intervals: list[tuple[float, float]], min_gap: float
) -> tuple[float, list[tuple[float, float]]]:
    """Union length of ``intervals`` (start, end) and the gaps (start, end) of at least ``min_gap``
    between them, in time order."""
    ordered = sorted(intervals)
    busy, gaps = 0.0, []
    lo, hi = ordered[0]
    for start, end in ordered[1:]:
        if start > hi:
            busy += hi - lo
            if start - hi >= min_gap:
                gaps.append((hi, start))
            lo, hi = start, end
        else:
            hi = max(hi, end)
    return busy + hi - lo, gaps


def _launcher(cpu) -> str:
    """The innermost ``rollplex/...`` profiler range around the runtime call ``cpu`` (phases, prefix,
    suffix, vision), the CPU ops above the call (innermost first, up to three), and the innermost
    rollplex/transformers/torch frames of the first of them with a Python stack (autograd's backward
    thread has none)."""
    names, frames, rng = [], [], ""
    while cpu is not None:
        if not rng and cpu.name.startswith("rollplex/"):
            rng = cpu.name
        elif len(names) < 3 and not cpu.name.startswith(("cuda", "rollplex/")):
            names.append(cpu.name)
        if not frames:
            frames = [f for f in cpu.stack if any(tag in f for tag in OUR_FRAMES)][:3]
        cpu = cpu.cpu_parent
    head = f"[{rng or 'no rollplex range'}] " + " < ".join(names or ["(no CPU op)"])
    return head + (" @ " + " <- ".join(frames) if frames else "")


def gap_table(events) -> str:
    """Device busy time, idle time, and the idle gaps summed by the launcher of the work that ended them."""
    device = [e for e in events if e.device_type == DeviceType.CUDA]
    # after an idle gap the queue is empty, so the work ending it was launched by the last runtime call
    # (cudaLaunchKernel, cudaMemcpyAsync, ...) to start before it
    calls = sorted(
        (e for e in events if e.device_type == DeviceType.CPU and e.name.startswith("cuda")),
        key=lambda e: e.time_range.start,
    )
    starts = [e.time_range.start for e in calls]
    intervals = [(e.time_range.start, e.time_range.end) for e in device]
    busy, gaps = busy_and_gaps(intervals, MIN_GAP_US)
    span = max(e for _, e in intervals) - min(s for s, _ in intervals)
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for start, end in gaps:
        at = bisect.bisect_right(starts, end) - 1
        key = _launcher(calls[at]) if at >= 0 else "(no runtime call)"
        sums[key][0] += end - start
        sums[key][1] += 1
    lines = [
        f"device span {span / 1e6:.3f} s, busy {busy / 1e6:.3f} s, idle {(span - busy) / 1e6:.3f} s; "
        f"{len(gaps)} gaps >= {MIN_GAP_US:.0f} us: {sum(e - s for s, e in gaps) / 1e6:.3f} s",
        "idle s  gaps  launcher of the work after the gap",
    ]
    for key, (total, count) in sorted(sums.items(), key=lambda kv: -kv[1][0])[:40]:
        lines.append(f"{total / 1e6:6.3f} {count:5d}  {key}")
    return "\n".join(lines)


def main(out: str) -> None:
    cfg = ScheduleBenchConfig()
    device = torch.device("cuda")
    work = _Workload(cfg, device)
    roles = work.roles(ROWS["serial"], cfg)
    step = make_step(roles.config, device)
    timer = PhaseTimer(sync=torch.cuda.synchronize)
    for i in range(2):  # compilation, graph capture, allocator growth
        _step(step, roles, work, timer, f"warm-up {i}")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        _step(step, roles, work, timer, "profiled")
        torch.cuda.synchronize()
    events = prof.events()
    gaps = gap_table(events)
    with open(out + ".gaps.txt", "w") as f:
        f.write(gaps + "\n")
    print(gaps, flush=True)
    ops = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=45, max_name_column_width=70)
    with open(out + ".ops.txt", "w") as f:
        f.write(ops)
    print(ops)


if __name__ == "__main__":
    main(sys.argv[1])
