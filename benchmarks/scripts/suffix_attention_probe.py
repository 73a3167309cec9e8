"""The suffix attention of one decoder layer at the 3B shape, per backend: milliseconds per forward and
per forward + backward, peak memory, the error against float64 dense attention on the same inputs,
whether the backward repeats bit for bit (default kernels and torch's deterministic algorithms), and the
five longest kernels of one forward + backward.

The shape is the schedule bench's workload: each group's N = 8 responses of R = 511 suffix positions
against its 3,920-key boundary, H = 16 query and Hkv = 2 key/value heads of D = 128, bf16; ``--groups``
groups per call (1: an actor micro-batch; 8: the reference's whole batch). Backends as
``model.suffix_attention`` names them (``models.attention.SUFFIX_ATTENTION``). Gradients are taken
with respect to the queries, the responses' own keys and values, and the boundary keys and values (the
actor's boundary is attached), against one fixed random output gradient.

Errors are relative L2 norms against float64 dense attention (``dense`` computed in float64 on the
same bf16 inputs), for the output and each gradient, with one group only. Each backend's plan (its mask
for ``sdpa`` and ``flex``) is made once, as a suffix pass makes it once for all its layers, and is not
timed. Timings are medians over ``--repeats`` calls, each synchronised; the deterministic timings run
under ``torch.use_deterministic_algorithms(True)``.

Usage (CUDA): python benchmarks/scripts/suffix_attention_probe.py [--backends causal,cascade,sdpa,dense] [--groups 1]
    [--repeats 10] [--out probe.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from rollplex.bench.common import comma_list_of, cuda_script_args, int_between, timed
from rollplex.determinism import CUBLAS_WORKSPACE
from rollplex.models.attention import SUFFIX_ATTENTION, SuffixPlan, suffix_plan
from rollplex.types import PrefixState

N, R, P, H, HKV, D = 8, 511, 3920, 16, 2, 128
INPUTS = ("query", "own_keys", "own_values", "boundary_keys", "boundary_values")


def make_inputs(groups: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random bf16 leaves (requires_grad) of ``groups`` groups, on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = {
        "query": (groups * N, H, R, D),
        "own_keys": (groups * N, HKV, R, D),
        "own_values": (groups * N, HKV, R, D),
        "boundary_keys": (groups, HKV, P, D),
        "boundary_values": (groups, HKV, P, D),
    }
    return {
        name: torch.randn(shape, generator=g, device="cuda").to(torch.bfloat16).requires_grad_(True)
        for name, shape in shapes.items()
    }


def make_plan(backend: str, x: dict[str, torch.Tensor]) -> SuffixPlan:
    """``backend``'s plan over the boundary of ``x``, its mask included, made once as a suffix pass makes
    it once for all its layers (so the timings below leave it out)."""
    groups = x["boundary_keys"].shape[0]
    lens = torch.full((groups,), P, device="cuda")
    prefix = PrefixState(
        keys=[x["boundary_keys"]],
        values=[x["boundary_values"]],
        prompt_lens=lens,
        host_prompt_lens=(P,) * groups,
        next_position=lens,  # not read by the suffix attention
        last_logprobs=lens,  # likewise
        content_keys=[""] * groups,
        attached=True,
    )
    return suffix_plan(prefix, N, R, backend)


def attention(plan: SuffixPlan, x: dict[str, torch.Tensor]) -> torch.Tensor:
    """[G·N, R, H, D]: the plan's suffix attention of layer 0 on the inputs ``x``."""
    return SUFFIX_ATTENTION[plan.backend](x["query"], x["own_keys"], x["own_values"], plan, 0, D**-0.5)


def forward_backward(plan: SuffixPlan, x: dict[str, torch.Tensor], grad: torch.Tensor) -> dict:
    """The output and the gradient of every input, from cleared gradients."""
    for t in x.values():
        t.grad = None
    out = attention(plan, x)
    out.backward(grad)
    return {"output": out.detach(), **{name: x[name].grad for name in INPUTS}}


def rel_errors(got: dict, want: dict) -> dict[str, float]:
    """‖got − want‖ / ‖want‖ per entry (output and each gradient), in float64."""
    return {k: float((got[k].double() - want[k]).norm() / want[k].norm().clamp_min(1e-300)) for k in want}


def longest_kernels(plan: SuffixPlan, x: dict, grad: torch.Tensor) -> dict[str, float]:
    """The five longest CUDA kernels of one forward + backward, µs each."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        forward_backward(plan, x, grad)
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    return {e.key[:120]: round(e.device_time_total, 1) for e in rows[:5]}


def probe(backend: str, x: dict, grad: torch.Tensor, want: dict | None, repeats: int) -> dict:
    """Every figure of one backend (the module docstring's list), as a JSON-ready dict."""
    device, plan = torch.device("cuda"), make_plan(backend, x)
    res: dict = {}
    with torch.no_grad():
        times, _ = timed(lambda: attention(plan, x), repeats + 1, device)
    res["forward_ms"] = statistics.median(times[1:]) * 1e3
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times, last = timed(lambda: forward_backward(plan, x, grad), repeats + 1, device)
    res["forward_backward_ms"] = statistics.median(times[1:]) * 1e3
    res["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    if want is not None:
        res["rel_error_vs_float64"] = rel_errors(last, want)
    again = forward_backward(plan, x, grad)
    res["repeats_bitwise"] = {k: torch.equal(last[k], again[k]) for k in last}
    res["kernels_us"] = longest_kernels(plan, x, grad)
    torch.use_deterministic_algorithms(True)
    try:
        times, det = timed(lambda: forward_backward(plan, x, grad), repeats + 1, device)
        res["deterministic_forward_backward_ms"] = statistics.median(times[1:]) * 1e3
        det_again = forward_backward(plan, x, grad)
        res["deterministic_repeats_bitwise"] = all(torch.equal(det[k], det_again[k]) for k in det)
    except RuntimeError as err:  # a kernel without a deterministic version
        res["deterministic_error"] = str(err).splitlines()[0]
    finally:
        torch.use_deterministic_algorithms(False)
    return res


def main() -> None:
    def arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--backends",
            default="causal,cascade,sdpa,dense",
            type=comma_list_of(tuple(SUFFIX_ATTENTION)),
            help=f"comma-separated, any of {', '.join(SUFFIX_ATTENTION)} (default causal,cascade,sdpa,dense)",
        )
        parser.add_argument(
            "--groups",
            type=int_between(1, 8),
            default=1,
            metavar="1..8",
            help="groups per call (default 1)",
        )
        parser.add_argument(
            "--repeats",
            type=int_between(1, 100),
            default=10,
            metavar="1..100",
            help="timed calls per figure (default 10)",
        )
        parser.add_argument("--out", help="write the results as JSON here")

    args = cuda_script_args(__doc__, arguments)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)  # before the first product
    x = make_inputs(args.groups)
    grad = torch.randn(args.groups * N, R, H, D, device="cuda").to(torch.bfloat16)
    want = None
    if args.groups == 1:  # float64 dense attention of 8 groups would take about 80 GB
        x64 = {k: v.detach().double().requires_grad_(True) for k, v in x.items()}
        want = forward_backward(make_plan("dense", x64), x64, grad.double())
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "groups": args.groups}
    for backend in args.backends:
        res[backend] = probe(backend, x, grad, want, args.repeats)
        print(backend, json.dumps(res[backend], indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
