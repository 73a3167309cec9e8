"""The post-attention block kernel (rollplex.rollout.block_kernel) against the decode step's separate
kernels for the same work, at the 3B benchmark shape (64 rows, hidden 2048, intermediate 11008, bf16).

For each way, 36 calls, one per layer of the 3B model, each on its own weights (so no call reads what
the previous one left in L2), are captured in a CUDA graph and replayed; the table gives microseconds
per layer (the median of three timings of 20 replays), the weight bytes read per microsecond (TB/s),
the relative error against the float64 layer and whether two runs agree bitwise. The separate kernels
are ``rollout.decode.layer_post`` compiled as the decode step compiles it (cuBLAS o product, the norm
kernel, the gated gate/up kernel, cuBLAS's split-K down product).
Usage (CUDA): python scripts/block_probe.py [--out probe.json] [--settings all]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from rollplex.bench.common import replay_us
from rollplex.rollout import block_kernel
from rollplex.rollout.block_kernel import BlockLaunch, counters_for, post_attention
from rollplex.rollout.decode import DecodeShape, layer_post

ROWS, LAYERS, HIDDEN, INTER, EPS = 64, 36, 2048, 11008, 1e-6
B = BlockLaunch
SETTINGS = [B(), B(backoff=True), B(backoff=True, prefetch=True), B(block_o=16, block_g=64, backoff=True),
            B(block_o=16, block_g=64, backoff=True, prefetch=True), B(block_o=16), B(block_o=64), B(down_splits=4), B(down_splits=16), B(block_d=32),
            B(block_g=64), B(num_stages=3), B(num_stages=2), B(block_k=128, num_stages=3),
            B(num_warps=8)]  # fmt: skip
SHAPE = DecodeShape(1, ROWS, 16, 2, 128, 512, 128**-0.5, EPS, gated_kernel=True)


def _layers() -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *s, scale=0.05: (torch.randn(*s, generator=gen, device="cuda") * scale).to(torch.bfloat16)  # noqa: E731
    return [
        {
            "hidden": rand(ROWS, HIDDEN, scale=1.0),
            "attention": rand(ROWS, HIDDEN, scale=1.0),
            "w_o": rand(HIDDEN, HIDDEN, scale=HIDDEN**-0.5),
            "w_post": (1.0 + rand(HIDDEN, scale=0.1).float()).to(torch.bfloat16),
            "gate_up": rand(2 * INTER, HIDDEN, scale=HIDDEN**-0.5),
            "w_down": rand(HIDDEN, INTER, scale=INTER**-0.5),
        }
        for _ in range(LAYERS)
    ]


def float64_layer(t: dict) -> torch.Tensor:
    """The layer after attention in float64 products, rounded where transformers' eager layer rounds."""
    dtype = t["hidden"].dtype
    h1 = (t["hidden"].float() + (t["attention"].double() @ t["w_o"].double().T).to(dtype).float()).to(dtype)
    h = h1.float()
    x = t["w_post"] * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype)
    gate, up = (x.double() @ t["gate_up"].double().T).to(dtype).double().chunk(2, dim=-1)
    act = (F.silu(gate).to(dtype).double() * up).to(dtype)
    return (h1.float() + (act.double() @ t["w_down"].double().T).to(dtype).float()).to(dtype)


_POST = torch.compile(layer_post)


def _separate(t: dict, _counters=None) -> torch.Tensor:
    weights = (None, None, None, t["w_o"], t["w_post"], (t["gate_up"],), t["w_down"])
    return _POST(t["hidden"], t["attention"], weights, SHAPE)


def time_call(call, layers, counters, replays: int = 20) -> dict:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        first, again = call(layers[0], counters), call(layers[0], counters)
        times = replay_us(lambda: [call(t, counters) for t in layers], LAYERS, replays)
    torch.cuda.synchronize()
    want = float64_layer(layers[0])
    error = ((first.double() - want.double()).norm() / want.double().norm()).item()
    us = sorted(times)[1]
    weight_bytes = sum(layers[0][k].numel() * 2 for k in ("w_o", "gate_up", "w_down"))
    return {"us": us, "us_runs": times, "tb_per_s": weight_bytes / us / 1e6, "rel_error": error,
            "bitwise_repeat": bool(torch.equal(first, again))}  # fmt: skip


def _compiled(fn) -> list:
    """The kernels Triton compiled for ``fn`` (its per-device cache; empty where that is not exposed)."""
    caches = getattr(fn, "device_caches", None) or {}
    kernels = []
    for entry in caches.values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        kernels.extend(cache.values())
    return kernels


