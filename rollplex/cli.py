"""``rollplex`` command line: ``train``, ``data synth``, ``model init``, ``report``, ``bench``, ``plan``.

Each handler imports what it runs inside its body, so ``rollplex --help`` loads no torch and a missing
or broken component fails only its own command. User errors (``ValueError`` and its subclasses such as
``ConfigError`` and ``DatasetError``) print one line ``rollplex: error: <message>`` on stderr and exit
with status 2, without a traceback.

``train`` and ``bench`` run SPMD under torchrun as well (``torchrun --nproc-per-node 8 -m rollplex train
run.yaml``; docs/parallelism.md): their handler is wrapped in torch.distributed.elastic's
``errors.record``, so torchrun's summary names the first failed rank with its traceback, and an error
line names the rank that printed it.

Examples:
    rollplex train                                   # the embedded default run
    rollplex train run.yaml rollout.group_size=4 --resume
    rollplex train --help-config
    rollplex data synth --out data/synth --num 200 --seed 0 --families color,count
    rollplex model init --preset tiny --out models/tiny
    rollplex report runs/rollplex
    rollplex bench prefix --out results/prefix.json
    rollplex bench schedule --out results/schedule.json
    rollplex bench decode --out results/decode.json
    rollplex bench profile --out results/profile.json
    rollplex plan configs/paper-32b.yaml --json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from rollplex import __version__

PRESETS = ("tiny", "qwen2.5-vl-3b", "qwen2.5-vl-7b", "qwen2.5-vl-32b")


def split_train_args(items: Sequence[str]) -> tuple[str | None, list[str]]:
    """``[CONFIG] key=value ...`` → (config path or None, overrides).

    The first item is the config file when it has no ``=``. Raises ``ValueError`` for any later item
    without ``=``; where the item before it has no ``=`` either (``run.steps 5``), the message suggests
    joining the two.
    """
    items = list(items)
    config = items.pop(0) if items and "=" not in items[0] else None
    for before, item in zip([config, *items], items):
        if "=" not in item:
            hint = f" ({before}={item} without spaces?)" if before is not None and "=" not in before else ""
            raise ValueError(
                f"expected section.field=value after the config file {config!r}, got {item!r}{hint}"
            )
    return config, items


def _train(args: argparse.Namespace) -> None:
    from rollplex.config import format_config_help, load_config

    if args.help_config:
        from rollplex.default_job import default_run_config

        print(format_config_help(default_run_config(prepare=False)))
        return
    config, overrides = split_train_args(args.items)
    base = None
    if config is None:
        from rollplex.default_job import default_run_config

        # the overrides checked against the default job first: a bad one fails before the cache's
        # check imports torch and the rest
        load_config(None, overrides, default_run_config(prepare=False))
        base = default_run_config()
    cfg = load_config(config, overrides, base)
    from rollplex.loop import train  # it checks the run's paths and reward functions first

    train(cfg, resume=args.resume, overwrite=args.overwrite)


def _families(text: str) -> tuple[str, ...]:
    families = tuple(name.strip() for name in text.split(",") if name.strip())
    if not families:
        raise argparse.ArgumentTypeError("expected a comma-separated list of family names")
    return families


def _data_synth(args: argparse.Namespace) -> None:
    from rollplex.data.synth import generate_dataset

    names = {"width": "width", "height": "height", "frames": "num_frames", "fps": "fps"}
    names.update({"val_fraction": "val_fraction", "families": "families"})
    options = {kwarg: getattr(args, flag) for flag, kwarg in names.items() if getattr(args, flag) is not None}
    summary = generate_dataset(args.out, args.num, args.seed, **options, progress=True)
    for split in ("train", "val"):
        counts = getattr(summary, f"{split}_counts")
        print(f"{split}: {getattr(summary, f'{split}_json')} ({sum(counts.values())} records)")


def _model_init(args: argparse.Namespace) -> None:
    import torch

    from rollplex.models.presets import init_checkpoint

    options = {"dtype": getattr(torch, args.dtype)} if args.dtype is not None else {}
    init_checkpoint(args.preset, args.out, seed=args.seed, **options)
    print(f"wrote {args.preset} checkpoint to {args.out}")


def _report(args: argparse.Namespace) -> None:
    from rollplex.observe.report import bench_report, make_report

    if args.run_dir.is_file():
        print(bench_report(args.run_dir))
        return
    for path in make_report(args.run_dir):
        print(path)


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum`` (anything else is a usage error)."""

    def integer(text: str) -> int:
        value = int(text)  # not an integer: argparse reports "invalid integer value"
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return integer


