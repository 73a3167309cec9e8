"""Tuning sweep of the fused decode attention (rollplex.rollout.decode_kernel) near the 3B benchmark shape
(8 groups × 4,000 boundary keys, 64 rows, 2 kv heads of 8 queries, D = 128).

For each setting of one grid (``chunks``: keys per prefix and per own-key program; ``launch``: keys per
inner iteration, warps and pipeline stages of the partials; ``merge``: warps of the merge) and a few
decode steps, 36 calls, one per
layer of the 3B model, each on its own keys and values (so no call reads what the previous one left in
L2), are captured in a CUDA graph and replayed; the table gives microseconds per call and the key/value
bytes it reads per microsecond.
Usage (CUDA): python benchmarks/scripts/attention_sweep.py [--grid chunks|launch|merge] [--steps 64,256,500] [--out sweep.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import torch

from rollplex.bench.common import cuda_script_args, replay_us
from rollplex.rollout.decode_kernel import fused_decode_attention

GROUPS, N, HKV, REP, D, PROMPT, LAYERS, WINDOW = 8, 8, 2, 8, 128, 4000, 36, 128


def attention_inputs(step: int) -> tuple:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=gen, device="cuda").to(torch.bfloat16)  # noqa: E731
    rows, window = GROUPS * N, (step // WINDOW + 1) * WINDOW
    q, pk, pv = rand(rows, HKV * REP, D), rand(GROUPS, HKV, PROMPT, D), rand(GROUPS, HKV, PROMPT, D)
    lens = torch.full((GROUPS,), PROMPT, dtype=torch.int32, device="cuda")
    own_k, own_v = rand(rows, HKV, window, D), rand(rows, HKV, window, D)
    new = (own_k[:, :, step].clone(), own_v[:, :, step].clone())
    return q, pk, pv, lens, own_k, own_v, *new, torch.tensor([step], device="cuda"), D**-0.5, N


def _bytes(step: int) -> int:
    """Key/value bytes one call reads: every boundary key once per group, each row's own keys 0..step."""
    return 2 * 2 * HKV * D * (GROUPS * PROMPT + GROUPS * N * (step + 1))


def time_call(step: int, knobs: dict, replays: int = 20) -> float:
    """Microseconds per call, from CUDA-graph replays of LAYERS calls on LAYERS input sets."""
    layers = [attention_inputs(step) for _ in range(LAYERS)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_decode_attention(*layers[0], **knobs)  # compile
    torch.cuda.synchronize()
    calls = lambda: [fused_decode_attention(*args, **knobs) for args in layers]  # noqa: E731
    return replay_us(calls, LAYERS, replays, repeats=1)[0]


def main() -> None:
    def arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--out", help="write the table as JSON here")
        parser.add_argument("--steps", default="64,256,500", help="decode steps (own keys 0..step)")
        parser.add_argument(
            "--grid",
            choices=("chunks", "launch", "merge"),
            default="chunks",
            help="chunks: keys per prefix and own-key program; launch: keys per inner iteration, warps and "
            "pipeline stages at the default chunks; merge: the merge launch's warps",
        )

    args = cuda_script_args(__doc__, arguments)
    steps = [int(s) for s in args.steps.split(",")]
    if args.grid == "chunks":
        grid = itertools.product((256, 384, 448, 512, 640, 768, 1024), (256, 512))
        settings = [{"prefix_chunk": pc, "own_chunk": oc} for pc, oc in grid]
    elif args.grid == "merge":
        settings = [{"merge_warps": w} for w in (1, 2, 4, 8)]
    else:
        grid = itertools.product((32, 64, 128), (4, 8), (2, 3, 4))
        settings = [{"block_keys": b, "num_warps": w, "num_stages": st} for b, w, st in grid]
    rows = []
    print(
        " ".join(f"{k:>12}" for k in settings[0]) + " " + " ".join(f"{'step ' + str(s):>16}" for s in steps)
    )
    for knobs in settings:
        try:
            times = [time_call(step, knobs) for step in steps]
        except Exception as err:  # noqa: BLE001 - e.g. out of shared memory: report, go on
            print(f"{knobs}: failed: {type(err).__name__}: {str(err)[:200]}")
            continue
        rows.append({**knobs, "us_per_call": dict(zip(steps, times, strict=True))})
        cells = " ".join(
            f"{t:7.2f} us {_bytes(s) / t / 1e3:4.0f}GB/s" for s, t in zip(steps, times, strict=True)
        )
        print(" ".join(f"{v:>12}" for v in knobs.values()) + f" {cells}")
    best = min(rows, key=lambda r: math.fsum(r["us_per_call"].values()))
    print(f"best over the steps: { ({k: v for k, v in best.items() if k != 'us_per_call'}) }")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "steps": steps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
