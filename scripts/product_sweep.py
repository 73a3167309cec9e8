"""Tuning sweep of the decode products (rollplex.rollout.product_kernel) at the 3B model's shapes, with the
norms, gate, bias and residual the decoder folds into each, against cuBLAS's bare product (``F.linear``).

Each product is timed over 36 distinct weights (one per layer, so no weight stays in L2) captured in one
CUDA graph; the table gives microseconds per product and weight bytes read per microsecond.
Usage (CUDA): python scripts/product_sweep.py [--out sweep.json]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton

from rollplex.rollout.product_kernel import ProductConfig, linear

ROWS, LAYERS = 64, 36
SHAPES = {  # name: (N, K, what the kernel folds in) of the 3B decoder layer, fused q/k/v and gate/up
    "qkv": (2560, 2048, "norm+bias"),
    "o": (2048, 2048, "residual"),
    "gate_up": (22016, 2048, "norm+gated"),
    "down": (2048, 11008, "residual"),
}


def _timed(fn, replays: int = 10) -> float:
    """Microseconds per call of fn(layer) over LAYERS layers, from CUDA-graph replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(LAYERS):
            fn(layer)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * LAYERS)


def sweep_shape(name: str, configs: list[ProductConfig]) -> dict:
    n, k, folded = SHAPES[name]
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(ROWS, k, device=dev, dtype=dt)
    weights = [torch.randn(n, k, device=dev, dtype=dt) * k**-0.5 for _ in range(LAYERS)]
    bias = torch.randn(n, device=dev, dtype=dt) if "bias" in folded else None
    residual = torch.randn(ROWS, n, device=dev, dtype=dt) if folded == "residual" else None
    extra = {
        "norm": torch.randn(k, device=dev, dtype=dt) if "norm" in folded else None,
        "gated": "gated" in folded,
    }

    def cublas(layer: int) -> torch.Tensor:
        return F.linear(x, weights[layer], bias)

    times = {"cublas": _timed(cublas)}
    for cfg in configs:
        try:
            times[f"bn{cfg.bn} bk{cfg.bk} s{cfg.stages} w{cfg.warps}"] = _timed(
                lambda layer, cfg=cfg: linear(x, weights[layer], bias, residual, cfg, **extra)
            )
        except triton.runtime.errors.OutOfResources:  # shared memory of BN·BK·stages
            continue
    return {"N": n, "K": k, "folded": folded, "bytes": n * k * 2, "us": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the table as JSON here")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    configs = [
        ProductConfig(bn, bk, stages, warps)
        for bn, bk, stages, warps in itertools.product((16, 32, 64), (64, 128, 256), (3, 5), (4,))
    ]
    results = {}
    for name in args.shapes.split(","):
        res = sweep_shape(name, configs)
        results[name] = res
        best = min((t, c) for c, t in res["us"].items() if c != "cublas")
        base = res["us"]["cublas"]
        print(
            f"{name:8s} N {res['N']:6d} K {res['K']:6d}: cuBLAS {base:6.2f} us "
            f"({res['bytes'] / base / 1e3:5.0f} GB/s); best {best[1]} {best[0]:6.2f} us "
            f"({res['bytes'] / best[0] / 1e3:5.0f} GB/s), x{base / best[0]:.2f} (with {res['folded']} folded in)"
        )
        for cfg, t in sorted(res["us"].items(), key=lambda item: item[1]):
            print(f"    {cfg:22s} {t:7.2f} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": ROWS, "shapes": results}, f, indent=1)


if __name__ == "__main__":
    main()
