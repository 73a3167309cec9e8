"""Experiment: the decode step's down and o products as split-K Triton products whose float32 partials
are summed by the compiled kernel that follows (residual add + RMSNorm), against cuBLAS's product
followed by the same compiled kernel, at the 3B shapes (64 rows; down 11008 → 2048, o 2048 → 2048).

For each setting, 36 layers (each with its own weight) of [product, residual add + RMSNorm] are captured
in one CUDA graph and replayed; the table gives microseconds per layer (median of three timings of 20
replays) and the relative error of the normed output against a float64 computation.
Usage (CUDA): python scripts/splitk_sweep.py [--out sweep.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rollplex.rollout.decode import residual_add, rms_norm

ROWS, LAYERS, HIDDEN, INTER, EPS = 64, 36, 2048, 11008, 1e-6


@triton.jit
def _partials(x, w, out, M, N, K, k_slice, sxm, swn, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Program (n tile, slice): the float32 partial x[:, slice] · w[n tile, slice]ᵀ into out[slice]."""
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    rm, rn, rk = tl.arange(0, BM), pid_n * BN + tl.arange(0, BN), tl.arange(0, BK)
    lo = pid_s * k_slice
    hi = tl.minimum(lo + k_slice, K)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(lo, hi, BK):
        k = k0 + rk
        xk = tl.load(
            x + rm[:, None] * sxm + k[None, :], mask=(rm < M)[:, None] & (k < hi)[None, :], other=0.0
        )
        wk = tl.load(
            w + rn[:, None] * swn + k[None, :], mask=(rn < N)[:, None] & (k < hi)[None, :], other=0.0
        )
        acc = tl.dot(xk, tl.trans(wk), acc)
    at = pid_s.to(tl.int64) * M * N + rm[:, None] * N + rn[None, :]
    tl.store(out + at, acc, mask=(rm < M)[:, None] & (rn < N)[None, :])


def split_k(x, w, bn, bk, splits, stages, warps=4):
    m, k = x.shape
    n = w.shape[0]
    blocks = math.ceil(k / bk)
    k_slice = math.ceil(blocks / splits) * bk
    splits = math.ceil(k / k_slice)
    out = torch.empty(splits, m, n, device=x.device, dtype=torch.float32)
    _partials[(math.ceil(n / bn), splits)](
        x,
        w,
        out,
        m,
        n,
        k,
        k_slice,
        x.stride(0),
        w.stride(0),
        BM=64,
        BN=bn,
        BK=bk,
        num_warps=warps,
        num_stages=stages,
    )
    return out


@torch.compile
def norm_after_product(hidden, product, weight):
    hidden = residual_add(hidden, product)
    return hidden, rms_norm(hidden, weight, EPS)


@torch.compile
def norm_after_partials(hidden, partials, weight):
    hidden = residual_add(hidden, partials.sum(0).to(hidden.dtype))
    return hidden, rms_norm(hidden, weight, EPS)


def _layers(k: int, n: int) -> list[tuple]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *s: (torch.randn(*s, generator=gen, device="cuda") * 0.05).to(torch.bfloat16)  # noqa: E731
    return [(rand(ROWS, n) * 20, rand(ROWS, k), rand(n, k), 1 + rand(n)) for _ in range(LAYERS)]


def _time(call, layers, replays=20):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = call(*layers[0])
        call(*layers[0])
    torch.cuda.synchronize()
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
    return sorted(times)[1], out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = []
    for name, (k, n) in {"down": (INTER, HIDDEN), "o": (HIDDEN, HIDDEN)}.items():
        layers = _layers(k, n)
        h, x, w, ln = layers[0]
        h64 = h.double() + (x.double() @ w.double().T).to(torch.bfloat16).double()
        want = (h64.to(torch.bfloat16).double() * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + EPS)).to(
            torch.bfloat16
        ).double() * ln.double()
        calls = {"cuBLAS + compiled norm": lambda h, x, w, ln: norm_after_product(h, F.linear(x, w), ln)}
        for bn, bk, splits, stages in itertools.product((64, 128), (64, 128), (2, 4, 8), (3, 4)):
            if bn * bk * stages > 128 * 128 * 4:
                continue
            calls[f"split-K {bn} {bk} {splits} {stages}"] = lambda h, x, w, ln, c=(bn, bk, splits, stages): (
                norm_after_partials(h, split_k(x, w, *c), ln)
            )
        for label, call in calls.items():
            try:
                us, out = _time(call, layers)
                err = float((out[1].double() - want).norm() / want.norm())
                row = {"product": name, "call": label, "us_per_layer": us, "rel_error": err}
                print(f"{name:5s} {label:26s} {us:7.2f} us  err {err:.1e}", flush=True)
            except Exception as exc:  # noqa: BLE001 - report and go on
                row = {"product": name, "call": label, "error": f"{type(exc).__name__}: {exc}"[:200]}
                print(f"{name:5s} {label:26s} {row['error']}", flush=True)
            rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
