"""Time the fused sampling race (rollout.sample_kernel) at the decode workload's shape, per launch
setting: 64 rows × the Qwen2.5-VL vocabulary (151,936), bf16 logits, float32 noise, T = 1, the five
vision ids banned. Each timing replays a CUDA graph of 32 calls over 4 input sets (≈ 230 MB, beyond
the L2 cache); µs per call, median of 5 replays.

    python benchmarks/scripts/race_sweep.py [--baseline FILE] [--out results.json]

The JSON gives µs per call and, with a baseline, whether each setting drew the baseline's tokens.
``--baseline`` times the ``fused_race`` of another copy of sample_kernel.py (e.g. an earlier commit's,
``git show REV:rollplex/rollout/sample_kernel.py > old.py``) beside this one's settings.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
from pathlib import Path

import torch

from rollplex.bench.common import cuda_script_args, replay_us
from rollplex.rollout import sample_kernel

CALLS = 32  # race calls per graph
ROWS, VOCAB, BANNED = 64, 151_936, (151652, 151653, 151654, 151655, 151656)
SETTINGS = [  # (vocabulary slices per row, entries per iteration, warps)
    (32, 1024, 4), (32, 1024, 8), (32, 2048, 8), (64, 1024, 4), (64, 512, 4), (16, 1024, 4),
    (16, 2048, 8), (128, 512, 4), (32, 512, 2),
]  # fmt: skip


def _time(race, inputs, banned) -> float:
    """µs per call of ``race`` over ``inputs``, as graph replays."""
    for logits, noise in inputs:  # compile outside the capture
        race(logits, noise, temperature=1.0, banned_ids=banned)
    torch.cuda.synchronize()

    def calls() -> None:
        for i in range(CALLS):
            race(*inputs[i % len(inputs)], temperature=1.0, banned_ids=banned)

    return statistics.median(replay_us(calls, CALLS, replays=1, repeats=5))


def main() -> None:
    def arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--baseline", help="another sample_kernel.py whose fused_race is timed too")
        parser.add_argument("--out", help="write the results as JSON here")

    args = cuda_script_args(__doc__, arguments)
    g = torch.Generator(device="cuda").manual_seed(0)
    inputs = [
        (
            torch.randn(ROWS, VOCAB, device="cuda", generator=g).to(torch.bfloat16),
            torch.empty(ROWS, VOCAB, device="cuda").exponential_(generator=g),
        )
        for _ in range(4)
    ]
    banned = torch.tensor(BANNED, device="cuda")
    results = {}
    if args.baseline:
        spec = importlib.util.spec_from_file_location("baseline_sample_kernel", args.baseline)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        results["baseline"] = {"us": _time(module.fused_race, inputs, banned)}
        print(f"baseline {results['baseline']['us']:.2f} µs")
    want = module.fused_race(*inputs[0], temperature=1.0, banned_ids=banned) if args.baseline else None
    for splits, block, warps in SETTINGS:
        sample_kernel.SPLITS, sample_kernel.BLOCK, sample_kernel.NUM_WARPS = splits, block, warps
        name = f"{splits}/{block}/{warps}"
        us = _time(sample_kernel.fused_race, inputs, banned)
        got = sample_kernel.fused_race(*inputs[0], temperature=1.0, banned_ids=banned)
        same = None if want is None else torch.equal(got[0], want[0])
        results[name] = {"us": us, "tokens_equal_baseline": same}
        print(f"{name:>14} {us:8.2f} µs" + ("" if same is None else f"  tokens equal the baseline's: {same}"))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
