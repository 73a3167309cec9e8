"""``rollplex bench decode``: the decode step against its memory roofline, per decode variant.

Roofline of one decode step: the bytes it must read — every decoder and LM-head weight once (the
embedding lookup reads B rows only), each group's boundary KV once, each row's own keys/values so far —
divided by the device's measured copy bandwidth (a large device-to-device copy, bytes read + written).
The ratio reported is (measured seconds per step) / (roofline seconds per step), averaged over the
rollout's own-key lengths 1..R.

Variants (same prompts, same prefix): ``eager`` (the step's kernels launched one by one, only the first
``eager_tokens`` tokens), ``graphs`` (CUDA-graph replay), ``graphs+compile`` (torch.compile, then
capture), both again with the fused Triton decode attention (``+triton``, rollout.decode_kernel), then
with fused q/k/v and gate/up products (``+fused``), the fused sampling race (``+sampling``,
rollout.sample_kernel) and the gate/up product with its SiLU gate as one kernel (``+gate``,
rollout.linear_kernel): the CUDA default, last of the default run; ``+autotune`` (on request only) is
``+sampling`` under torch.compile's max-autotune mode (``rollout.compile_mode``);
``+gate+window128`` and ``+gate+window512`` (on request only) are the default with its graphs'
own-key window set (``rollout.graph_window``; the default, 0, is one 512-key chunk with the fused
attention). Decode time comes from the rollout's own timeline, which starts after capture/compilation;
each row's ``setup_s`` is the time before it (``RolloutBatch.setup_s``: building the step, warming it up
and capturing its graphs; a process's first compiled variant also compiles there).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from rollplex.bench.common import (
    PromptShape,
    Workload,
    bench_device,
    synthetic_prompt,
    workload_model,
)
from rollplex.bench.variants import DECODE_VARIANTS, DEFAULT_VARIANTS
from rollplex.models.forward import prefix_forward
from rollplex.models.presets import vision_special_ids
from rollplex.rollout.decode import BackendUnavailable, DecodeRecord, StaticDecoder
from rollplex.rollout.engine import SamplingParams, generate

VARIANTS = DECODE_VARIANTS


@dataclass(frozen=True)
class DecodeBenchConfig(Workload):
    """Workload of ``rollplex bench decode`` (defaults: the 3B workload of benchmarks/README.md)."""

    variants: tuple[str, ...] = DEFAULT_VARIANTS
    eager_tokens: int = 48
    profile_steps: int = 0
    temperature: float = 1.0  # rollout.temperature
    top_p: float = 1.0  # rollout.top_p
    top_k: int = 0  # rollout.top_k


@dataclass
class DecodeBenchResult:
    config: dict
    copy_bandwidth_gbps: float = float("nan")
    rows: dict = field(default_factory=dict)


def copy_bandwidth(device: torch.device, gib: float = 2.0, repeats: int = 10) -> float:
    """Measured device-to-device copy bandwidth in GB/s (bytes read + written), median of ``repeats``."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return 2 * src.numel() / times[len(times) // 2] / 1e9


def step_bytes(model, prompt_lens: list[int], group_size: int, tokens: int) -> float:
    """Mean bytes a decode step must read over own-key lengths 1..``tokens``: decoder + LM-head weights,
    boundary KV of every group, own keys/values of every row."""
    lm = model.model.language_model
    weights = sum(p.numel() * p.element_size() for p in lm.layers.parameters())
    weights += sum(p.numel() * p.element_size() for p in lm.norm.parameters())
    weights += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    config = lm.config
    per_token = (
        2 * len(lm.layers) * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
    )
    per_token *= model.lm_head.weight.element_size()
    mean_own = (tokens + 1) / 2
    return weights + per_token * (sum(prompt_lens) + len(prompt_lens) * group_size * mean_own)


def decode_workload(cfg: Workload) -> tuple:
    """The decode benchmarks' inputs: (model with random weights and no gradients, the G synthetic
    prompts, their detached rollout prefix, the banned vision-token ids).

    Raises:
        ValueError: a preset other than ``tiny`` without a CUDA device.
    """
    device = bench_device(cfg.preset)
    dtype = getattr(torch, cfg.dtype)
    model = workload_model(cfg, device)
    model.requires_grad_(False)
    shape = PromptShape(cfg.text_tokens, cfg.grid)
    prompts = [synthetic_prompt(model, shape, seed=g, device=device, dtype=dtype) for g in range(cfg.groups)]
    banned = torch.tensor(vision_special_ids(model.config), device=device)
    prefix = prefix_forward(model, prompts, temperature=1.0, banned_ids=banned, attached=False)
    return model, prompts, prefix, banned


