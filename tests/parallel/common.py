"""Shared pieces of the parallel tests: a tiny float32 Qwen2.5-VL with 8 query / 4 key-value heads, the
process groups of one setting, and models.forward driven through the tensor-parallel hook."""

from __future__ import annotations

import contextlib
import copy
import os

import torch
import torch.distributed as dist

from rollplex.config import ParallelConfig
from rollplex.parallel.dist import ParallelContext, build_context
from rollplex.parallel.tensor_parallel import gather_from_tp
from tests.numerics.conftest import BANNED, make_prompt, tiny_config

N, R, T = 2, 5, 0.7


def tp_config():
    """tests.numerics' tiny config (vocabulary 200, vision ids 190-193) with 8 query heads and 4
    key/value heads of dim 8 (enough for TP 4), MLP width 96."""
    config = tiny_config()
    text = config.text_config
    text.num_attention_heads, text.num_key_value_heads = 8, 4
    text.rope_parameters["mrope_section"] = [2, 1, 1]  # sums to head_dim / 2 = 4
    return config


def build_model(seed: int = 0):
    """The float32 model every rank builds alike (same seed), rollplex attention registered."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from rollplex.models.forward import prepare_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(tp_config()).float()
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.2)
    prepare_model(model)
    return model


def context(tp_train: int, tp_rollout: int = 1, dp: int = 1) -> ParallelContext:
    """This worker's ParallelContext for the setting (every rank of the pool must call it alike)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = int(os.environ.get("RANK", "0"))
    parallel = ParallelConfig(dp=dp, tp_train=tp_train, tp_rollout=tp_rollout)
    return build_context(parallel, rank, world, torch.device("cpu"))


def batch():
    """Two groups (a video prompt, an image prompt) and N responses each, R tokens (ids 3..149)."""
    prompts = [
        make_prompt([3, 2], [("video", (2, 4, 4), 0.5)], seed=2),
        make_prompt([4, 3], [("image", (1, 4, 6), 0.0)], seed=1),
    ]
    g = torch.Generator().manual_seed(5)
    return prompts, torch.randint(3, 150, (len(prompts) * N, R), generator=g)


def flat_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@contextlib.contextmanager
def forward_through_hook(comm):
    """models.forward's LM-head steps routed through ``model.rollplex_tp`` (what the integration will
    wire): targets' log-probs, entropy and the prefixes' last log-probs without full logits. Restored
    on exit (the worker process outlives the test)."""
    from rollplex.models import forward

    saved = (forward._gathered_logprobs, forward._entropy_chunked, forward.token_logprobs)

    def gathered(model, hidden, targets, temperature, banned):
        return model.rollplex_tp.logprobs(hidden, targets, temperature, banned)

    @torch.no_grad()
    def entropy(model, hidden, temperature, banned):
        return model.rollplex_tp.entropy(hidden, temperature, banned)

    def last(logits, temperature, banned):  # prefix_states' last-position log-probs, [G, V/tp] logits
        return saved[2](gather_from_tp(logits, comm), temperature, banned)

    forward._gathered_logprobs, forward._entropy_chunked, forward.token_logprobs = gathered, entropy, last
    try:
        yield
    finally:
        forward._gathered_logprobs, forward._entropy_chunked, forward.token_logprobs = saved


def score(model, prompts, responses, *, comm=None, attached: bool = True):
    """Actor scoring through models.forward: (log-probs [B, R], entropy [B, R]) with the prefix
    attached (gradients flow into the prefix, vision tower included)."""
    from rollplex.models.forward import prefix_forward, suffix_logprobs

    hook = forward_through_hook(comm) if comm is not None else contextlib.nullcontext()
    with hook:
        prefix = prefix_forward(model, prompts, temperature=T, banned_ids=BANNED, attached=attached)
        logprobs, entropy = suffix_logprobs(
            model, prefix, responses, group_size=N, temperature=T, banned_ids=BANNED, with_entropy=True
        )
    return prefix, logprobs, entropy


def reference_copy(model):
    """A deep copy (the single-process oracle of the same weights)."""
    return copy.deepcopy(model)