def _integers(text: str, expected: str) -> tuple[int, ...]:
    """Comma-separated integers; anything else is an argparse usage error saying ``expected``."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None


def _grid(text: str) -> tuple[int, int, int]:
    """An argparse type: a video patch grid t,h,w, each at least 1, h and w even (2×2 patches merge)."""
    parts = _integers(text, "t,h,w integers (patch grid of the video)")
    if len(parts) != 3 or min(parts) < 1 or parts[1] % 2 or parts[2] % 2:
        raise argparse.ArgumentTypeError(
            f"expected t,h,w (patch grid of the video), each at least 1, h and w even, got {text!r}"
        )
    return parts


def _counts(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated integers, each at least 1."""
    values = _integers(text, "comma-separated integers")
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"each value must be at least 1, got {text!r}")
    return values


WORKLOAD_FIELDS = (
    "preset",
    "groups",
    "group_size",
    "response_tokens",
    "text_tokens",
    "grid",
    "dtype",
    "vision_attention",
    "vision_mlp_padding",
    "compile_layers",
    "compile_scope",
)


def _options(args: argparse.Namespace, names: tuple[str, ...]) -> dict:
    """The named command-line options that were given (None = keep the benchmark's default)."""
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _bench_prefix(args: argparse.Namespace) -> None:
    from rollplex.bench.common import config_settings
    from rollplex.bench.prefix import PrefixBenchConfig, run_prefix_bench
    from rollplex.bench.variants import PREFIX_CONFIG_FIELDS

    options = _options(args, (*WORKLOAD_FIELDS, "repeats"))
    options.update(config_settings(args.overrides, PREFIX_CONFIG_FIELDS, "prefix"))
    if args.suffix_group_sizes is not None:
        options["suffix_group_sizes"] = args.suffix_group_sizes
    if args.parts is not None:
        options["parts"] = tuple(part.strip() for part in args.parts.split(","))
    run_prefix_bench(PrefixBenchConfig(**options), args.out)


def _bench_schedule(args: argparse.Namespace) -> int:
    from rollplex.bench.schedule import ScheduleBenchConfig, run_schedule_bench

    extra = (
        "warmup",
        "steps",
        "auto_trials",
        "decode_attention",
        "compile_decode",
        "compile_mode",
        "fused_projections",
        "fused_sampling",
        "fused_gate",
        "deterministic",
        "compare",
    )
    options = _options(args, (*WORKLOAD_FIELDS, *extra))
    options["overrides"] = tuple(args.overrides)
    if args.rows is not None:
        options["rows"] = tuple(row.strip() for row in args.rows.split(","))
    return _failed_rows(run_schedule_bench(ScheduleBenchConfig(**options), args.out).rows)


def _bench_decode(args: argparse.Namespace) -> int:
    from rollplex.bench.common import config_settings
    from rollplex.bench.decode import DecodeBenchConfig, run_decode_bench
    from rollplex.bench.variants import DECODE_CONFIG_FIELDS

    options = _options(args, WORKLOAD_FIELDS)
    options.update(config_settings(args.overrides, DECODE_CONFIG_FIELDS, "decode"))
    if args.variants is not None:
        options["variants"] = tuple(v.strip() for v in args.variants.split(","))
    if args.profile_steps:
        options["profile_steps"] = args.profile_steps
    return _failed_rows(run_decode_bench(DecodeBenchConfig(**options), args.out).rows)


def _bench_profile(args: argparse.Namespace) -> None:
    from rollplex.bench.profile import ProfileBenchConfig, run_profile_bench

    options = _options(args, (*WORKLOAD_FIELDS, "row", "warmup"))
    run_profile_bench(ProfileBenchConfig(**options, overrides=tuple(args.overrides)), args.out)


