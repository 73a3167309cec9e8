"""The default decode step under process-wide library settings, side by side in one process (CUDA).

Settings: ``base`` (as shipped), ``cublaslt`` (torch.backends.cuda.preferred_blas_library("cublaslt")),
``coordinate-descent`` (inductor's coordinate-descent tuning of its own kernels; recompiles the step),
``tunableop`` (torch.cuda.tunable: times cuBLAS's default against cuBLASLt's candidate algorithms for each
product shape, keeps the fastest, prints the choice), and ``profile`` (kernel table of 16 steps as
shipped). Workload: ``rollplex bench decode``'s (the 3B architecture, 8 groups × 3,920-token prompts,
N = 8, 512 tokens), decoded with the bench's default variant.
Usage: python scripts/decode_settings.py [base cublaslt coordinate-descent tunableop profile ...]
"""

from __future__ import annotations

import torch

from rollplex.bench.common import PromptShape, cuda_script_args, one_of
from rollplex.bench.decode import (
    DecodeBenchConfig,
    _NoText,
    copy_bandwidth,
    decode_workload,
    profile_steps,
    step_bytes,
)
from rollplex.bench.variants import DECODE_VARIANTS
from rollplex.rollout import decode
from rollplex.rollout.engine import SamplingParams, generate

VARIANT = "graphs+compile+triton+fused+sampling"


SETTINGS = ("base", "cublaslt", "coordinate-descent", "tunableop", "profile")


def main(settings: list[str]) -> None:
    cfg = DecodeBenchConfig()
    model, prompts, prefix, banned = decode_workload(cfg)
    device, shape = prefix.keys[0].device, PromptShape(cfg.text_tokens, cfg.grid)
    bandwidth = copy_bandwidth(device)
    roofline = step_bytes(model, [shape.length] * cfg.groups, cfg.group_size, cfg.response_tokens) / (
        bandwidth * 1e9
    )
    print(f"copy bandwidth {bandwidth:.0f} GB/s, roofline {roofline * 1e3:.3f} ms", flush=True)
    params = SamplingParams(1.0, 1.0, 0, cfg.response_tokens, (-1,), 0, banned, **DECODE_VARIANTS[VARIANT])

    def run(label: str) -> None:
        batch = generate(
            model, prompts, prefix, group_size=cfg.group_size, params=params, tokenizer=_NoText()
        )
        ms = (batch.timeline.end - batch.timeline.start) / max(1, batch.timeline.steps) * 1e3
        print(f"{label}: {ms:.3f} ms/step ({ms / 1e3 / roofline:.2f}x roofline)", flush=True)

    def recompile() -> None:
        torch._dynamo.reset()
        decode._COMPILED.clear()

    for setting in settings or ["base", "cublaslt", "coordinate-descent", "tunableop"]:
        if setting == "base":
            run(setting)
        elif setting == "cublaslt":
            torch.backends.cuda.preferred_blas_library("cublaslt")
            run(setting)
            torch.backends.cuda.preferred_blas_library("cublas")
        elif setting == "coordinate-descent":
            import torch._inductor.config as inductor

            recompile()
            inductor.coordinate_descent_tuning = True
            run(setting)
            recompile()
            inductor.coordinate_descent_tuning = False
        elif setting == "tunableop":
            import torch.cuda.tunable as tunable

            tunable.set_filename("/tmp/tunableop_results.csv")
            tunable.enable(True)
            tunable.tuning_enable(True)
            run(setting)
            print("chosen per product:", tunable.get_results(), flush=True)
            tunable.tuning_enable(False)
            tunable.enable(False)
        elif setting == "profile":
            print(profile_steps(model, prefix, cfg.group_size, params, 16))


if __name__ == "__main__":
    main(
        cuda_script_args(
            __doc__,
            lambda p: p.add_argument(
                "settings",
                nargs="*",
                type=one_of(SETTINGS),
                help=f"any of {', '.join(SETTINGS)} (default: all but profile)",
            ),
        ).settings
    )
