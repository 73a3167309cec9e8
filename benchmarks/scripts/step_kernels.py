r"""Run each kernel of one decode step once at the 3B benchmark shape, between cudaProfilerStart and
cudaProfilerStop, for Nsight Compute's hardware counters (64 rows, bf16, own keys 0..240, random data):
the q/k/v product with its bias, the fused attention's partials and merge, the o product, the gated
gate/up product, the down product (cuBLAS split-K and its reduction) and the sampling race.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
        python benchmarks/scripts/step_kernels.py

Without ncu it only runs them (a smoke test). Every kernel runs once before the profiled pass, so the
profiled pass compiles nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from attention_sweep import attention_inputs  # 3B-shaped inputs (this script's folder is sys.path[0])

from rollplex.bench.common import cuda_script_args
from rollplex.rollout.decode_kernel import fused_decode_attention
from rollplex.rollout.linear_kernel import gated_up_product
from rollplex.rollout.sample_kernel import fused_race

ROWS, HIDDEN, INTER, KV, VOCAB, STEP = 64, 2048, 11008, 256, 151_936, 240


def _step_kernels() -> list:
    """(name, call) of each kernel's call, on fresh random inputs."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *s: (torch.randn(*s, generator=gen, device="cuda") * 0.05).to(torch.bfloat16)  # noqa: E731
    x, qkv_w, qkv_b = rand(ROWS, HIDDEN), rand(HIDDEN + 2 * KV, HIDDEN), rand(HIDDEN + 2 * KV)
    o_w, gate_up, down = rand(HIDDEN, HIDDEN), rand(2 * INTER, HIDDEN), rand(HIDDEN, INTER)
    act = rand(ROWS, INTER)
    attention = attention_inputs(STEP)
    logits = rand(ROWS, VOCAB) * 40
    noise = torch.empty(ROWS, VOCAB, device="cuda").exponential_(generator=gen)
    banned = torch.arange(151652, 151657, device="cuda")
    return [
        ("q/k/v", lambda: F.linear(x, qkv_w, qkv_b)),
        ("attention", lambda: fused_decode_attention(*attention)),
        ("o", lambda: F.linear(x, o_w)),
        ("gate/up", lambda: gated_up_product(x, gate_up)),
        ("down", lambda: F.linear(act, down)),
        ("race", lambda: fused_race(logits, noise, temperature=1.0, banned_ids=banned)),
    ]


def main() -> None:
    kernels = _step_kernels()
    for _, call in kernels:  # build and warm up outside the profiled range
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, call in kernels:
        torch.cuda.nvtx.range_push(name)
        call()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("ran", ", ".join(name for name, _ in kernels))


if __name__ == "__main__":
    cuda_script_args(__doc__)
    main()
