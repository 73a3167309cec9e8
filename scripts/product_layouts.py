"""Time the decode step's cuBLAS products at the 3B benchmark shape (64 rows, bf16) in several operand
layouts, to see whether cuBLAS picks a faster kernel for one of them: x·Wᵀ from W [N, K] (as the step
runs them, ``F.linear``), x·W' from a transposed copy W' = Wᵀ [K, N] (contiguous), and (W·xᵀ)ᵀ (the
weight as the left operand). 36 products on 36 weights per CUDA graph (no call reads what the previous
left in L2); µs per product, median of three timings.

Usage (CUDA): python scripts/product_layouts.py [--out layouts.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from rollplex.bench.common import cuda_script_args, replay_us

ROWS, LAYERS = 64, 36
SHAPES = {"q/k/v": (2560, 2048), "o": (2048, 2048), "gate/up": (22016, 2048), "down": (2048, 11008)}
LAYOUTS = {
    "F.linear(x, W)": lambda x, w, wt: F.linear(x, w),
    "x @ W' (W' = Wᵀ contiguous)": lambda x, w, wt: x @ wt,
    "(W @ xᵀ)ᵀ": lambda x, w, wt: (w @ x.T).T,
}


def _time(product, x, weights, transposed) -> float:
    """µs per product of ``product`` over the 36 weights, as graph replays."""
    product(x, weights[0], transposed[0])  # builds handles and workspaces outside the capture
    torch.cuda.synchronize()
    return statistics.median(
        replay_us(lambda: [product(x, w, wt) for w, wt in zip(weights, transposed)], LAYERS)
    )


def main() -> None:
    def arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--out", help="write the table as JSON here")

    args = cuda_script_args(__doc__, arguments)
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = {}
    for name, (n, k) in SHAPES.items():
        x = (torch.randn(ROWS, k, generator=gen, device="cuda") * 0.05).to(torch.bfloat16)
        weights = [
            (torch.randn(n, k, generator=gen, device="cuda") * 0.05).to(torch.bfloat16) for _ in range(LAYERS)
        ]
        transposed = [w.t().contiguous() for w in weights]
        want = F.linear(x, weights[0])
        for layout, product in LAYOUTS.items():
            us = _time(product, x, weights, transposed)
            got = product(x, weights[0], transposed[0])
            results[f"{name} | {layout}"] = {"us": us, "bitwise_equal_f_linear": torch.equal(got, want)}
            print(f"{name:8} {layout:30} {us:7.2f} µs  bitwise equal to F.linear: {torch.equal(got, want)}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
