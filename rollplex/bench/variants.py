"""Plain data of the benchmarks, so the command line can list it without importing torch: the rows of
``rollplex bench schedule`` (config overrides per row and the row each is compared with; described in
rollplex.bench.schedule), the config fields ``rollplex bench prefix`` and ``decode`` take as
``key=value`` (each the benchmark setting it sets), and the decode variants of ``rollplex bench
decode``, ``SamplingParams`` options per name (eager; CUDA graphs; then torch.compile and the fused
attention, alone and together; then fused projections, the fused sampling race and the gated gate/up
kernel on top; then, run only on request, the last with its graphs' own-key window set to 128 or 512
tokens, and torch.compile's max-autotune mode)."""

_FUSED = {"cuda_graphs": True, "compile": True, "attention": "triton", "fused_projections": True}
_SAMPLING = {**_FUSED, "fused_sampling": True}
_GATE = {**_SAMPLING, "fused_gate": True}  # the CUDA default
DECODE_VARIANTS = {
    "eager": {"cuda_graphs": False, "attention": "dense"},
    "graphs": {"cuda_graphs": True, "attention": "dense"},
    "graphs+compile": {"cuda_graphs": True, "compile": True, "attention": "dense"},
    "graphs+triton": {"cuda_graphs": True, "attention": "triton"},
    "graphs+compile+triton": {"cuda_graphs": True, "compile": True, "attention": "triton"},
    "graphs+compile+triton+fused": _FUSED,
    "graphs+compile+triton+fused+sampling": _SAMPLING,
    "graphs+compile+triton+fused+sampling+gate": _GATE,
    # the default variant with the own-key window of its graphs set (rollout.graph_window; 0 = one
    # 512-key chunk): the setup each window costs, measured side by side (run on request)
    "graphs+compile+triton+fused+sampling+gate+window128": {**_GATE, "graph_window": 128},
    "graphs+compile+triton+fused+sampling+gate+window512": {**_GATE, "graph_window": 512},
    "graphs+compile+triton+fused+sampling+autotune": {**_SAMPLING, "compile_mode": "max-autotune"},
}

# the default run of ``rollplex bench decode``: every variant but the opt-in ones (max-autotune: its
# compilation is slow, and it is not the default; the set windows), so the last, the profiled one, is the
# CUDA default
DEFAULT_VARIANTS = tuple(
    name for name in DECODE_VARIANTS if not name.endswith(("+autotune", "+window128", "+window512"))
)

