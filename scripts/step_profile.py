"""Profile one serial GRPO step of the ``rollplex bench schedule`` workload (3B architecture, 8 groups of
3,920-token video prompts, N = 8, 512-token responses): the phase times of two warm-up steps and of the
profiled one, and torch.profiler tables of the profiled step's operators and kernels by device time
(one table as they are, one grouped by input shape).

Usage (CUDA): python scripts/step_profile.py OUT_PREFIX     # writes OUT_PREFIX.ops.txt, OUT_PREFIX.shapes.txt
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from rollplex.bench.schedule import ROWS, ScheduleBenchConfig, _Workload
from rollplex.observe.metrics import PhaseTimer
from rollplex.schedule import make_step


def _step(step, roles, work, timer, label: str) -> None:
    start = timer.now()
    step(roles, work.prompts, timer)
    phases = {k: round(v, 3) for k, v in timer.pop().items() if isinstance(v, float)}
    print(label, round(timer.now() - start, 3), "s", phases, flush=True)


def main(out: str) -> None:
    cfg = ScheduleBenchConfig()
    device = torch.device("cuda")
    work = _Workload(cfg, device)
    roles = work.roles(ROWS["serial"], cfg)
    step = make_step(roles.config, device)
    timer = PhaseTimer(sync=torch.cuda.synchronize)
    for i in range(2):  # compilation, graph capture, allocator growth
        _step(step, roles, work, timer, f"warm-up {i}")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        _step(step, roles, work, timer, "profiled")
        torch.cuda.synchronize()
    ops = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=45, max_name_column_width=70)
    shapes = prof.key_averages(group_by_input_shape=True).table(
        sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=60, max_shapes_column_width=90
    )
    with open(out + ".ops.txt", "w") as f:
        f.write(ops)
    with open(out + ".shapes.txt", "w") as f:
        f.write(shapes)
    print(ops)


if __name__ == "__main__":
    main(sys.argv[1])
