"""Names shared by the planner and the residency manager: the windows of one iteration and the state
classes whose residency they plan and apply.

An iteration has three phases (paper §3.1); Phase 2 is two windows here, because the reference is read
only in the first and can be paged out before the actor's backward, the iteration's largest working
set:

    window     phase  what runs
    rollout    1      rollout prefill and decode; reference and actor prefixes (rollplex schedule)
    scoring    2      rewards, advantages, reference suffix scoring
    backward   2      actor suffix forward and backward (serial schedule: the prefixes too)
    update     3      the chunked optimizer step, writing the new snapshot θ_{k+1}
"""

from __future__ import annotations

WINDOWS = ("rollout", "scoring", "backward", "update")
PHASE = {"rollout": 1, "scoring": 2, "backward": 2, "update": 3}

# State classes (tags), with the paper's lifetime class (§3.2: permanent, regenerable, boundary,
# phase-local) and what each holds.
STATE_CLASSES = {
    "snapshot": ("regenerable", "BF16 actor weights θ_k (shared with rollout where the layout allows)"),
    "rollout_weights": ("regenerable", "rollout's own copy of the actor weights (copied layout only)"),
    "reference": ("regenerable", "frozen reference weights"),
    "master": ("permanent", "FP32 master weights"),
    "adam": ("permanent", "Adam exp_avg and exp_avg_sq"),
    "grads": ("phase-local", "gradients of the trainable parameters, in their dtype"),
    "rollout_kv": ("phase-local", "rollout KV: prompt KV once per group and every row's own keys"),
    "decode_graphs": ("phase-local", "decode's fused q/k/v and gate/up weight copies and sampling buffers"),
    "boundary_kv": ("boundary", "reference and actor boundary KV kept for the suffixes"),
    "prefix_activations": ("phase-local", "tensors the actor prefix saves for its backward"),
    "suffix_activations": ("phase-local", "the actor suffix's saved tensors and one layer's recompute"),
    "layer_working_set": (
        "phase-local",
        "one layer's transient tensors: its forward, or its recompute in backward",
    ),
    "logits": ("phase-local", "one chunk of log-softmax logits and its gradient"),
    "optimizer_staging": ("phase-local", "the chunked optimizer's staging ring and gradient upcasts"),
    "workspace": ("phase-local", "library workspaces (cuBLAS, attention) and CUDA graph pools"),
}

DEVICE, HOST, ABSENT = "device", "host", "-"  # where a class lives in a window
