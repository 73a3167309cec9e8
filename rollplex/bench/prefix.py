"""``rollplex bench prefix``: prefix + suffix against the naive per-sequence way, side by side.

Workload: G prompt groups of one video prompt each (≈ ``prompt_tokens`` tokens, most of them video),
N responses of R tokens per group, random weights. Two roles are measured:

- reference scoring (no graph): rollplex = one detached prefix per group + the N suffixes against the
  shared boundary KV; naive = every one of the N sequences runs the vision tower and the whole
  prompt + response (as Video-R1 and TRL do, one sequence per micro-batch).
- actor forward + backward of a GRPO-shaped loss: rollplex = one attached prefix per group + suffixes,
  backward through the boundary KV into the prefix and the vision tower, one group per micro-batch;
  naive = one sequence per micro-batch.

Reported per role: median step time and peak device memory above the weights, and their ratios; plus
the suffix-pass peak memory for several N at fixed prompt length (it must grow with N·R, not N·P; the
causal suffix attention adds a small N·P term, one copy of the boundary's keys and values per
response in each layer's attention),
and the bf16 agreement of the two ways' log-probs. The ``vision`` part times the prefix pass alone
(vision tower + prompt prefill of every group; detached, and attached with backward) under each
``model.vision_attention``, batched without ``model.vision_mlp_padding``, and batched with
``model.compile_layers`` (on CUDA), side by side in one process.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch

from rollplex.bench.common import (
    PromptShape,
    Workload,
    bench_device,
    median,
    peak_gib,
    synthetic_prompt,
    text_id_range,
    workload_model,
)
from rollplex.models.attention import PrefixPlan, SuffixAttention
from rollplex.models.compiled import compiles_layers
from rollplex.models.forward import (
    _decoder,
    _token_logprobs_chunked,
    prefix_forward,
    prepare_model,
    prompt_embeddings,
    suffix_logprobs,
)
from rollplex.types import Prompt


@dataclass(frozen=True)
class PrefixBenchConfig(Workload):
    """Workload of ``rollplex bench prefix`` (defaults: the 3B workload of benchmarks/README.md)."""

    repeats: int = 1
    suffix_group_sizes: tuple[int, ...] = (4, 8, 16)
    parts: tuple[str, ...] = ("compare", "suffix-memory")
    suffix_attention: str = "auto"  # model.suffix_attention
    cascade_kernels: str = "auto"  # model.cascade_kernels


def _attention(cfg: PrefixBenchConfig) -> SuffixAttention:
    return SuffixAttention(cfg.suffix_attention, cfg.cascade_kernels)


PARTS = ("compare", "suffix-memory", "vision")


@dataclass
class PrefixBenchResult:
    config: dict
    prompt_tokens: int
    rows: dict = field(default_factory=dict)
    vision_attention: dict = field(default_factory=dict)
    suffix_memory: dict = field(default_factory=dict)
    logprob_agreement: dict = field(default_factory=dict)


def naive_logprobs(model, prompt: Prompt, responses: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
    """Log-probs [n, R] of n sequences that each carry their own copy of the prompt and video (the vision
    tower runs n times), batched into one full causal forward."""
    n, r = responses.shape
    embeds = (
        prompt_embeddings(model, prompt).expand(n, -1, -1)
        if n == 1
        else torch.cat([prompt_embeddings(model, prompt) for _ in range(n)])
    )
    embeds = torch.cat([embeds, model.model.language_model.embed_tokens(responses)], dim=1)
    steps = prompt.next_position + torch.arange(r, device=responses.device)
    positions = torch.cat([prompt.position_ids, steps.expand(3, -1)], dim=1)[:, None, :].expand(3, n, -1)
    hidden = _decoder(model, embeds, positions, PrefixPlan())
    p = prompt.length
    return _token_logprobs_chunked(model, hidden[:, p - 1 : -1], responses, 1.0, banned)


def _shared_prefix_pass(
    model, prompts, responses, n, banned, attached: bool, attention: SuffixAttention
) -> torch.Tensor:
    """Log-probs [G·N, R] of the groups' responses scored the rollplex way: one prefix per group, shared
    by the suffixes of its N responses; ``attached``: each group's backward from the mean of its
    log-probs, into the prefix and the vision tower."""
    outs = []
    for g, prompt in enumerate(prompts):
        prefix = prefix_forward(model, [prompt], temperature=1.0, banned_ids=banned, attached=attached)
        rows = responses[g * n : (g + 1) * n]
        lp, _ = suffix_logprobs(
            model, prefix, rows, group_size=n, temperature=1.0, banned_ids=banned, attention=attention
        )
        if attached:
            lp.float().mean().backward()
            lp = lp.detach()
        outs.append(lp)
    return torch.cat(outs)


def _naive_pass(model, prompts, responses, n, banned, attached: bool, per_group: bool) -> torch.Tensor:
    """Naive scoring: micro-batches of one sequence, or of the N sequences of a group (``per_group``)."""
    outs, step = [], n if per_group else 1
    for b in range(0, responses.shape[0], step):
        lp = naive_logprobs(model, prompts[b // n], responses[b : b + step], banned)
        if attached:
            (lp.float().mean() * step / n).backward()
            lp = lp.detach()
        outs.append(lp)
    return torch.cat(outs)


def _measure(name: str, fn, warm, repeats: int, device) -> tuple[float, float, torch.Tensor | None]:
    """(median seconds, peak GiB of the first timed run, its output) after one warm-up call ``warm()``
    (compilation, allocator growth); (nan, nan, None) when the device runs out of memory."""
    try:
        warm()
        times, peaks, outs = [], [], []
        for _ in range(repeats):
            start = time.perf_counter()
            peak, result = peak_gib(fn, device)
            times.append(time.perf_counter() - start)
            peaks.append(peak)
            outs.append(result)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        print(f"  {name}: out of memory", flush=True)
        return float("nan"), float("nan"), None
    print(f"  {name}: {median(times):.3f} s, peak {peaks[0]:.2f} GiB", flush=True)
    return median(times), peaks[0], outs[0]


def run_prefix_bench(cfg: PrefixBenchConfig, out: Path | None = None) -> PrefixBenchResult:
    """Run the workload on CUDA (or CPU for smoke tests); print and return the table.

    Raises:
        ValueError: unknown preset or part, or a preset other than ``tiny`` without a CUDA device.
    """
    unknown = set(cfg.parts) - set(PARTS)
    if unknown:
        raise ValueError(f"bench prefix parts {sorted(unknown)}: expected a subset of {PARTS}")
    device = bench_device(cfg.preset)
    dtype = getattr(torch, cfg.dtype)
    model = workload_model(cfg, device)
    model.requires_grad_(True)
    banned = torch.tensor([model.config.image_token_id, model.config.video_token_id], device=device)
    shape = PromptShape(cfg.text_tokens, cfg.grid)
    prompts = [synthetic_prompt(model, shape, seed=g, device=device, dtype=dtype) for g in range(cfg.groups)]
    n, r = cfg.group_size, cfg.response_tokens
    responses = torch.randint(
        *text_id_range(model), (cfg.groups * n, r), generator=torch.Generator().manual_seed(1)
    ).to(device)
    result = PrefixBenchResult(config=asdict(cfg), prompt_tokens=shape.length)
    if "compare" in cfg.parts:
        _compare_roles(model, prompts, responses, cfg, banned, device, result)
    if "suffix-memory" in cfg.parts:
        result.suffix_memory = _suffix_memory(model, prompts[0], cfg, banned, device)
    if "vision" in cfg.parts:
        result.vision_attention = _vision_attention(model, prompts, cfg, banned, device)
        prepare_model(
            model,
            cfg.vision_attention,
            cfg.vision_mlp_padding,
            compiles_layers(cfg.compile_layers, device),
            cfg.compile_scope,
        )
    _print(result)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(asdict(result), indent=2))
    return result


def _compare_roles(model, prompts, responses, cfg, banned, device, result: PrefixBenchResult) -> None:
    """Reference scoring and actor forward + backward: rollplex vs the naive ways (fills result.rows)."""
    n = cfg.group_size
    for role, attached in (("reference", False), ("actor", True)):
        grad = torch.enable_grad() if attached else torch.no_grad()
        with grad:
            one = (model, prompts[:1], responses[:n], n, banned, attached)
            every = (model, prompts, responses, n, banned, attached)
            first_seq = (model, prompts[:1], responses[:1], n, banned, attached)
            ours = _measure(
                f"{role} rollplex, one group per micro-batch",
                partial(_shared_prefix_pass, *every, attention=_attention(cfg)),
                partial(_shared_prefix_pass, *one, attention=_attention(cfg)),
                cfg.repeats,
                device,
            )
            model.zero_grad(set_to_none=True)
            seq = _measure(
                f"{role} naive, one sequence per micro-batch",
                partial(_naive_pass, *every, False),
                partial(_naive_pass, *first_seq, False),
                cfg.repeats,
                device,
            )
            model.zero_grad(set_to_none=True)
            group = _measure(
                f"{role} naive, one group (N sequences) per micro-batch, first group only",
                partial(_naive_pass, *one, True),
                _nothing,
                1,
                device,
            )
        model.zero_grad(set_to_none=True)
        result.rows[role] = {
            "rollplex_s": ours[0],
            "rollplex_peak_gib": ours[1],
            "naive_seq_s": seq[0],
            "naive_seq_peak_gib": seq[1],
            "naive_group_s_per_group": group[0],
            "naive_group_peak_gib": group[1],
            "speedup_vs_naive_seq": seq[0] / ours[0],
            "memory_ratio_naive_group": group[1] / ours[1],
        }
        if role == "reference" and seq[2] is not None:
            diff = (ours[2].float() - seq[2].float()).abs()
            result.logprob_agreement = {"max_abs": float(diff.max()), "mean_abs": float(diff.mean())}


def _suffix_memory(model, prompt, cfg, banned, device) -> dict:
    """Peak memory of one group's actor pass (attached prefix + N suffixes, forward + backward) for each
    N at a fixed prompt: the prefix part is the same for every N, so the growth between rows is the
    suffix's, which must scale with N·R (with the causal suffix attention, plus one copy of the boundary's
    keys and values per response and layer: 2·Hkv·D values per prompt token and layer)."""
    rows = {}
    for n in cfg.suffix_group_sizes:
        generator = torch.Generator().manual_seed(n)
        ids = torch.randint(*text_id_range(model), (n, cfg.response_tokens), generator=generator)
        run = partial(_shared_prefix_pass, model, [prompt], ids.to(device), n, banned, True, _attention(cfg))
        run()  # warm-up
        peak, _ = peak_gib(run, device)
        rows[str(n)] = {
            "peak_gib": peak,
            "suffix_tokens": n * cfg.response_tokens,
            "prefix_tokens": prompt.length,
        }
        model.zero_grad(set_to_none=True)
    return rows


def _prefix_pass(model, prompts, banned, attached: bool) -> None:
    """Prefix of every group (vision tower + prompt prefill), one group at a time; attached: backward
    from the mean of its boundary KV into the prefix and the vision tower."""
    for prompt in prompts:
        state = prefix_forward(model, [prompt], temperature=1.0, banned_ids=banned, attached=attached)
        if attached:
            torch.stack([t.float().mean() for t in state.keys + state.values]).sum().backward()


VISION_ROWS = {  # row name: (model.vision_attention, model.vision_mlp_padding, model.compile_layers)
    "per_chunk": ("per_chunk", True, False),
    "batched-unpadded-mlp": ("batched", False, False),
    "batched": ("batched", True, False),
    "batched-compiled": ("batched", True, True),
}


def _vision_attention(model, prompts, cfg, banned, device) -> dict:
    """Seconds and peak GiB of the prefix pass under each ``model.vision_attention``, batched without
    ``model.vision_mlp_padding`` and batched with ``model.compile_layers`` (VISION_ROWS; compiled on
    CUDA only, so on a CPU that row runs eagerly), detached (reference, rollout) and attached with
    backward (actor); speedup = per_chunk / that row."""
    rows = {}
    for mode, (attention, padding, compiled) in VISION_ROWS.items():
        prepare_model(model, attention, padding, compiles_layers(compiled, device), cfg.compile_scope)
        for role, attached in (("reference", False), ("actor", True)):
            with torch.enable_grad() if attached else torch.no_grad():
                seconds, peak, _ = _measure(
                    f"prefix pass {role}, vision {mode}",
                    partial(_prefix_pass, model, prompts, banned, attached),
                    partial(_prefix_pass, model, prompts[:1], banned, attached),
                    cfg.repeats,
                    device,
                )
            model.zero_grad(set_to_none=True)
            rows[f"{role}/{mode}"] = {"seconds": seconds, "peak_gib": peak}
    for key, row in rows.items():
        row["speedup"] = rows[key.split("/")[0] + "/per_chunk"]["seconds"] / row["seconds"]
    return rows


def _nothing() -> None:
    return None


def _print(result: PrefixBenchResult) -> None:
    print(f"prompt tokens {result.prompt_tokens}, config {result.config}")
    if result.rows:
        keys = list(next(iter(result.rows.values())).keys())
        print(f"{'role':10} " + " ".join(f"{k:>22}" for k in keys))
        for role, row in result.rows.items():
            print(f"{role:10} " + " ".join(f"{row[k]:22.3f}" for k in keys))
    print(
        "suffix pass peak memory by N:", {k: round(v["peak_gib"], 2) for k, v in result.suffix_memory.items()}
    )
    print(f"log-prob agreement rollplex vs naive ({result.config['dtype']}):", result.logprob_agreement)
    for key, row in result.vision_attention.items():
        print(
            f"prefix pass {key:28} {row['seconds']:8.3f} s  peak {row['peak_gib']:6.2f} GiB  x{row['speedup']:.2f}"
        )