def _failed_rows(rows: dict) -> int:
    """A benchmark's exit status: 1 where rows failed (one line on stderr names them; their errors were
    printed as they failed), 0 otherwise. A row skipped for a reason it names is not a failure."""
    failed = [name for name, row in rows.items() if "error" in row]
    if not failed:
        return 0
    print(f"rollplex: error: {len(failed)} of {len(rows)} rows failed: {', '.join(failed)}", file=sys.stderr)
    return 1


def _add_workload_arguments(
    p: argparse.ArgumentParser, overrides: str, group_size: int = 1, response_tokens: int = 1
) -> None:
    """The workload options every benchmark shares, and its config overrides (``overrides`` says what
    they set); ``group_size`` and ``response_tokens`` are the smallest N and R the benchmark runs with
    (GRPO needs two responses per group; decode, two tokens)."""
    from rollplex.config import COMPILE_SCOPES, VISION_ATTENTION

    p.add_argument("--preset", choices=PRESETS, help="model size (default qwen2.5-vl-3b)")
    p.add_argument("--groups", type=_at_least(1), help="prompt groups G (default 8)")
    p.add_argument("--group-size", type=_at_least(group_size), help="responses per group N (default 8)")
    p.add_argument(
        "--response-tokens", type=_at_least(response_tokens), help="response length R (default 512)"
    )
    # a synthetic prompt puts a third of its text before the video, less its opening token
    p.add_argument("--text-tokens", type=_at_least(3), help="text tokens per prompt (default 400)")
    p.add_argument("--grid", type=_grid, help="video patch grid t,h,w (default 16,20,44: 3,520 tokens)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), help="model dtype (default bfloat16)")
    p.add_argument(
        "--vision-attention",
        choices=VISION_ATTENTION,
        help="vision tower attention (default batched; model.vision_attention)",
    )
    p.add_argument(
        "--vision-mlp-padding",
        action=argparse.BooleanOptionalAction,
        help="vision MLP on zero-padded aligned weights (default on; model.vision_mlp_padding)",
    )
    p.add_argument(
        "--compile-layers",
        action=argparse.BooleanOptionalAction,
        help="decoder layers and vision blocks compiled for the prefix, suffix and training passes "
        "(default on, CUDA only; model.compile_layers)",
    )
    p.add_argument(
        "--compile-scope",
        choices=COMPILE_SCOPES,
        help="a whole layer per compiled function, or its norms, attention module and MLP apart "
        "(default layer; model.compile_scope)",
    )
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help=f"config fields, as rollplex train takes them (section.field=value): {overrides}",
    )


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from rollplex.bench.variants import (
        DECODE_CONFIG_FIELDS,
        DECODE_VARIANTS,
        MAIN_ROWS,
        PREFIX_CONFIG_FIELDS,
        ROWS,
        ROWS_HELP,
    )
    from rollplex.config import COMPILE_MODES, DECODE_ATTENTION

    bench = sub.add_parser(
        "bench", help="benchmarks, measured side by side (GPU workloads; --preset tiny on the CPU)"
    ).add_subparsers(dest="bench_command", required=True)
    p = bench.add_parser("prefix", help="prefix + suffix vs naive per-sequence scoring and training")
    _add_workload_arguments(p, ", ".join(PREFIX_CONFIG_FIELDS))
    p.add_argument("--repeats", type=_at_least(1), help="timed repeats after one warm-up (default 1)")
    p.add_argument(
        "--suffix-group-sizes", type=_counts, help="N values of the suffix-memory sweep (default 4,8,16)"
    )
    p.add_argument(
        "--parts",
        help="comma-separated subset of compare,suffix-memory,vision (default compare,suffix-memory)",
    )
    p.set_defaults(handler=_bench_prefix)
    p = bench.add_parser(
        "schedule",
        help="serial vs rollplex schedules on one training workload",
        epilog=ROWS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_workload_arguments(
        p,
        "applied to every row's config after the options; a row's own settings win; not the workload's "
        "shape, run, data or eval fields",
        group_size=2,
    )
    p.add_argument(
        "--warmup",
        type=_at_least(0),
        help="discarded warm-up iterations per schedule (default 2: a new rollplex run's calibration steps)",
    )
    p.add_argument("--steps", type=_at_least(1), help="timed iterations per schedule (default 2)")
    p.add_argument(
        "--rows",
        help=f"comma-separated rows, each explained below (default {','.join(MAIN_ROWS)})",
    )
    p.add_argument(
        "--compile-decode",
        action=argparse.BooleanOptionalAction,
        help="torch.compile the decode step (default on)",
    )
    p.add_argument(
        "--compile-mode",
        choices=COMPILE_MODES,
        help="torch.compile mode of the decode step (default default)",
    )
    p.add_argument(
        "--fused-projections",
        action=argparse.BooleanOptionalAction,
        help="decode: one q/k/v and one gate/up product per layer (default on)",
    )
    p.add_argument(
        "--fused-sampling",
        action=argparse.BooleanOptionalAction,
        help="decode: the sampling race as Triton kernels (default on)",
    )
    p.add_argument(
        "--fused-gate",
        action=argparse.BooleanOptionalAction,
        help="decode: the gate/up product with its SiLU gate as one Triton kernel (default on)",
    )
    p.add_argument(
        "--auto-trials", type=_at_least(1), help="auto row: trial steps per co-running policy (default 2)"
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        default=None,
        help="torch's deterministic algorithms for the whole run (run.deterministic), so that rows can be "
        "compared bitwise (slower steps: benchmarks/README.md)",
    )
    p.add_argument(
        "--compare",
        action=argparse.BooleanOptionalAction,
        help="compare each row's update with its baseline row's (default on; --no-compare keeps no host "
        "copies of weights and updates: times and memory only, for the largest models)",
    )
    p.add_argument(
        "--decode-attention",
        choices=DECODE_ATTENTION,
        help="decode attention backend (default auto: triton on CUDA)",
    )
    p.set_defaults(handler=_bench_schedule)
    p = bench.add_parser(
        "decode",
        help="the decode step against its memory roofline",
        description=(
            "Time the rollout's decode step, per variant, against its memory roofline: the bytes one step\n"
            "must read (the weights once, the boundary KV once per group, each response's own keys and\n"
            "values) over the device's measured copy bandwidth. Every variant decodes the same prompts\n"
            "from the same prefix. Without a GPU, --preset tiny runs it on the CPU as a check (no roofline)."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_workload_arguments(p, ", ".join(DECODE_CONFIG_FIELDS), response_tokens=2)
    p.add_argument(
        "--variants",
        help=f"comma-separated subset of {', '.join(DECODE_VARIANTS)} (default all but the +autotune and +window ones)",
    )
    p.add_argument(
        "--profile-steps",
        type=_at_least(0),
        help="profile this many decode steps (graph replay + sampling) of the last variant (CUDA; kernel table)",
    )
    p.set_defaults(handler=_bench_decode)
    p = bench.add_parser(
        "profile", help="one GRPO step under torch.profiler: operators by device time, idle time by launcher"
    )
    _add_workload_arguments(
        p, "applied to the row's config after the options, as in bench schedule", group_size=2
    )
    p.add_argument(
        "--row", choices=ROWS, metavar="ROW", help="row of rollplex bench schedule (default serial)"
    )
    p.add_argument(
        "--warmup", type=_at_least(0), help="unprofiled steps before the profiled ones (default 2)"
    )
    p.set_defaults(handler=_bench_profile)


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="run GRPO training",
        description=(
            "Run GRPO training. With no config file it runs the embedded default job: a tiny Qwen2.5-VL\n"
            "trained from scratch on synthetic videos, whose model and data are written once into\n"
            "$ROLLPLEX_CACHE (default ~/.cache/rollplex); key=value overrides apply to it too. The run\n"
            "folder is run.out_dir (runs/default for the default job)."
        ),
        epilog=(
            "examples:\n"
            "  rollplex train                       the default job\n"
            "  rollplex train run.steps=50          the default job, 50 steps\n"
            "  rollplex train configs/qwen2.5-vl-3b-video.yaml model.path=...\n"
            "                                       a config file, one field overridden\n"
            "  rollplex train --resume              continue the run in run.out_dir"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "items",
        nargs="*",
        metavar="ITEM",
        help="an optional config file (CONFIG.yaml) first, then key=value overrides",
    )
    start = p.add_mutually_exclusive_group()
    start.add_argument(
        "--resume", action="store_true", help="continue from the run folder's latest checkpoint"
    )
    start.add_argument(
        "--overwrite", action="store_true", help="start over in a run folder that already holds a run"
    )
    p.add_argument(
        "--help-config",
        action="store_true",
        help="list every config field (and where the embedded default job differs) and exit",
    )
    p.set_defaults(handler=_train)


def _add_data(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("data", help="dataset tools").add_subparsers(dest="data_command", required=True)
    p = data.add_parser("synth", help="write a synthetic Video-R1 dataset with MP4 media")
    p.add_argument("--out", type=Path, required=True, help="output folder (the data root)")
    p.add_argument("--num", type=int, required=True, help="number of records")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--width", type=int, help="frame width in pixels (default 112)")
    p.add_argument("--height", type=int, help="frame height in pixels (default 112)")
    p.add_argument("--frames", type=int, help="frames per video (default 8)")
    p.add_argument("--fps", type=float, help="video frame rate, frames per second (default 4)")
    p.add_argument(
        "--val-fraction", type=float, help="fraction of records in the held-out split (default 0.2)"
    )
    p.add_argument(
        "--families",
        type=_families,
        help="comma-separated question families (default color,direction,count,collision)",
    )
    p.set_defaults(handler=_data_synth)


def _add_model(sub: argparse._SubParsersAction) -> None:
    model = sub.add_parser("model", help="checkpoint tools").add_subparsers(
        dest="model_command", required=True
    )
    p = model.add_parser("init", help="write a randomly initialised Qwen2.5-VL checkpoint")
    p.add_argument("--preset", choices=PRESETS, required=True, help="model size")
    p.add_argument("--out", type=Path, required=True, help="output checkpoint folder")
    p.add_argument("--seed", type=int, default=0, help="initialisation seed (default 0)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="weight dtype (default: the preset's)")
    p.set_defaults(handler=_model_init)


def _plan(args: argparse.Namespace) -> None:
    from rollplex.config import load_config
    from rollplex.memory.plan_command import PlanInputs, plan_text

    config, overrides = split_train_args(args.items)
    if config is None:
        raise ValueError("rollplex plan needs a config file first (CONFIG.yaml), then key=value overrides")
    names = ("prompt_tokens", "vision_tokens", "device_gib")
    inputs = PlanInputs(**_options(args, names), copied_weights=args.copied_weights)
    print(plan_text(load_config(config, overrides), inputs, as_json=args.json))


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="print what state lives where in each phase, in GiB per GPU, without running anything",
        description=(
            "Print the memory plan of a run config from shapes alone: every class of state per phase,\n"
            "where it lives (device or pinned host pool), the naive all-resident total, the planned peak\n"
            "against memory.device_budget_gib, and the moves that make it fit (or what to change)."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "items", nargs="+", metavar="ITEM", help="a config file (CONFIG.yaml), then key=value overrides"
    )
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.add_argument(
        "--prompt-tokens", type=_at_least(1), help="prompt length P (default data.max_prompt_tokens)"
    )
    p.add_argument(
        "--vision-tokens",
        type=_at_least(0),
        help="vision tokens per prompt (default: the largest video data.video_max_frames and "
        "data.video_max_pixels allow, at most P)",
    )
    p.add_argument(
        "--device-gib",
        type=float,
        help="device capacity, GiB, for memory.device_budget_gib=0 (default: CUDA device 0's)",
    )
    p.add_argument(
        "--copied-weights",
        action="store_true",
        help="rollout keeps its own copy of the actor weights (default: one shared physical copy)",
    )
    p.set_defaults(handler=_plan)


def _add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="plot a run's metrics to PNGs in RUN_DIR/report/, or a bench schedule JSON to a PNG beside it",
    )
    p.add_argument(
        "run_dir",
        type=Path,
        metavar="RUN_DIR|BENCH.json",
        help="run folder holding metrics.jsonl, or a rollplex bench schedule JSON file",
    )
    p.set_defaults(handler=_report)


def build_parser() -> argparse.ArgumentParser:
    """The ``rollplex`` argument parser with its six commands."""
    parser = argparse.ArgumentParser(
        prog="rollplex", description="Synchronous on-policy GRPO post-training of Qwen2.5-VL models."
    )
    parser.add_argument("--version", action="version", version=f"rollplex {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_train, _add_data, _add_model, _add_report, _add_bench, _add_plan):
        add(sub)
    _name_choices(sub)
    return parser


def _name_choices(sub: argparse._SubParsersAction) -> None:
    """Show ``sub``'s commands, ``{a,b}``, in usage lines and in the missing-command error (argparse names
    a missing subcommand by its metavar, or else by its internal ``dest``); then those of the parsers
    under it."""
    sub.metavar = "{" + ",".join(sub.choices) + "}"
    for parser in sub.choices.values():
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                _name_choices(action)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the command; returns the exit status.

    Usage errors exit through argparse (status 2); a ``ValueError`` raised by the command prints
    ``rollplex: error: <message>`` (joined into one line) on stderr and returns 2; a benchmark with
    failed rows returns 1 (``_failed_rows``), and so does output piped into a reader that closed early
    (``rollplex train --help-config | head``), silently.
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    listed = {"train": "items", "plan": "items", "bench": "overrides"}.get(args.command)
    if extra and listed is not None and all("=" in item for item in extra):
        # key=value overrides may follow options (--resume, --json, --out ...)
        setattr(args, listed, [*getattr(args, listed), *extra])
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        _check_torchrun(args)
        status = _handler(args)(args)
        sys.stdout.flush()  # a reader that went away shows here, not in the interpreter's exit
    except ValueError as exc:
        message = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        print(f"rollplex: error: {_rank_prefix()}{message}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into a reader that stopped early (`| head`): no traceback
        fd = _broken_stdout()
        if fd is None:
            raise  # another pipe broke: a real error
        if sys.stdout is sys.__stdout__:  # the process's own stream, not a replacement
            _drop_output(fd)
        return 1
    return status or 0


def _handler(args: argparse.Namespace) -> Callable:
    """The command's handler; under torchrun (its agent sets ``TORCHELASTIC_RUN_ID``) ``train`` and
    ``bench`` wrapped in torch.distributed.elastic's ``errors.record``, which writes a failure's
    traceback where the agent reads it and re-raises."""
    import os

    if args.command not in ("train", "bench") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return args.handler
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(args.handler)


def _check_torchrun(args: argparse.Namespace) -> None:
    """Under torchrun only ``train`` and ``bench schedule`` split their work over the processes.

    Raises:
        ValueError: another command started by torchrun with several processes.
    """
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and args.command in (
        "bench",
        "plan",
        "report",
        "data",
        "model",
    ):
        sub = getattr(args, "bench_command", None)
        if sub != "schedule":
            name = f"{args.command} {sub}" if sub else args.command
            raise ValueError(
                f"rollplex {name} runs in one process; under torchrun run train or bench schedule"
            )


def _rank_prefix() -> str:
    """``"rank R: "`` in a process of a torchrun job of several processes, else ``""``."""
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return f"rank {os.environ.get('RANK', '?')}: "
    return ""


def _broken_stdout() -> int | None:
    """Standard output's file descriptor where it is a pipe whose reader has gone away (``poll``
    reports an error on its write end); None otherwise, or where that cannot be told (no file
    descriptor, no ``select.poll``)."""
    import select

    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
    except (AttributeError, OSError, ValueError):
        return None
    poller.register(fd, select.POLLOUT)
    return fd if any(events & select.POLLERR for _, events in poller.poll(0)) else None


def _drop_output(fd: int) -> None:
    """Point file descriptor ``fd`` at the null device, so the interpreter's final flush of what is
    still buffered for the closed pipe raises nothing (the Python documentation's recipe for SIGPIPE)."""
    import os

    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    os.close(null)
