"""Shared pieces of ``rollplex bench``: a random-weight model on the device, synthetic prompts, timing.

Benchmarks run on random weights (so every response runs the full budget) and synthetic vision
tensors of the exact shapes real videos produce; numbers are measured side by side in one process.
"""

from __future__ import annotations

import argparse
import statistics
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from rollplex.config import ConfigError, load_config
from rollplex.models.compiled import compiles_layers
from rollplex.models.forward import prepare_model
from rollplex.models.positions import VisionTokens, rope_positions
from rollplex.types import Prompt, Record

_RECORD = Record(
    0, "synthetic", "video", "multiple choice", ("A. a", "B. b"), "<answer>A</answer>", "./x.mp4", ""
)


@dataclass(frozen=True)
class Workload:
    """The benchmark workload (defaults: the 3B workload of benchmarks/README.md): G prompt groups of one
    video prompt each (``text_tokens`` + the video's t·h·w/4 tokens), N responses of R tokens."""

    preset: str = "qwen2.5-vl-3b"
    groups: int = 8
    group_size: int = 8
    response_tokens: int = 512
    text_tokens: int = 400
    grid: tuple[int, int, int] = (16, 20, 44)  # 32 frames of 280×616 px: 3,520 video tokens
    dtype: str = "bfloat16"
    vision_attention: str = "batched"  # model.vision_attention
    vision_mlp_padding: bool = True  # model.vision_mlp_padding
    compile_layers: bool = True  # model.compile_layers (CUDA only)
    compile_scope: str = "layer"  # model.compile_scope


def config_settings(overrides: Sequence[str], fields: dict[str, str], command: str) -> dict:
    """The benchmark settings that config overrides set: each ``section.field=value`` (checked as
    ``rollplex train`` checks it, ``config.load_config``) must be a key of ``fields``, which names the
    setting it sets. Returns ``{setting: value}``.

    Raises:
        ConfigError (ValueError): a bad override, or a key that sets nothing in ``rollplex bench
            {command}``, named with the keys that do.
    """
    cfg = load_config(None, overrides)
    settings = {}
    for item in overrides:
        key = item.partition("=")[0].strip()
        if key not in fields:
            raise ConfigError(
                f"rollplex bench {command}: {key} sets nothing here; the config fields it takes: "
                f"{', '.join(fields)}"
            )
        section, name = key.split(".")
        settings[fields[key]] = getattr(getattr(cfg, section), name)
    return settings


def bench_device(preset: str) -> torch.device:
    """CUDA when present; the CPU only for the tiny preset (smoke runs).

    Raises:
        ValueError: a preset other than ``tiny`` and no CUDA device.
    """
    if torch.cuda.is_available():
        return torch.device("cuda")
    if preset != "tiny":
        raise ValueError(
            f"rollplex bench measures GPU work and found no CUDA device; the {preset} workload would take "
            "hours on a CPU (use --preset tiny with small sizes for a CPU smoke run)"
        )
    return torch.device("cpu")


def random_model(
    preset: str,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
    vision_attention: str = "batched",
    vision_mlp_padding: bool = True,
    compile_layers: bool = False,
    compile_scope: str = "layer",
):
    """Preset ``preset`` with random weights built directly on ``device``, routed through rollplex
    attention (``prepare_model``; ``compile_layers`` applies on CUDA only), in inference mode (dropout
    off)."""
    from rollplex.models.presets import init_model

    model = init_model(preset, seed=seed, dtype=dtype, device=device)
    prepare_model(
        model, vision_attention, vision_mlp_padding, compiles_layers(compile_layers, device), compile_scope
    )
    model.train(False)
    return model


def workload_model(cfg: Workload, device: torch.device):
    """``random_model`` of the workload's preset, dtype and vision settings."""
    return random_model(
        cfg.preset,
        device,
        getattr(torch, cfg.dtype),
        vision_attention=cfg.vision_attention,
        vision_mlp_padding=cfg.vision_mlp_padding,
        compile_layers=cfg.compile_layers,
        compile_scope=cfg.compile_scope,
    )


@dataclass(frozen=True)
class PromptShape:
    """A video prompt: ``text_tokens`` of text around one video of ``grid`` (t, h, w) patches."""

    text_tokens: int
    grid: tuple[int, int, int]
    second_per_grid: float = 1.0

    @property
    def length(self) -> int:
        t, h, w = self.grid
        return self.text_tokens + t * h * w // 4