_BOTH = {"schedule.kind": "rollplex", "schedule.overlap": True, "schedule.prefill_fusion": True}
# every class of state on the device for the whole step, nothing moved, the device's whole capacity
# (less the margin) as the budget, whatever budget the other rows are given
_RESIDENT = {
    "memory.device_budget_gib": 0,
    "memory.optimizer_offload": "off",
    "memory.reference_paging": "resident",
    "memory.offload_activations": "off",
}
_WHOLE_MODEL_MIB = 1 << 20  # an optimizer chunk larger than any model: one chunk, all of its state at once
_SUFFIX_ROWS = ("causal", "cascade", "sdpa", "flex")  # the suffix attention backends with rows of their own
ROWS_HELP = """\
Rows of rollplex bench schedule (each from the same initial weights and optimizer state, same prompts
and seeds; rows not named for a suffix attention backend use the default of the device and dtype, dense
on the CPU, so on the CPU the -causal, -cascade and -sdpa rows differ from serial on purpose, by
rounding; -cascade runs its plain-PyTorch parts there):

serial                the paper's Colocate baseline
overlap               rollplex: reference and actor prefixes on a worker stream during decode
fusion                rollplex without overlap, with prefill fusion (the actor prefix seeds decode)
both                  rollplex with overlap and prefill fusion (decode on a high-priority stream)
auto                  tries the co-running policies during its warm-up, keeps the first within 1%
                      of the fastest
both-same-priority    both, decode and prefixes at the same stream priority
both-chunked          both, prefix work issued one group at a time
both-carveout         both, half the SMs kept free of prefix matrix products
both-green            both, the reference prefix's kernels on a green context of half the SMs
                      (rounded up by the driver to its granularity) while decode runs, one
                      group per chunk (the chunks after decode get every SM)
serial-eager          serial, the layers' norms, attention modules and MLPs as transformers runs
                      them (model.compile_layers off; every other row runs them compiled unless
                      --no-compile-layers)
both-eager            both, likewise
serial-parts          serial, each layer's norms, attention module and MLP compiled apart
                      (model.compile_scope: parts; every other compiled row compiles whole layers)
both-parts            both, likewise
serial-whole-batch    serial, every group of the mini-batch in one actor micro-batch
                      (algo.micro_batch_groups: 0; every other row backpropagates one group at a time)
both-whole-batch      both, likewise (its speedup and parameter difference are against
                      serial-whole-batch, which accumulates its gradient the same way)
serial-torch-checkpoint  serial with torch's non-reentrant checkpoint in every layer
                      (model.layer_recompute off; every other row runs the prefix and vision layers'
                      forward without autograd under checkpointing)
both-torch-checkpoint both, likewise (compared with serial-torch-checkpoint)
serial-window128      serial, the decode step captured per 128-token own-key window
                      (rollout.graph_window: 128; every other row: one graph per 512-key own-key
                      chunk of the fused decode attention, the default; with the dense decode
                      attention, the CPU's, 128 is the default and the row equals serial)
both-window128        both, likewise
serial-again          serial once more: whether serial's own update is the same from run to run
                      (its parameter and optimizer differences are against serial's)
serial-resident       serial with every class of state resident on the device and nothing moved,
                      under the device's whole capacity (memory.device_budget_gib 0, optimizer
                      offload off, reference resident, no activation offload; every other row
                      keeps what its memory plan keeps, under the budget it is given)
both-resident         both, likewise
both-no-optimizer-offload   both with the FP32 masters and Adam moments kept on the device
                      (memory.optimizer_offload: off), the rest as planned under the budget
both-no-reference-paging    both with the reference resident (memory.reference_paging: resident)
both-no-activation-offload  both with the actor prefixes' saved tensors kept on the device
                      (memory.offload_activations: off)
both-unchunked-optimizer    both with the optimizer's state updated (and streamed) as one chunk
                      (memory.chunk_mib larger than the model)
serial-40gib          serial under a device budget of 40 GiB (memory.device_budget_gib: 40, enforced on
                      the caching allocator), as on a 40-48 GB card
both-40gib            both, likewise
serial-causal         serial, the suffix attention as one SDPA call per group with a bottom-right
                      causal mask over each response's [boundary ; own keys] (flash attention;
                      model.suffix_attention: causal; the CUDA default in bf16/fp16)
both-causal           both, likewise
serial-cascade        serial, the suffix attention as each response's queries against its group's
                      boundary without a mask (cuDNN) and against its own keys causally (flash),
                      merged by log-sum-exp (model.suffix_attention: cascade; CUDA in
                      bf16/fp16 for cuDNN's and flash attention's kernels)
both-cascade          both, likewise
serial-sdpa           serial, the suffix attention as one masked SDPA call per layer over the
                      group's [boundary ; all responses' keys] (model.suffix_attention: sdpa)
both-sdpa             both, likewise
serial-flex           serial, the suffix attention as flex_attention with a block mask, which skips
                      the blocks where a response would see another response's keys
                      (model.suffix_attention: flex; CUDA only)
both-flex             both, likewise
disaggregated         the paper's Disagg baseline (under torchrun only): half the GPUs only decode,
                      the other half train, serial schedule; the training half keeps
                      parallel.tp_train (at most half the GPUs) as dp × tp_train, the rollout half
                      decodes at parallel.tp_rollout; the new weights go to the rollout GPUs after
                      every update
"""
ROWS = {
    "serial": {"schedule.kind": "serial"},
    "overlap": {"schedule.kind": "rollplex", "schedule.overlap": True, "schedule.prefill_fusion": False},
    "fusion": {"schedule.kind": "rollplex", "schedule.overlap": False, "schedule.prefill_fusion": True},
    "both": _BOTH,
    "auto": {"schedule.kind": "auto"},
    "both-same-priority": {**_BOTH, "schedule.decode_priority": False},
    "both-chunked": {**_BOTH, "schedule.prefix_chunk_groups": 1},
    "both-carveout": {**_BOTH, "schedule.prefix_sm_carveout": "half"},
    "both-green": {**_BOTH, "schedule.prefix_sms": "half", "schedule.prefix_chunk_groups": 1},
    "serial-eager": {"schedule.kind": "serial", "model.compile_layers": False},
    "both-eager": {**_BOTH, "model.compile_layers": False},
    "serial-parts": {"schedule.kind": "serial", "model.compile_scope": "parts"},
    "both-parts": {**_BOTH, "model.compile_scope": "parts"},
    "serial-whole-batch": {"schedule.kind": "serial", "algo.micro_batch_groups": 0},
    "both-whole-batch": {**_BOTH, "algo.micro_batch_groups": 0},
    "serial-torch-checkpoint": {"schedule.kind": "serial", "model.layer_recompute": False},
    "both-torch-checkpoint": {**_BOTH, "model.layer_recompute": False},
    "serial-window128": {"schedule.kind": "serial", "rollout.graph_window": 128},
    "both-window128": {**_BOTH, "rollout.graph_window": 128},
    "serial-again": {"schedule.kind": "serial"},
    "serial-resident": {"schedule.kind": "serial", **_RESIDENT},
    "both-resident": {**_BOTH, **_RESIDENT},
    "both-no-optimizer-offload": {**_BOTH, "memory.optimizer_offload": "off"},
    "both-no-reference-paging": {**_BOTH, "memory.reference_paging": "resident"},
    "both-no-activation-offload": {**_BOTH, "memory.offload_activations": "off"},
    "both-unchunked-optimizer": {**_BOTH, "memory.chunk_mib": _WHOLE_MODEL_MIB},
    "serial-40gib": {"schedule.kind": "serial", "memory.device_budget_gib": 40},
    "both-40gib": {**_BOTH, "memory.device_budget_gib": 40},
    # parallel.rollout_gpus and the degrees follow the world size under torchrun (bench.parallel.resolve_row)
    "disaggregated": {
        "schedule.kind": "serial",
        "parallel.placement": "disaggregated",
        "parallel.rollout_gpus": 1,
    },
    **{
        f"{row}-{name}": {**settings, "model.suffix_attention": name}
        for name in _SUFFIX_ROWS
        for row, settings in (("serial", {"schedule.kind": "serial"}), ("both", _BOTH))
    },
}
# the row each row is compared with (speedup, saving, parameter difference): the serial row that
# splits its mini-batch into the same micro-batches and checkpoints the same way, so its gradient sums
# in the same order
_OWN_BASELINE = ("-whole-batch", "-torch-checkpoint")
BASELINES = {
    name: next((f"serial{end}" for end in _OWN_BASELINE if name.endswith(end)), "serial") for name in ROWS
}
MAIN_ROWS = ("serial", "overlap", "fusion", "both", "auto")
TORCHRUN_ROWS = ("disaggregated",)  # rows that need several processes (rollplex bench under torchrun)

# config fields that set a workload setting of every benchmark (``rollplex bench ... key=value``), each
# with the benchmark setting (bench.common.Workload field) it sets
WORKLOAD_CONFIG_FIELDS = {
    "model.vision_attention": "vision_attention",
    "model.vision_mlp_padding": "vision_mlp_padding",
    "model.compile_layers": "compile_layers",
    "model.compile_scope": "compile_scope",
}
PREFIX_CONFIG_FIELDS = {  # bench.prefix.PrefixBenchConfig
    **WORKLOAD_CONFIG_FIELDS,
    "model.suffix_attention": "suffix_attention",
    "model.cascade_kernels": "cascade_kernels",
}
DECODE_CONFIG_FIELDS = {  # bench.decode.DecodeBenchConfig
    **WORKLOAD_CONFIG_FIELDS,
    "rollout.temperature": "temperature",
    "rollout.top_p": "top_p",
    "rollout.top_k": "top_k",
}