def run_decode_bench(cfg: DecodeBenchConfig, out: Path | None = None) -> DecodeBenchResult:
    """Decode the workload's responses under each variant and print the roofline table.

    Raises:
        ValueError: an unknown variant, a preset other than ``tiny`` without a CUDA device, or
            ``profile_steps`` without one (the profile times CUDA kernels).
    """
    unknown = set(cfg.variants) - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown decode variants {sorted(unknown)}; expected some of {list(VARIANTS)}")
    if cfg.profile_steps and not torch.cuda.is_available():
        raise ValueError("profile_steps (--profile-steps) profiles CUDA kernels: it needs a CUDA device")
    model, prompts, prefix, banned = decode_workload(cfg)
    device, shape = prefix.keys[0].device, PromptShape(cfg.text_tokens, cfg.grid)
    result = DecodeBenchResult(config=asdict(cfg), copy_bandwidth_gbps=copy_bandwidth(device))
    for name in cfg.variants:
        tokens = cfg.eager_tokens if name == "eager" else cfg.response_tokens
        params = _sampling(cfg, tokens, banned, name)
        try:
            batch = generate(
                model, prompts, prefix, group_size=cfg.group_size, params=params, tokenizer=_NoText()
            )
        except BackendUnavailable as why:  # not a failure: this machine cannot run the variant
            print(f"  {name}: skipped: {why}", flush=True)
            result.rows[name] = {"skipped": str(why)}
            continue
        except Exception as err:  # noqa: BLE001 - one failing variant must not hide the others
            print(f"  {name}: failed: {type(err).__name__}: {err}", flush=True)
            result.rows[name] = {"error": f"{type(err).__name__}: {err}"}
            continue
        timeline = batch.timeline
        per_step = (timeline.end - timeline.start) / max(1, timeline.steps)
        roofline = step_bytes(model, [shape.length] * cfg.groups, cfg.group_size, tokens) / (
            result.copy_bandwidth_gbps * 1e9
        )
        result.rows[name] = {
            "tokens": tokens,
            "ms_per_step": per_step * 1e3,
            "roofline_ms_per_step": roofline * 1e3,
            "roofline_ratio": per_step / roofline,
            "setup_s": batch.setup_s,
        }
        print(f"  {name}: {per_step * 1e3:.3f} ms/step, {per_step / roofline:.2f}x roofline", flush=True)
    if cfg.profile_steps:
        params = _sampling(cfg, cfg.response_tokens, banned, cfg.variants[-1])
        table = profile_steps(model, prefix, cfg.group_size, params, cfg.profile_steps)
        print(table)
        if out is not None:
            out.with_suffix(".profile.txt").write_text(table)
    _print(result)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(asdict(result), indent=2))
    return result


def _sampling(cfg: DecodeBenchConfig, tokens: int, banned: torch.Tensor, variant: str) -> SamplingParams:
    """Sampling settings of ``variant``: ``tokens`` per response, none of them an end of sequence."""
    return SamplingParams(
        cfg.temperature, cfg.top_p, cfg.top_k, tokens, (-1,), 0, banned, **VARIANTS[variant]
    )


def profile_steps(model, prefix, group_size: int, params: SamplingParams, steps: int) -> str:
    """torch.profiler table (top 30 by device time) of about ``steps`` decode steps as rollout runs
    them — whole rounds of ``eos_check_every`` graph replays, each step the forward, the sampling of
    the next token and its recording — taken from the middle of the budget (the mean own-key length)."""
    from torch.profiler import ProfilerActivity, profile

    rows, device = prefix.num_groups * group_size, prefix.last_logprobs.device
    record = DecodeRecord.empty(rows, params, device, prefix.last_logprobs.dtype)
    token = torch.zeros(rows, dtype=torch.long, device=device)
    decoder = StaticDecoder(model, prefix, group_size, params, record, token)
    decoder.capture()
    rounds = min(decoder.rounds_total, max(1, -(-steps // decoder.steps_per_round)))
    first = (decoder.rounds_total - rounds) // 2
    for _ in range(first):
        decoder.advance()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            decoder.advance()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)
    profiled = rounds * decoder.steps_per_round
    return f"{profiled} decode steps from step {first * decoder.steps_per_round} ({rounds} rounds)\n{table}"


class _NoText:
    def decode(self, ids, skip_special_tokens=True) -> str:
        return ""


def _print(result: DecodeBenchResult) -> None:
    print(f"copy bandwidth {result.copy_bandwidth_gbps:.0f} GB/s, config {result.config}")
    print(f"{'variant':16} {'ms/step':>10} {'roofline ms':>12} {'ratio':>8} {'setup s':>8}")
    for name, row in result.rows.items():
        if "error" in row or "skipped" in row:
            print(f"{name:16} {row['error'] if 'error' in row else 'skipped: ' + row['skipped']}")
            continue
        print(
            f"{name:16} {row['ms_per_step']:10.3f} {row['roofline_ms_per_step']:12.3f} "
            f"{row['roofline_ratio']:8.2f} {row['setup_s']:8.3f}"
        )