def synthetic_prompt(model, shape: PromptShape, seed: int, device, dtype) -> Prompt:
    """Random text ids (outside the special range) + a video span of random pixel rows."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    t, h, w = shape.grid
    before = shape.text_tokens // 3
    text = torch.randint(*text_id_range(model), (shape.text_tokens,), generator=g)
    video = torch.full((t * h * w // 4,), cfg.video_token_id)
    start, end = torch.tensor([cfg.vision_start_token_id]), torch.tensor([cfg.vision_end_token_id])
    ids = torch.cat([text[: before - 1], start, video, end, text[before + 1 :]])
    grid = torch.tensor([[t, h, w]])
    spg = torch.tensor([shape.second_per_grid], dtype=torch.float64)
    positions, nxt = rope_positions(
        ids, VisionTokens.from_config(cfg), video_grid_thw=grid, second_per_grid_ts=spg
    )
    pixels = torch.randn(t * h * w, 1176, generator=g).to(device, dtype)
    return Prompt(
        record=_RECORD,
        input_ids=ids,  # ids and grid on the host, as the data loader's prompts have them; positions
        # and pixels on the device (bench prefix's naive path adds device positions to them)
        position_ids=positions.to(device),
        next_position=nxt,
        content_key=f"synthetic-{seed}",
        pixel_values_videos=pixels,
        video_grid_thw=grid,
        second_per_grid_ts=spg,
    )


def text_id_range(model) -> tuple[int, int]:
    """[low, high) of ordinary token ids used for random text and responses (below every special id)."""
    high = min(5000, model.config.vision_start_token_id - 32)
    return min(100, high // 2), high


def timed(fn: Callable[[], object], repeats: int, device: torch.device) -> tuple[list[float], object]:
    """Run ``fn`` ``repeats`` times; wall seconds of each (device synchronised) and the last result."""
    times, out = [], None
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times, out


def replay_us(
    calls: Callable[[], object], per_replay: int, replays: int = 20, repeats: int = 3
) -> list[float]:
    """Microseconds per call of the kernels that ``calls()`` queues on the current CUDA device
    (``per_replay`` calls in all): captured once in a CUDA graph, replayed once to warm up, then timed
    ``repeats`` times over ``replays`` replays each (CUDA events). Compile the kernels before: capture
    records launches, it does not build them. Returns one figure per repeat.

    Raises:
        RuntimeError: no CUDA device, or ``calls`` does something a capture forbids.
    """
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (replays * per_replay))
    return times


def peak_gib(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    """Peak device memory above the level at entry (GiB) while ``fn`` runs, and its result."""
    if device.type != "cuda":
        return float("nan"), fn()
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = fn()
    _sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**30, out


def one_of(choices: tuple[str, ...]) -> Callable[[str], str]:
    """An argparse ``type`` accepting only ``choices`` (unlike ``choices=``, it also works for ``nargs="*"``
    with no value given); a value outside them is a usage error (exit status 2)."""

    def check(value: str) -> str:
        if value not in choices:
            raise argparse.ArgumentTypeError(f"{value!r} is not one of {', '.join(choices)}")
        return value

    return check


def int_between(low: int, high: int) -> Callable[[str], int]:
    """An argparse ``type`` accepting an integer from ``low`` to ``high`` (a usage error otherwise)."""

    def check(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
        if not low <= number <= high:
            raise argparse.ArgumentTypeError(f"{number} is not in {low}..{high}")
        return number

    return check


def comma_list_of(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    """An argparse ``type`` for a comma-separated list of ``choices`` (a usage error names the first
    other item, as ``one_of`` does)."""

    def check(value: str) -> list[str]:
        items = value.split(",")
        for item in items:
            one_of(choices)(item)
        return items

    return check


def cuda_script_args(
    doc: str, add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
) -> argparse.Namespace:
    """The command line of a script under benchmarks/scripts/ that needs a GPU: ``--help`` prints ``doc``
    (the script's docstring) and whatever ``add_arguments`` adds to the parser; returns the parsed
    ``argparse.Namespace``.

    Raises:
        SystemExit: status 0 after ``--help``; status 2, with a one-line error, on a bad argument or
            where no CUDA device is visible (before the script touches the GPU).
    """
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device, and none is visible")
    return args


def cuda_script_out_prefix(doc: str, writes: str) -> str:
    """``cuda_script_args`` for a script whose one argument is OUT_PREFIX, the start of the paths it
    writes (``writes`` says which, in ``--help``); returns it."""
    return cuda_script_args(
        doc, lambda p: p.add_argument("out_prefix", metavar="OUT_PREFIX", help=f"write {writes}")
    ).out_prefix


def cprofile_report(run: Callable[[], object], path: str, own_rows: int, cumulative_rows: int) -> str:
    """Run ``run`` under cProfile; write its functions by own time (``own_rows`` of them), then by
    cumulative time (``cumulative_rows``), to ``path``, and return that text."""
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    try:
        run()
    finally:
        profile.disable()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(own_rows)
    stats.sort_stats("cumulative").print_stats(cumulative_rows)
    with open(path, "w") as f:
        f.write(text.getvalue())
    return text.getvalue()


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def distinct_reward(completion: str, record) -> float:
    """A reward for benchmarks and tests, in [0, 1): a CRC-32 of the completion, so two different
    completions score differently with near certainty. A group then has nonzero advantages and the
    updates compared are not zero, where on random weights an accuracy reward scores every response 0,
    the actor equals the reference, and the step's gradient is exactly zero in every schedule.

    Args:
        completion: the response text. record: the sample (unused).

    Returns:
        float in [0, 1) (multiples of 0.001).
    """
    return (zlib.crc32(completion.encode()) % 1000) / 1000
