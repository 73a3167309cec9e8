"""Probe: L2 prefetch plans of the decode step on the 3B workload, side by side in one process.

Usage: python scripts/prefetch_probe.py [--plans NAME,...] [--repeats 2] [--out FILE]
Each plan sets ``rollout.decode.PREFETCH_PLAN``; every plan's tokens and log-probs are compared with
the first plan's (prefetch hints change no value)."""

from __future__ import annotations

import argparse
import json
import sys

import torch

import rollplex.rollout.decode as decode
from rollplex.bench.common import PromptShape
from rollplex.bench.decode import DecodeBenchConfig, _NoText, copy_bandwidth, decode_workload, step_bytes
from rollplex.bench.variants import DECODE_VARIANTS
from rollplex.rollout.engine import SamplingParams, generate

PLANS = {
    "none": {},
    "o@end": {"attn": ["o"]},
    "o@start": {"attn": ["o"], "attn_start": True},
    "o@end+kvfirst": {"attn": ["o"], "kv_evict": "evict_first"},
    "o+gu16@end": {"attn": ["o", "gu16"]},
    "o@end+qkv@gate": {"attn": ["o"], "gate": "qkv"},
    "o@end+qkvlast@gate": {"attn": ["o"], "gate": "qkv_last"},
    "o@end+down16@gate": {"attn": ["o"], "gate": "down16"},
    "o@end+qkv@gate+gufirst": {"attn": ["o"], "gate": "qkv", "gate_evict": "evict_first"},
    "cublaslt": {"blas": "cublaslt"},
}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plans", default=",".join(PLANS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.recompile_limit = 64
    cfg = DecodeBenchConfig()
    model, prompts, prefix, banned = decode_workload(cfg)
    device = prefix.keys[0].device
    bandwidth = copy_bandwidth(device)
    shape = PromptShape(cfg.text_tokens, cfg.grid)
    roofline = step_bytes(model, [shape.length] * cfg.groups, cfg.group_size, cfg.response_tokens) / (
        bandwidth * 1e9
    )
    options = DECODE_VARIANTS["graphs+compile+triton+fused+sampling+gate"]
    params = SamplingParams(1.0, 1.0, 0, cfg.response_tokens, (-1,), 0, banned, **options)
    rows, reference = {}, None
    print(f"copy bandwidth {bandwidth:.0f} GB/s, roofline {roofline * 1e3:.3f} ms/step", flush=True)
    for repeat in range(args.repeats):
        for name in args.plans.split(","):
            decode.PREFETCH_PLAN.clear()
            decode.PREFETCH_PLAN.update(PLANS[name])
            torch.backends.cuda.preferred_blas_library(PLANS[name].get("blas", "cublas"))
            generator = torch.Generator(device).manual_seed(0)
            try:
                batch = generate(
                    model,
                    prompts,
                    prefix,
                    group_size=cfg.group_size,
                    params=params,
                    tokenizer=_NoText(),
                    generator=generator,
                )
            except Exception as err:  # noqa: BLE001
                print(f"{name}: failed {type(err).__name__}: {err}", flush=True)
                continue
            t = batch.timeline
            ms = (t.end - t.start) / max(1, t.steps) * 1e3
            same = None
            if reference is None:
                reference = (batch.responses.clone(), batch.logprobs.clone())
            else:
                same = bool(
                    torch.equal(batch.responses, reference[0]) and torch.equal(batch.logprobs, reference[1])
                )
            rows.setdefault(name, []).append(ms)
            print(
                f"{name} (run {repeat}): {ms:.3f} ms/step, {ms / (roofline * 1e3):.3f}x roofline, bitwise {same}",
                flush=True,
            )
    result = {"bandwidth_gbps": bandwidth, "roofline_ms": roofline * 1e3, "ms_per_step": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
