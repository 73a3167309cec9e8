"""Plain data of the benchmarks, so the command line can list it without importing torch: the rows of
``rollplex bench schedule`` (config overrides per row, the row each is compared with, the environment
a row runs in; described in rollplex.bench.schedule), and the decode variants of ``rollplex bench
decode``, ``SamplingParams`` options per name (eager; CUDA graphs; then torch.compile and the fused
attention, alone and together; then fused projections, the fused sampling race and the gated gate/up
kernel on top; then torch.compile's max-autotune mode, run only on request)."""

DECODE_VARIANTS = {
    "eager": {"cuda_graphs": False, "attention": "dense"},
    "graphs": {"cuda_graphs": True, "attention": "dense"},
    "graphs+compile": {"cuda_graphs": True, "compile": True, "attention": "dense"},
    "graphs+triton": {"cuda_graphs": True, "attention": "triton"},
    "graphs+compile+triton": {"cuda_graphs": True, "compile": True, "attention": "triton"},
    "graphs+compile+triton+fused": {
        "cuda_graphs": True,
        "compile": True,
        "attention": "triton",
        "fused_projections": True,
    },
    "graphs+compile+triton+fused+sampling": {
        "cuda_graphs": True,
        "compile": True,
        "attention": "triton",
        "fused_projections": True,
        "fused_sampling": True,
    },
    "graphs+compile+triton+fused+sampling+gate": {
        "cuda_graphs": True,
        "compile": True,
        "attention": "triton",
        "fused_projections": True,
        "fused_sampling": True,
        "fused_gate": True,
    },
    "graphs+compile+triton+fused+sampling+autotune": {
        "cuda_graphs": True,
        "compile": True,
        "compile_mode": "max-autotune",
        "attention": "triton",
        "fused_projections": True,
        "fused_sampling": True,
    },
}

# the default run of ``rollplex bench decode``: every variant but the opt-in max-autotune one (its
# compilation is slow, and measured slower), so the last, the profiled one, is the CUDA default
DEFAULT_VARIANTS = tuple(name for name in DECODE_VARIANTS if not name.endswith("+autotune"))

_BOTH = {"run.schedule": "rollplex", "run.overlap": True, "run.prefill_fusion": True}
_SUFFIX_ROWS = ("causal", "sdpa", "flex")  # the suffix attention backends with rows of their own
ROWS = {
    "serial": {"run.schedule": "serial"},
    "overlap": {"run.schedule": "rollplex", "run.overlap": True, "run.prefill_fusion": False},
    "fusion": {"run.schedule": "rollplex", "run.overlap": False, "run.prefill_fusion": True},
    "both": _BOTH,
    "auto": {"run.schedule": "auto"},
    "both-same-priority": {**_BOTH, "run.decode_priority": False},
    "both-chunked": {**_BOTH, "run.prefix_chunk_groups": 1},
    "both-carveout": {**_BOTH, "run.prefix_sm_carveout": "half"},
    "both-green": {**_BOTH, "run.prefix_sms": "half", "run.prefix_chunk_groups": 1},
    "serial-eager": {"run.schedule": "serial", "model.compile_layers": False},
    "both-eager": {**_BOTH, "model.compile_layers": False},
    "serial-parts": {"run.schedule": "serial", "model.compile_scope": "parts"},
    "both-parts": {**_BOTH, "model.compile_scope": "parts"},
    "serial-whole-batch": {"run.schedule": "serial", "algo.micro_batch_groups": 0},
    "both-whole-batch": {**_BOTH, "algo.micro_batch_groups": 0},
    "serial-again": {"run.schedule": "serial"},
    **{
        f"{row}-{name}": settings
        for name in _SUFFIX_ROWS
        for row, settings in (("serial", {"run.schedule": "serial"}), ("both", _BOTH))
    },
}
# environment variables set while a row runs (the suffix attention backend is read at each call)
ROW_ENV = {
    f"{row}-{name}": {"ROLLPLEX_SUFFIX_ATTENTION": name}
    for name in _SUFFIX_ROWS
    for row in ("serial", "both")
}
# the row each row is compared with (speedup, saving, parameter difference): the serial row that
# splits its mini-batch into the same micro-batches, so its gradient sums in the same order
BASELINES = {name: "serial-whole-batch" if name.endswith("-whole-batch") else "serial" for name in ROWS}
MAIN_ROWS = ("serial", "overlap", "fusion", "both", "auto")
