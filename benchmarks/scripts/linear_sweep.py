"""Tuning sweep of the decode step's gated gate/up product (rollplex.rollout.linear_kernel) at the 3B
benchmark shape (64 rows, 2048 → 2 × 11008), against cuBLAS (torch's F.linear, then SiLU·up eager or
compiled into one kernel as in the compiled decode step, and the product alone).

For each launch setting, 36 calls, one per layer of the 3B model, each on its own weight (so no call
reads what the previous one left in L2), are captured in a CUDA graph and replayed; the table gives
microseconds per call (the median of three timings of 20 replays), the weight bytes read per
microsecond (TB/s), the relative error against the float64 reference and whether two runs agree bitwise.
(The split-K products this sweep also timed for q/k/v, o and down are in commit 188f3ed.)
Usage (CUDA): python benchmarks/scripts/linear_sweep.py [--out sweep.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from rollplex.bench.common import cuda_script_args, replay_us
from rollplex.rollout.linear_kernel import GateLaunch, gated_up_product

ROWS, LAYERS, HIDDEN, INTER = 64, 36, 2048, 11008
L = GateLaunch
SETTINGS = [L(64, 64), L(32, 64), L(128, 64), L(64, 128), L(32, 128), L(64, 64, num_stages=3),
            L(64, 64, num_stages=5), L(64, 64, 8), L(128, 64, 8), L(32, 64, 2), L(64, 32, num_stages=6),
            L(16, 64), L(16, 128), L(16, 64, 2), L(16, 64, num_stages=6), L(32, 64, num_stages=3),
            L(32, 64, num_stages=5), L(32, 128, num_stages=3)]  # fmt: skip


def _float64_gate(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate)·up from float64 products, rounded at the eager MLP's steps (the error column's yardstick)."""
    gate, up = (x.double() @ gate_up.double().T).to(x.dtype).double().chunk(2, dim=-1)
    return (F.silu(gate).to(x.dtype).double() * up).to(x.dtype)


def _silu_up(products: torch.Tensor) -> torch.Tensor:
    gate, up = products.chunk(2, dim=-1)
    return F.silu(gate) * up


BASELINES = {
    "cuBLAS + eager SiLU·up": lambda x, w: _silu_up(F.linear(x, w)),
    "cuBLAS + compiled SiLU·up": lambda x, w: _COMPILED(F.linear(x, w)),
    "cuBLAS product alone": lambda x, w: F.linear(x, w),
}
_COMPILED = torch.compile(_silu_up)


def _layers() -> list[tuple]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *s: (torch.randn(*s, generator=gen, device="cuda") * 0.05).to(torch.bfloat16)  # noqa: E731
    return [(rand(ROWS, HIDDEN), rand(2 * INTER, HIDDEN)) for _ in range(LAYERS)]


def time_call(call, layers, replays: int = 20) -> dict:
    """Microseconds per call (CUDA-graph replays of LAYERS calls), TB/s of weight, error, determinism."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        first, again = call(*layers[0]), call(*layers[0])
    torch.cuda.synchronize()
    want = (
        _float64_gate(*layers[0])
        if first.shape[1] == INTER
        else layers[0][0].double() @ layers[0][1].double().T
    )
    error = ((first.double() - want.double()).norm() / want.double().norm()).item()
    times = replay_us(lambda: [call(*args) for args in layers], LAYERS, replays)
    us = sorted(times)[1]
    return {"us": us, "us_runs": times, "tb_per_s": layers[0][1].numel() * 2 / us / 1e6,
            "rel_error": error, "bitwise_repeat": bool(torch.equal(first, again))}  # fmt: skip


def main() -> None:
    def arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--out", help="write the table as JSON here")

    args = cuda_script_args(__doc__, arguments)
    layers = _layers()
    calls = dict(BASELINES)
    for launch in SETTINGS:
        calls[" ".join(str(v) for v in vars(launch).values())] = lambda x, w, launch=launch: gated_up_product(
            x, w, launch
        )
    rows = []
    for label, call in calls.items():
        row = {"call": label, **time_call(call, layers)}
        rows.append(row)
        print(f"{label:26s} {row['us']:7.2f} us {row['tb_per_s']:5.2f} TB/s err {row['rel_error']:.1e} "
              f"repeat {row['bitwise_repeat']}", flush=True)  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