def phases(layers: list[dict], launch: BlockLaunch) -> dict:
    """Where one launch's time goes: each program stamps the global timer as its item starts and ends;
    per kind of item, the first start and last end (µs from the launch's first start), and the median
    item duration. The launch runs after 35 others, each on its own layer's weights."""
    import math

    n_o, n_g = math.ceil(HIDDEN / launch.block_o), math.ceil(INTER / launch.block_g)
    counters = counters_for(HIDDEN, launch, "cuda")
    programs = n_o + n_g + 10_000
    times = torch.zeros(programs, 2, dtype=torch.int64, device="cuda")
    for t in layers[:-1]:
        post_attention(**t, eps=EPS, counters=counters, launch=launch)
    post_attention(**layers[-1], eps=EPS, counters=counters, launch=launch, times=times)
    torch.cuda.synchronize()
    used = times[times[:, 0] > 0].double()
    zero = used[:, 0].min()
    kinds = {"o": used[:n_o], "gate/up": used[n_o : n_o + n_g], "down": used[n_o + n_g :]}
    out = {}
    for kind, span in kinds.items():
        span = (span - zero) / 1e3
        out[kind] = {"first_start_us": float(span[:, 0].min()), "last_end_us": float(span[:, 1].max()),
                     "median_item_us": float((span[:, 1] - span[:, 0]).median()), "items": len(span)}  # fmt: skip
    return out


def small_check() -> None:
    """The CPU tests' small float16 and float64 layers, on CUDA: error against the float64 layer."""
    for rows, hidden, inter, dtype in (
        (16, 64, 96, torch.float16),
        (64, 2048, 11008, torch.float16),
        (8, 40, 64, torch.float32),
    ):
        small = BlockLaunch(block_o=16, block_g=16, block_d=16, block_k=16, down_splits=3, num_stages=1)
        for launch in (small, B()):
            gen = torch.Generator(device="cuda").manual_seed(3)
            r = lambda *s_, scale=1.0: (torch.randn(*s_, generator=gen, device="cuda") * scale).to(dtype)  # noqa: E731, B023
            t = {"hidden": r(rows, hidden), "attention": r(rows, hidden), "w_o": r(hidden, hidden, scale=hidden**-0.5),
                 "w_post": 1.0 + r(hidden, scale=0.1), "gate_up": r(2 * inter, hidden, scale=hidden**-0.5),
                 "w_down": r(hidden, inter, scale=inter**-0.5)}  # fmt: skip
            out = post_attention(**t, eps=EPS, counters=counters_for(hidden, launch, "cuda"), launch=launch)
            want = float64_layer(t)
            err = float((out.double() - want.double()).norm() / want.double().norm())
            print(f"small {dtype} rows {rows} launch {'small' if launch is small else 'default'}: rel err {err:.2e} "
                  f"finite {bool(torch.isfinite(out).all())} equal {float((out == want).float().mean()):.3f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the table as JSON here")
    parser.add_argument("--settings", default="default", choices=("default", "all"))
    parser.add_argument("--phases", action="store_true", help="also time each kind of item in one launch")
    args = parser.parse_args()
    layers = _layers()
    if args.phases:
        small_check()
        for launch in (
            B(),
            B(backoff=True),
            B(backoff=True, prefetch=True),
            B(block_o=16, block_g=64, backoff=True, prefetch=True),
        ):
            print("phases", launch, json.dumps(phases(layers, launch)), flush=True)
    calls = [("separate kernels (compiled layer_post)", _separate, B())]
    for launch in SETTINGS if args.settings == "all" else SETTINGS[:1]:
        label = " ".join(f"{k}={v}" for k, v in vars(launch).items() if v != getattr(B(), k)) or "default"
        call = lambda t, c, launch=launch: post_attention(**t, eps=EPS, counters=c, launch=launch)  # noqa: E731
        calls.append((f"block {label}", call, launch))
    rows = []
    for label, call, launch in calls:
        counters = counters_for(HIDDEN, launch, "cuda")
        row = {"call": label, **time_call(call, layers, counters)}
        row["counters_zero"] = int(counters.abs().sum()) == 0
        rows.append(row)
        print(f"{label:44s} {row['us']:7.2f} us {row['tb_per_s']:5.2f} TB/s err {row['rel_error']:.1e} "
              f"repeat {row['bitwise_repeat']} counters zero {row['counters_zero']}", flush=True)  # fmt: skip
    for kernel in _compiled(block_kernel._block):
        meta = kernel.metadata
        print("block kernel: shared", meta.shared, "registers", getattr(kernel, "n_regs", None),
              "spills", getattr(kernel, "n_spills", None), "warps", meta.num_warps, "stages", meta.num_stages)  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
