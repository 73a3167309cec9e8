"""Prefix and suffix forwards of a Qwen2.5-VL model: the building block of every role.

Legend: G groups, N group size, B = G·N rows, P prompt length, R response length, V vocabulary,
Hd hidden size. Paper §2.3: each model invocation is split at the first response position into a
*prefix* (vision encoder + prompt prefill, once per group, leaving boundary KV and the log-probs that
score the first response token) and a *suffix* (the N responses, scored against the boundary KV).

The model definition is transformers' ``Qwen2_5_VLForConditionalGeneration``; rollplex drives its
vision tower, token embedding, decoder stack and LM head directly, always with explicit 3D positions
(models.positions) and the rollplex attention function (models.attention), so no cache object or
cached rope offset of the library is involved.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from rollplex.config import VISION_ATTENTION
from rollplex.hooks import spanned
from rollplex.models import recompute
from rollplex.models.attention import (
    ATTENTION_NAME,
    PLAN_KEYWORD,
    SUFFIX_ATTENTION,
    VISION_ATTENTION_NAME,
    PrefixPlan,
    SuffixAttention,
    register,
    suffix_plan,
)
from rollplex.models.compiled import (
    check_scope,
    compiled_scope,
    layers_compiled,
    refuse_foreign_forwards,
    set_layer_compilation,
)
from rollplex.models.logprobs import entropy as entropy_of
from rollplex.models.logprobs import token_logprobs
from rollplex.models.positions import response_positions
from rollplex.models.transfer import to_device
from rollplex.models.vision_layout import vision_layout
from rollplex.models.vision_mlp import set_vision_mlp_padding
from rollplex.types import PrefixState, Prompt

AUTO_SUFFIX_ATTENTION = SuffixAttention()  # the device and dtype's backend (``suffix_backend``)


def prepare_model(
    model,
    vision_attention: str = "batched",
    vision_mlp_padding: bool = True,
    compile_layers: bool | None = None,
    compile_scope: str | None = None,
) -> None:
    """Route the language model's attention through rollplex; the vision tower's windows and frames
    through ``models.attention.chunked_attention``, one SDPA call per distinct chunk length
    (``batched``), or through the backend transformers chose when the model was built, one call per
    chunk (``per_chunk``); with ``vision_mlp_padding``, the vision blocks' MLP on zero-padded weights
    (models.vision_mlp); with ``compile_layers``, each decoder layer and vision block compiled, whole
    or by its parts (``compile_scope``, models.compiled; None keeps compilation on or off, and its
    scope, reinstalled with inductor after the vision MLP's class may have changed). Calling it again
    switches between these.

    Raises:
        ValueError: an unknown ``vision_attention`` or ``compile_scope``, or layers to compile where a
            module to compile has an instance ``forward`` of another origin (models.compiled); nothing
            is changed then.
    """
    if vision_attention not in VISION_ATTENTION:
        raise ValueError(f"vision_attention {vision_attention!r}: expected one of {VISION_ATTENTION}")
    scope = compile_scope if compile_scope is not None else compiled_scope(model) or "layer"
    check_scope(scope)  # before anything changes
    compiled = layers_compiled(model) if compile_layers is None else compile_layers
    if compiled:
        refuse_foreign_forwards(model, scope)  # before anything changes
    register()
    model.config.text_config._attn_implementation = ATTENTION_NAME
    model.model.language_model.config._attn_implementation = ATTENTION_NAME
    visual = model.model.visual.config
    if not hasattr(model, "rollplex_vision_default"):
        model.rollplex_vision_default = visual._attn_implementation
    name = VISION_ATTENTION_NAME if vision_attention == "batched" else model.rollplex_vision_default
    model.config.vision_config._attn_implementation = name
    visual._attn_implementation = name
    set_vision_mlp_padding(model, vision_mlp_padding)
    set_layer_compilation(model, compiled, scope=scope)  # again after a vision MLP class swap


def enable_checkpointing(model, *, layer_recompute: bool = True) -> None:
    """Recompute each decoder (and vision) layer in backward, keeping only its input, in training mode
    (Qwen2.5-VL has no active dropout): transformers' activation checkpointing
    (``activation_checkpointing_enable``; ``gradient_checkpointing_enable`` on releases before it) with
    torch's non-reentrant checkpoint, and with ``layer_recompute`` each layer call that can be run by
    ``models.recompute`` instead (forward without autograd): the prefix passes' decoder layers and the
    vision blocks whose input needs a gradient; the suffix layers keep torch's checkpoint.

    Raises:
        ValueError: ``layer_recompute`` on a model with dropout (``models.recompute.enable``).
    """
    options = {"use_reentrant": False}
    if getattr(model, "_require_grads_hooks", None) or hasattr(model, "_require_grads_hook"):
        model.disable_input_require_grads()  # enabling again would stack another embedding hook
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
    model.train(True)
    if layer_recompute:
        recompute.enable(model, fallback=functools.partial(checkpoint, **options))


@spanned("rollplex/vision")
def _vision_output(model, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """Merged vision embeddings [tokens, Hd] of all images (or all videos) of one prompt.

    A fully frozen tower runs without autograd, so it keeps no activations (field case B17).
    """
    visual = model.model.visual
    trainable = torch.is_grad_enabled() and any(p.requires_grad for p in visual.parameters())
    layout = vision_layout(visual, grid_thw, pixels.device)
    grid, kwargs = (
        (to_device(grid_thw, pixels.device), {}) if layout is None else (layout.grid, layout.kwargs())
    )
    with contextlib.nullcontext() if trainable else torch.no_grad():
        out = visual(pixels.to(visual.dtype), grid_thw=grid, **kwargs)
    return out.pooler_output if hasattr(out, "pooler_output") else out


def prompt_embeddings(model, prompt: Prompt) -> torch.Tensor:
    """Input embeddings [1, P, Hd] of a prompt, vision features placed at its placeholder tokens.

    Only placeholder ids inside the prompt receive vision features; response tokens are always embedded
    as text (field case B05).

    Raises:
        ValueError: the number of placeholders differs from the number of vision features (B06).
    """
    lm = model.model.language_model
    device = lm.embed_tokens.weight.device
    embeds = lm.embed_tokens(to_device(prompt.input_ids, device))
    config = model.config
    for pixels, grid, token in (
        (prompt.pixel_values, prompt.image_grid_thw, config.image_token_id),
        (prompt.pixel_values_videos, prompt.video_grid_thw, config.video_token_id),
    ):
        if pixels is None:
            continue
        feats = _vision_output(model, to_device(pixels, device), grid).to(embeds.dtype)
        embeds = embeds.index_put((_placeholders(prompt.input_ids, token, feats.shape[0], device),), feats)
    return embeds.unsqueeze(0)


def _placeholders(ids: torch.Tensor, token: int, features: int, device: torch.device) -> torch.Tensor:
    """Positions int64 [k] of id ``token`` in ``ids`` [P], on ``device``; found on the host when ``ids``
    is there, so the device queue is not drained for them.

    Raises:
        ValueError: k differs from ``features``, the number of vision features (B06).
    """
    slots = ids == token
    count = int(slots.sum())
    if count != features:
        raise ValueError(f"prompt has {count} placeholders of id {token} but {features} features")
    return to_device(slots.nonzero().squeeze(1), device)


def _decoder(model, embeds: torch.Tensor, positions: torch.Tensor, plan) -> torch.Tensor:
    """Decoder stack + final norm: hidden states [batch, len, Hd]."""
    out = model.model.language_model(
        inputs_embeds=embeds,
        position_ids=positions,
        attention_mask={"full_attention": None},
        use_cache=False,
        **{PLAN_KEYWORD: plan},
    )
    return out.last_hidden_state


def _pad_stack(tensors: list[torch.Tensor], length: int) -> torch.Tensor:
    """Stack [1, Hkv, P_g, D] tensors into [G, Hkv, length, D], zero-padded along P."""
    return torch.cat([F.pad(t, (0, 0, 0, length - t.shape[2])) for t in tensors], dim=0)


@spanned("rollplex/prefix")
def prefix_states(
    model, prompts: list[Prompt], *, temperature: float, banned_ids: torch.Tensor, attached: bool
) -> list[PrefixState]:
    """Vision encode + prompt prefill of each prompt, once (paper §2.3 prefix), as one state per group.

    Each group's state has its own autograd graph (when ``attached``), so a micro-batch's backward
    touches only its own groups' prefixes.

    Args:
        prompts: the G group prompts.
        temperature: sampling temperature T of the log-prob definition (models.logprobs.token_logprobs).
        banned_ids: int64 [k] vision special ids excluded from the distribution (B05).
        attached: keep the autograd graph (actor prefix) or run without it (rollout, reference).

    Returns:
        G PrefixStates of one group each: boundary KV per layer [1, Hkv, P, D] (model dtype) and
        last-position log-probs [1, V] (float32; float64 for a float64 model).
    """
    grad = contextlib.nullcontext() if attached else torch.no_grad()
    states = []
    with grad:
        for prompt in prompts:
            hidden, keys, values = _recorded_prefill(model, prompt)
            device = hidden.device
            states.append(
                PrefixState(
                    keys=keys,
                    values=values,
                    prompt_lens=torch.full((1,), prompt.length, device=device),
                    host_prompt_lens=(prompt.length,),
                    next_position=torch.full((1,), prompt.next_position, device=device),
                    last_logprobs=_last_logprobs(model, hidden[:, -1], temperature, banned_ids.to(device)),
                    content_keys=[prompt.content_key],
                    attached=attached,
                )
            )
    return states


def _last_logprobs(model, hidden: torch.Tensor, temperature: float, banned_ids) -> torch.Tensor:
    """Full-vocabulary log-probs float32 [G, V] of the last prompt positions' hidden states [G, Hd];
    under tensor parallelism (``model.rollplex_tp``, parallel.vocab_parallel) the G rows' logits are
    gathered over the group (G rows only: small)."""
    tp = getattr(model, "rollplex_tp", None)
    if tp is not None:
        return tp.last_logprobs(hidden, temperature, banned_ids)
    return token_logprobs(model.lm_head(hidden), temperature, banned_ids)


def _recorded_prefill(model, prompt: Prompt) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Vision encode + prompt prefill of one prompt: hidden states [1, P, Hd] after the final norm, and
    the boundary keys and values, one [1, Hkv, P, D] per layer. The prefix plan is emptied however the
    pass ends, a raised error included (``PrefixPlan.take_boundary``)."""
    plan = PrefixPlan()
    try:
        embeds = prompt_embeddings(model, prompt)
        positions = to_device(prompt.position_ids, embeds.device)[:, None, :]
        hidden = _decoder(model, embeds, positions, plan)
    except BaseException:
        plan.clear()
        raise
    keys, values = plan.take_boundary()
    return hidden, keys, values


def merge_prefixes(states: list[PrefixState]) -> PrefixState:
    """One PrefixState of G groups from G single-group states: boundary KV zero-padded to the longest
    prompt, [G, Hkv, P_max, D] per layer (differentiable: gradients flow back to each group's graph)."""
    lens = torch.cat([s.prompt_lens for s in states])
    host_lens = tuple(n for s in states for n in s.host_prompt_lens)
    p_max = max(host_lens)
    layers = len(states[0].keys)
    return PrefixState(
        keys=[_pad_stack([s.keys[i] for s in states], p_max) for i in range(layers)],
        values=[_pad_stack([s.values[i] for s in states], p_max) for i in range(layers)],
        prompt_lens=lens,
        host_prompt_lens=host_lens,
        next_position=torch.cat([s.next_position for s in states]),
        last_logprobs=torch.cat([s.last_logprobs for s in states]),
        content_keys=[key for s in states for key in s.content_keys],
        attached=any(s.attached for s in states),
    )


def detach_prefix(state: PrefixState) -> PrefixState:
    """The same boundary state without its autograd graph (prefill fusion seeds decode with it)."""
    return PrefixState(
        keys=[k.detach() for k in state.keys],
        values=[v.detach() for v in state.values],
        prompt_lens=state.prompt_lens,
        host_prompt_lens=state.host_prompt_lens,
        next_position=state.next_position,
        last_logprobs=state.last_logprobs.detach(),
        content_keys=list(state.content_keys),
        attached=False,
    )


def prefix_forward(
    model, prompts: list[Prompt], *, temperature: float, banned_ids: torch.Tensor, attached: bool
) -> PrefixState:
    """The prefixes of G prompts merged into one PrefixState (see ``prefix_states``): boundary KV per
    layer [G, Hkv, P_max, D], last-position log-probs [G, V]."""
    states = prefix_states(model, prompts, temperature=temperature, banned_ids=banned_ids, attached=attached)
    with contextlib.nullcontext() if attached else torch.no_grad():
        return merge_prefixes(states)


@spanned("rollplex/suffix")
def suffix_logprobs(
    model,
    prefix: PrefixState,
    responses: torch.Tensor,
    *,
    group_size: int,
    temperature: float,
    banned_ids: torch.Tensor,
    with_entropy: bool = False,
    attention: SuffixAttention = AUTO_SUFFIX_ATTENTION,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of N responses per group against the group's boundary KV (paper §2.3 suffix).

    Args:
        prefix: boundary state of the G groups (attached for the actor: gradients flow into it).
        responses: int64 [B, R], B = G·N, right-padded (padding is scored but the caller masks it).
        group_size: N.
        attention: the suffix attention backend and cascade kernels (``suffix_backend``; default: the
            device and dtype's).

    Returns:
        (logprobs float32 [B, R], entropy float32 [B, R] or None). Token 0 is scored by the prefix's
        last-position log-probs, token j ≥ 1 by suffix position j-1. Entropy is computed without a graph.
    """
    lm = model.model.language_model
    responses = responses.to(prefix.last_logprobs.device)
    rows, length = responses.shape
    first_lp = prefix.last_logprobs.repeat_interleave(group_size, dim=0)
    first = first_lp.gather(1, responses[:, :1])
    if length == 1:
        ent = entropy_of(first_lp.detach())[:, None] if with_entropy else None
        return first, ent
    backend = suffix_backend(responses.device, prefix.keys[0].dtype, attention.backend)
    plan = suffix_plan(prefix, group_size, length - 1, backend, attention.cascade_kernels)
    embeds = lm.embed_tokens(responses[:, :-1])
    positions = response_positions(prefix.next_position, length - 1, group_size)
    hidden = _decoder(model, embeds, positions, plan)
    banned_ids = banned_ids.to(hidden.device)
    rest = _token_logprobs_chunked(model, hidden, responses[:, 1:], temperature, banned_ids)
    ent = None
    if with_entropy:
        first_ent = entropy_of(first_lp.detach())[:, None]
        ent = torch.cat([first_ent, _entropy_chunked(model, hidden, temperature, banned_ids)], dim=1)
    return torch.cat([first, rest], dim=1), ent


LOGIT_CHUNK_ELEMENTS = 2**28  # logits computed at a time (1 GiB in fp32), per chunk of rows


SUFFIX_BACKENDS = tuple(SUFFIX_ATTENTION)  # dense, causal, cascade, sdpa, flex


def suffix_backend(device: torch.device, dtype: torch.dtype, requested: str = "auto") -> str:
    """The suffix attention backend for activations of ``dtype`` on ``device``: ``requested``
    (``model.suffix_attention``: dense | causal | cascade | sdpa | flex), or for auto causal on CUDA in
    bf16/fp16 (flash attention per group, ``models.attention.causal_shared_prefix_attention``), masked
    SDPA on CUDA in other dtypes (flash attention does not take them, and causal would fall back to a
    materialised mask and fp32 scores), and the dense reference path on the CPU (flex_attention has no
    CPU backward). cascade (``cascade_shared_prefix_attention``) is opt-in: it speeds up one layer's
    suffix attention more than the GRPO step (benchmarks/README.md).

    Raises:
        ValueError: an unknown backend name, or flex off CUDA.
    """
    if requested == "auto":
        if device.type != "cuda":
            return "dense"
        return "causal" if dtype in (torch.bfloat16, torch.float16) else "sdpa"
    if requested not in SUFFIX_BACKENDS:
        raise ValueError(f"model.suffix_attention={requested!r}: expected auto or one of {SUFFIX_BACKENDS}")
    if requested == "flex" and device.type != "cuda":
        raise ValueError("model.suffix_attention=flex needs CUDA (flex_attention has no CPU backward)")
    return requested


def _row_chunks(hidden: torch.Tensor, vocab: int) -> list[slice]:
    rows, length = hidden.shape[:2]
    step = max(1, LOGIT_CHUNK_ELEMENTS // max(1, length * vocab))
    return [slice(i, i + step) for i in range(0, rows, step)]


def _gathered_logprobs(model, hidden, targets, temperature, banned_ids):
    """log p_T(targets) [b, L] of hidden [b, L, Hd]; under tensor parallelism from this rank's logit
    columns and three small all-reduces (``model.rollplex_tp.logprobs``), never the full logits."""
    tp = getattr(model, "rollplex_tp", None)
    if tp is not None:
        return tp.logprobs(hidden, targets, temperature, banned_ids)
    logprobs = token_logprobs(model.lm_head(hidden), temperature, banned_ids)
    return logprobs.gather(2, targets[..., None]).squeeze(2)


def _token_logprobs_chunked(model, hidden, targets, temperature, banned_ids) -> torch.Tensor:
    """log-probs [B, L] of ``targets`` from hidden states [B, L, Hd], never holding all [B, L, V] logits:
    rows are processed in chunks, and under autograd each chunk's logits are recomputed in backward."""
    out = []
    for rows in _row_chunks(hidden, model.lm_head.out_features):
        args = (model, hidden[rows], targets[rows], temperature, banned_ids)
        if torch.is_grad_enabled() and hidden.requires_grad:
            out.append(checkpoint(_gathered_logprobs, *args, use_reentrant=False))
        else:
            out.append(_gathered_logprobs(*args))
    return torch.cat(out, dim=0)


@torch.no_grad()
def _entropy_chunked(model, hidden, temperature, banned_ids) -> torch.Tensor:
    """Entropy [B, L] of the next-token distributions, without a graph, in row chunks (under tensor
    parallelism from this rank's logit columns: ``model.rollplex_tp.entropy``)."""
    chunks = _row_chunks(hidden, model.lm_head.out_features)
    tp = getattr(model, "rollplex_tp", None)
    if tp is not None:
        return torch.cat([tp.entropy(hidden[r], temperature, banned_ids) for r in chunks])
    return torch.cat(
        [entropy_of(token_logprobs(model.lm_head(hidden[r]), temperature, banned_ids)) for r in chunks]
    )
