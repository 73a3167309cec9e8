"""Tuning sweep of the decode-step products (rollplex.rollout.linear_kernel) at the 3B benchmark shapes
(64 rows; q/k/v 2048 → 2560 with bias, o 2048 → 2048, gate/up 2048 → 2 × 11008 with the SiLU gate,
down 11008 → 2048), against cuBLAS (torch's F.linear; for gate/up, F.linear then SiLU·up).

For each product and launch setting, 36 calls, one per layer of the 3B model, each on its own weight
(so no call reads what the previous one left in L2), are captured in a CUDA graph and replayed; the
table gives microseconds per call, the weight bytes read per microsecond (TB/s), the relative error
against a float64 product and whether two runs agree bitwise.
Usage (CUDA): python scripts/linear_sweep.py [--products qkv,o,gate_up,down] [--out sweep.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from rollplex.rollout.linear_kernel import (
    LinearLaunch,
    LinearWorkspace,
    accumulation_dtype,
    decode_linear,
    workspace_size,
)

ROWS, LAYERS, HIDDEN, INTER, QKV = 64, 36, 2048, 11008, 2560
PRODUCTS = {  # name: (output features, input features, bias, gated)
    "qkv": (QKV, HIDDEN, True, False),
    "o": (HIDDEN, HIDDEN, False, False),
    "gate_up": (INTER, HIDDEN, False, True),
    "down": (HIDDEN, INTER, False, False),
}
L = LinearLaunch
SETTINGS = {
    "qkv": [L(64, 128, 1), L(64, 128, 2), L(64, 128, 4), L(128, 128, 4), L(128, 128, 8), L(128, 64, 8),
            L(64, 128, 4, num_stages=3), L(64, 64, 4), L(32, 128, 4), L(128, 128, 16)],
    "o": [L(64, 128, 2), L(64, 128, 4), L(64, 128, 8), L(128, 128, 8), L(128, 64, 8), L(32, 128, 4),
          L(128, 128, 16), L(64, 64, 4)],
    "gate_up": [L(32, 128, 1), L(64, 128, 1), L(64, 64, 1), L(64, 128, 2), L(128, 64, 1), L(128, 64, 2),
                L(32, 128, 1, num_stages=3), L(64, 128, 1, num_stages=3), L(32, 64, 1, num_stages=5),
                L(64, 64, 2, num_stages=5), L(32, 64, 1), L(64, 64, 1, num_stages=3), L(64, 64, 1, num_stages=5),
                L(64, 32, 1, num_stages=6), L(128, 32, 1), L(64, 64, 1, 8), L(128, 64, 1, 8), L(32, 64, 1, 2),
                L(64, 64, 1, 4, 2), L(16, 128, 1)],
    "down": [L(64, 128, 4), L(64, 128, 8), L(64, 128, 16), L(128, 128, 8), L(128, 128, 16), L(128, 64, 16),
             L(64, 256, 8, num_stages=3), L(128, 64, 32), L(64, 64, 16, num_stages=5), L(64, 64, 4),
             L(64, 64, 4, num_stages=3), L(32, 64, 2), L(32, 128, 2), L(64, 64, 2), L(32, 64, 4), L(64, 64, 8, num_stages=3)],
}  # fmt: skip


def _layers(name: str) -> list[tuple]:
    n, k, bias, gated = PRODUCTS[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *s: (torch.randn(*s, generator=gen, device="cuda") * 0.05).to(torch.bfloat16)  # noqa: E731
    return [(rand(ROWS, k), rand(2 * n if gated else n, k), rand(n) if bias else None) for _ in range(LAYERS)]


def _cublas(x, w, b, gated: bool):
    if gated:
        gate, up = F.linear(x, w).chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.linear(x, w, b)


def _reference(x, w, b, gated: bool) -> torch.Tensor:
    x64, w64 = x.double(), w.double()
    if gated:
        gate, up = (x64 @ w64.T).to(x.dtype).chunk(2, dim=-1)
        return F.silu(gate.double()).to(x.dtype).double() * up.double()
    return x64 @ w64.T + (b.double() if b is not None else 0)


def time_product(name: str, launch: LinearLaunch | str | None, replays: int = 20) -> dict:
    """Microseconds per call (CUDA-graph replays of LAYERS calls), TB/s of weight, error, determinism."""
    n, k, _, gated = PRODUCTS[name]
    layers = _layers(name)
    workspace = LinearWorkspace("cuda", accumulation_dtype(torch.bfloat16))
    if launch == "gemm":  # cuBLAS's product alone (gate/up without the SiLU gate)
        call = lambda x, w, b: F.linear(x, w, b)  # noqa: E731
    elif launch is not None:
        workspace.reserve(*workspace_size(ROWS, n, k, launch, gated))
        call = lambda x, w, b: decode_linear(x, w, b, gated=gated, launch=launch, workspace=workspace)  # noqa: E731
    else:
        call = lambda x, w, b: _cublas(x, w, b, gated)  # noqa: E731
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        first = call(*layers[0])
        again = call(*layers[0])
    torch.cuda.synchronize()
    ref = _reference(*layers[0], gated and launch != "gemm")
    error = ((first.double() - ref).norm() / ref.norm()).item()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in layers:
            call(*args)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(3):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (replays * LAYERS))
    us = sorted(times)[1]
    weight_bytes = layers[0][1].numel() * 2
    return {
        "product": name,
        "launch": launch if launch in (None, "gemm") else vars(launch),
        "us": us,
        "us_runs": times,
        "tb_per_s": weight_bytes / us / 1e6,
        "rel_error": error,
        "bitwise_repeat": bool(torch.equal(first, again)),
        "counters_zero": bool((workspace.counters == 0).all()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--products", default=",".join(PRODUCTS))
    parser.add_argument("--out", help="write the table as JSON here")
    args = parser.parse_args()
    rows = []
    for name in args.products.split(","):
        extra = ["gemm"] if PRODUCTS[name][3] else []
        for launch in [None, *extra, *SETTINGS[name]]:
            try:
                row = time_product(name, launch)
            except Exception as err:  # noqa: BLE001 - a setting that does not compile is reported, not fatal
                row = {"product": name, "launch": str(launch), "error": f"{type(err).__name__}: {err}"[:300]}
            rows.append(row)
            label = (
                {None: "cuBLAS", "gemm": "cuBLAS product"}.get(launch)
                if not isinstance(launch, LinearLaunch)
                else " ".join(f"{v}" for v in vars(launch).values())
            )
            if "error" in row:
                print(f"{name:8s} {label:18s} {row['error']}", flush=True)
            else:
                print(
                    f"{name:8s} {label:18s} {row['us']:7.2f} us {row['tb_per_s']:5.2f} TB/s "
                    f"err {row['rel_error']:.1e} repeat {row['bitwise_repeat']} counters {row['counters_zero']}",
                    flush=True,
                )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    print("\nbest per product:")
    for name in args.products.split(","):
        ok = [r for r in rows if r["product"] == name and "us" in r]
        base = next(r for r in ok if r["launch"] is None)
        best = min((r for r in ok if isinstance(r["launch"], dict)), key=lambda r: r["us"], default=None)
        if best:
            print(f"{name:8s} cuBLAS {base['us']:.2f} us, best {best['us']:.2f} us {best['launch']}")


if __name__ == "__main__":
    main()
