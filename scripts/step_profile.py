"""Profile one serial GRPO step of the ``rollplex bench schedule`` workload (3B architecture, 8 groups of
3,920-token video prompts, N = 8, 512-token responses): the phase times of two warm-up steps and of the
profiled ones; a torch.profiler table of one step's operators and kernels by device time (written
first); and, from a second step profiled with Python stacks, where the device sat idle: every gap of
at least 100 µs between device activities, each charged to the innermost ``rollplex/...`` profiler
range (phase, prefix, suffix, vision) and the operators (and Python frames) that launched the work
ending it, summed by launcher (``rollplex.observe.idle.gap_table``).

Usage (CUDA): python scripts/step_profile.py OUT_PREFIX     # writes OUT_PREFIX.ops.txt, OUT_PREFIX.gaps.txt
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from rollplex.bench.common import cuda_script_out_prefix
from rollplex.bench.schedule import default_row
from rollplex.observe.idle import gap_table
from rollplex.observe.metrics import GcClock, PhaseTimer


def _step(step, roles, work, timer, label: str) -> None:
    start = timer.now()
    step(roles, work.prompts, timer)
    phases = {k: round(v, 3) for k, v in timer.pop().items() if isinstance(v, float)}
    print(label, round(timer.now() - start, 3), "s", phases, flush=True)


def main(out: str) -> None:
    with GcClock() as gc_clock:  # the first step's survivors frozen out of later passes, as in training
        _profile(out, gc_clock)


def _profile(out: str, gc_clock: GcClock) -> None:
    work, roles, step = default_row("serial", torch.device("cuda"))
    timer = PhaseTimer(sync=torch.cuda.synchronize)
    for i in range(2):  # compilation, graph capture, allocator growth
        _step(step, roles, work, timer, f"warm-up {i}")
        gc_clock.step_done()
    # Operators first and without Python stacks: a table over a stack-recorded step took minutes.
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _step(step, roles, work, timer, "profiled (operators)")
        torch.cuda.synchronize()
    ops = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=60, max_name_column_width=90)
    with open(out + ".ops.txt", "w") as f:
        f.write(ops)
    print(ops, flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        _step(step, roles, work, timer, "profiled (idle gaps)")
        torch.cuda.synchronize()
    gaps = gap_table(prof.events())
    with open(out + ".gaps.txt", "w") as f:
        f.write(gaps + "\n")
    print(gaps, flush=True)


if __name__ == "__main__":
    main(cuda_script_out_prefix(__doc__, "OUT_PREFIX.ops.txt and OUT_PREFIX.gaps.txt"))
