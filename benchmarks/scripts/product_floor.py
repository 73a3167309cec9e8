"""The decode step's products at the 3B shape, each captured 36 times in one CUDA graph (µs per product).

``blas``: cuBLAS against cuBLASLt at 64 rows (36 layers' weights; whether cuBLASLt's result is bitwise
cuBLAS's), and the graph's floor: an empty kernel and a tiny elementwise one.
``splitk``: each product at 64 rows as S batched cuBLAS products over S slices of K with float32
outputs (``torch.bmm(..., out_dtype=torch.float32)`` on strided views, no weight copy), alone and
followed by the sum over S as its own kernel (a following elementwise kernel could fold it in); against
``F.linear``.
``rows``: cuBLAS at 8..128 rows, "cold" (36 layers' weights, read from memory) and "hot" (one weight 36
times, L2-resident): how much of a product's time is its bytes.

Usage (CUDA): python benchmarks/scripts/product_floor.py [--what blas,rows] [--out floor.json]   (--what: any of blas,
rows, splitk)
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from rollplex.bench.common import comma_list_of, cuda_script_args, replay_us

LAYERS = 36
SHAPES = {"qkv": (2560, 2048), "o": (2048, 2048), "gate_up": (22016, 2048), "down": (2048, 11008)}


def timed(calls, reps: int = 20) -> float:
    """µs per product of ``calls`` (LAYERS products) captured in one CUDA graph; median of five timings
    of ``reps`` replays (``bench.common.replay_us``)."""
    calls()  # cuBLAS handles and workspaces before capture
    torch.cuda.synchronize()
    return statistics.median(replay_us(calls, LAYERS, reps, repeats=5))


def _weights(n: int, k: int) -> list[torch.Tensor]:
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]


def blas() -> dict:
    tiny = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
    res = {
        "empty_kernel": timed(lambda: [torch.cuda._sleep(0) for _ in range(LAYERS)]),
        "tiny_add_64x2048": timed(lambda: [tiny.add_(1) for _ in range(LAYERS)]),
    }
    for name, (n, k) in SHAPES.items():
        ws = _weights(n, k)
        bs = [torch.randn(n, device="cuda", dtype=torch.bfloat16) if name == "qkv" else None for _ in ws]
        x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, ws[0], bs[0])
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            us = timed(lambda x=x, ws=ws, bs=bs: [F.linear(x, w, b) for w, b in zip(ws, bs, strict=True)])
            res[f"{name}/{lib}"] = {"us": us, "bitwise_cublas": torch.equal(F.linear(x, ws[0], bs[0]), ref)}
        torch.backends.cuda.preferred_blas_library("cublas")
    return res


def _products_but_gate_up() -> Iterator[tuple[str, int, list[torch.Tensor]]]:
    """(name, K, 36 layers' weights) of every product but gate/up."""
    for name, (n, k) in SHAPES.items():
        if name != "gate_up":
            yield name, k, _weights(n, k)


def rows() -> dict:
    res = {}
    for name, k, ws in _products_but_gate_up():
        for m in (8, 16, 32, 64, 128):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cold = timed(lambda x=x, ws=ws: [F.linear(x, w) for w in ws])
            hot = timed(lambda x=x, ws=ws: [F.linear(x, ws[0]) for _ in ws])
            res[f"{name}/M{m}"] = {"cold_us": cold, "hot_us": hot}
    return res


def _split_views(x: torch.Tensor, w: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] and w [N, K] as [S, M, K/S] and [S, K/S, N] views (no copy)."""
    m, k = x.shape
    return x.view(m, s, k // s).transpose(0, 1), w.view(w.shape[0], s, k // s).permute(1, 2, 0)


def splitk() -> dict:
    res = {}
    for name, k, ws in _products_but_gate_up():
        x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
        res[f"{name}/linear"] = timed(lambda x=x, ws=ws: [F.linear(x, w) for w in ws])
        ref = F.linear(x.double(), ws[0].double())
        for s in (1, 2, 4, 8) if name == "down" else (1, 2, 4):
            pairs = [_split_views(x, w, s) for w in ws]
            bmm = lambda pairs=pairs: [torch.bmm(a, b, out_dtype=torch.float32) for a, b in pairs]  # noqa: E731
            summed = lambda pairs=pairs: [  # noqa: E731
                torch.bmm(a, b, out_dtype=torch.float32).sum(0) for a, b in pairs
            ]
            err = (torch.bmm(*pairs[0], out_dtype=torch.float32).sum(0).double() - ref).abs().max().item()
            res[f"{name}/S{s}"] = {"bmm_us": timed(bmm), "with_sum_us": timed(summed), "max_err": err}
        res[f"{name}/linear_err"] = (F.linear(x, ws[0]).double() - ref).abs().max().item()
    return res


WHATS = {"blas": blas, "rows": rows, "splitk": splitk}  # --what: name -> measurement


def main() -> None:
    def arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--what",
            default="blas,rows",
            type=comma_list_of(tuple(WHATS)),
            help=f"comma-separated, any of {', '.join(WHATS)}",
        )
        parser.add_argument("--out", help="write the results as JSON here")

    args = cuda_script_args(__doc__, arguments)
    torch.manual_seed(0)
    res = {"gpu": torch.cuda.get_device_name()}
    for what in args.what:
        res[what] = WHATS[what]()
        for key, value in res[what].items():
            print(f"{what} {key}: {value}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
