"""The decode variants of ``rollplex bench decode``: ``SamplingParams`` options per name (eager; CUDA
graphs; then torch.compile and the fused attention, alone and together; then fused projections, the
fused sampling race and the gated gate/up kernel on top; then torch.compile's max-autotune mode, run
only on request). Plain data, so the command line can list them without importing torch."""

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
