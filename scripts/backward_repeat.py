"""Whether the actor's backward pass repeats itself bit for bit, where it first does not, and what
torch's deterministic algorithms cost there, on the ``rollplex bench schedule`` workload (3B
architecture, 8 groups of 3,920-token video prompts, N = 8, 512-token responses, serial row).

One rollout, rewards and reference log-probs; then the same ``phases.actor_backward`` (forward and
backward) over all groups, from zeroed gradients, for each setting in the order given, in one process:

- ``default``: the default kernels;
- ``deterministic``: ``torch.use_deterministic_algorithms(True)`` with new allocations left unfilled
  (``torch.utils.deterministic.fill_uninitialized_memory = False``);
- ``deterministic+fill``: the same with new allocations filled (torch's default in that mode, and
  ``run.deterministic``'s).

Where a deterministic setting is asked for, ``CUBLAS_WORKSPACE_CONFIG`` is set before the first matrix
product, as ``run.deterministic`` sets it, and so for every setting of the process. Each setting first
runs one pass that is discarded (it compiles where the deterministic flag changed: dynamo guards on it),
then ``--repeats`` kept passes; each kept pass's gradients (bf16, the model's dtype) are compared with
the first kept pass's, parameter by parameter: bitwise equal or not, and the relative L2 difference.
Equal means equal after the rounding to bf16, so a listed parameter is the first *visible* difference.
Parameters are listed in backward order, the first 8 that differ: the LM head and final norm (a head tied
to the embeddings, as in the 3B preset, is listed as the embeddings, last), then the layers from the
last, each as its MLP (down, then gate/up), post-attention norm, o, q/k/v and input norm, then the vision
tower from its merger and last block, then the embeddings. A varying kernel on a layer's input-gradient
path shows first in the parameters of the layer below.
``ROLLPLEX_SUFFIX_ATTENTION`` picks the suffix attention as in training (recorded in the JSON).

Usage (CUDA): python scripts/backward_repeat.py [SETTING ...] [--repeats 3] [--out repeat.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

import torch

from rollplex.bench.common import cuda_script_args, int_between, one_of
from rollplex.bench.schedule import default_row
from rollplex.loop import CUBLAS_WORKSPACE, use_deterministic_algorithms
from rollplex.models.forward import suffix_backend
from rollplex.phases import actor_backward, reference_phase, reward_phase, rollout_phase

SETTINGS = ("default", "deterministic", "deterministic+fill")
LISTED = 8  # differing parameters listed per repeat
_LAYER_PARTS = ("mlp.down", "mlp.", "post_attention", "o_proj", "_proj", "input_layernorm")


def _apply_setting(setting: str) -> None:
    if setting == "default":
        torch.use_deterministic_algorithms(False)
        return
    use_deterministic_algorithms()
    torch.utils.deterministic.fill_uninitialized_memory = setting.endswith("+fill")


def _backward(roles, scored, groups) -> tuple[float, dict[str, torch.Tensor]]:
    roles.optimizer.zero_grad()
    torch.cuda.synchronize()
    start = time.perf_counter()
    actor_backward(roles, scored, groups, None)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    grads = {n: p.grad for n, p in roles.actor.named_parameters() if p.grad is not None}
    return seconds, grads


def _backward_order(name: str) -> tuple:
    """Sort key of a parameter name in the order the backward pass reaches it (see the module
    docstring); names within one step of that order (q, k, v) sort by name."""
    layer = re.search(r"language_model\.layers\.(\d+)\.(.*)", name)
    if layer is not None:
        part = next((i for i, key in enumerate(_LAYER_PARTS) if key in layer.group(2)), len(_LAYER_PARTS))
        return (1, -int(layer.group(1)), part, name)
    block = re.search(r"visual\.blocks\.(\d+)\.", name)
    if block is not None:
        return (3, -int(block.group(1)), name)
    if "lm_head" in name or name.endswith("language_model.norm.weight"):
        return (0, 0, name)
    if "visual.merger" in name:
        return (2, 0, name)
    return (4, 0, name)  # embeddings, the vision patch embedding


def _compare(first: dict[str, torch.Tensor], again: dict[str, torch.Tensor]) -> dict:
    names = sorted(first, key=_backward_order)
    differing = []
    for name in names:
        a, b = first[name], again[name]
        if not torch.equal(a, b):
            rel = float((a.double() - b.double()).norm() / a.double().norm().clamp_min(1e-300))
            differing.append({"name": name, "rel_diff": rel})
    return {
        "parameters": len(names),
        "differing": len(differing),
        "first_in_backward_order": differing[:LISTED],
        "largest_rel_diff": max((d["rel_diff"] for d in differing), default=0.0),
    }


def _run_setting(roles, scored, groups, repeats: int) -> dict:
    """One setting's discarded pass and kept passes, each kept pass compared with the first kept."""
    warmup, _ = _backward(roles, scored, groups)
    seconds, grads = _backward(roles, scored, groups)
    first = {n: g.clone() for n, g in grads.items()}
    times, compared = [seconds], []
    for _ in range(repeats - 1):
        seconds, grads = _backward(roles, scored, groups)
        times.append(seconds)
        compared.append(_compare(first, grads))
    return {"warmup_seconds": warmup, "seconds": times, "repeats": compared}


def main() -> None:
    def arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "settings", nargs="*", type=one_of(SETTINGS), help=f"any of {', '.join(SETTINGS)} (default: all)"
        )
        parser.add_argument("--repeats", type=int_between(2, 10), default=3, metavar="2..10")
        parser.add_argument("--out", help="write the results as JSON here")

    args = cuda_script_args(__doc__, arguments)
    settings = args.settings or list(SETTINGS)
    if any(s != "default" for s in settings):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)  # before cuBLAS's first handle
    work, roles, _ = default_row("serial", torch.device("cuda"))
    cfg = roles.config
    rollout = rollout_phase(roles, work.prompts, cfg.rollout.group_size, roles.sampling)
    scored = reference_phase(roles, reward_phase(roles, rollout))
    groups = list(range(len(work.prompts)))
    results = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "suffix_attention": suffix_backend(torch.device("cuda"), next(roles.actor.parameters()).dtype),
        "settings": {},
    }
    for setting in settings:
        _apply_setting(setting)
        result = results["settings"][setting] = _run_setting(roles, scored, groups, args.repeats)
        print(
            f"{setting}: discarded pass {result['warmup_seconds']:.3f} s, kept",
            [round(t, 3) for t in result["seconds"]],
            "s",
            flush=True,
        )
        for i, rep in enumerate(result["repeats"], 2):
            print(f"  kept pass {i}: {rep['differing']} of {rep['parameters']} gradients differ", flush=True)
            for d in rep["first_in_backward_order"]:
                print(f"    {d['name']}: rel diff {d['rel_diff']:.3e}", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
