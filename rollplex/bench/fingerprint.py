"""Fingerprints of an update: whether two runs left bitwise the same FP32 master weights and AdamW moments,
without keeping a copy of either (masters and moments take 12 bytes per parameter).

A fingerprint is a 64-bit sum, over the elements of a float32 tensor, of SplitMix64's finaliser (Steele,
Lea and Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014: a bijection of 64-bit
words) applied to each element's bit pattern with its position in the upper 32 bits. Equal tensors give
equal fingerprints. Distinct (value, position) pairs give distinct mixed words, and the mix is not
linear, so two tensors that differ give equal sums only by a chance coincidence of their mixed words'
totals, not for any structured pattern of differences, as a weighted sum of the bits would (it misses
differences that cancel in it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rollplex.phases import ActorStats

_CHUNK = 2**24  # elements mixed at a time: a few int64 temporaries of 128 MiB each
_MASK64 = 2**64 - 1
# SplitMix64's odd multipliers, as the signed int64 values torch multiplies with (wrapping mod 2**64)
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


def _shift(keys: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 words (torch shifts arithmetically: the sign bit's copies are
    masked off)."""
    return (keys >> bits) & ((1 << (64 - bits)) - 1)


def _mix(keys: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 [n] (multiplies wrap modulo 2**64, shifts are logical): a
    bijection of 64-bit words."""
    keys = keys * _GOLDEN
    keys = (keys ^ _shift(keys, 30)) * _MIX1
    keys = (keys ^ _shift(keys, 27)) * _MIX2
    return keys ^ _shift(keys, 31)


def fingerprint(tensor: torch.Tensor) -> int:
    """The fingerprint of a float32 tensor (see the module docstring).

    Args:
        tensor: float32, any shape, on any device (mixed and summed there, 2**24 elements at a time).

    Returns:
        int in [0, 2**64): the sum, modulo 2**64, of the mix of each element's 32 bits with its flat
        position in the upper 32 bits. It does not depend on the chunk size.

    Raises:
        TypeError: ``tensor`` is not float32.
        ValueError: it has 2**32 elements or more (positions must fit in 32 bits).
    """
    if tensor.dtype != torch.float32:
        raise TypeError(f"fingerprint expects float32, got {tensor.dtype}")
    if tensor.numel() >= 2**32:
        raise ValueError(f"fingerprint takes fewer than 2**32 elements, got {tensor.numel()}")
    bits = tensor.detach().reshape(-1).view(torch.int32)
    total = torch.zeros((), dtype=torch.int64, device=bits.device)  # sums wrap: modulo 2**64
    for start in range(0, bits.numel(), _CHUNK):
        chunk = bits[start : start + _CHUNK].to(torch.int64) & 0xFFFFFFFF
        position = torch.arange(start, start + chunk.numel(), device=chunk.device, dtype=torch.int64)
        total += _mix(chunk | (position << 32)).sum()
    return int(total) & _MASK64  # one read of the device per tensor


def step_fingerprints(
    scored, stats: Sequence[ActorStats] = (), norms: Sequence[float] = ()
) -> dict[str, int]:
    """Fingerprints of what one step computed, so that two runs compared step by step say where they
    first part: in what rollout sampled, in the training forward, or in its backward.

    Args:
        scored: the step's ``ScoredBatch``: its sampled tokens (int64 [B, R], fingerprinted as float32,
            where token ids are exact), the rollout's recorded log-probs and the reference log-probs
            (float32 [B, R]) and the advantages (float32 [B]).
        stats: one ``ActorStats`` per mini-batch (loss, KL, clip fraction, entropy, log-prob gaps,
            tokens), fingerprinted from their float64 bits. They are sums over the training log-probs
            reduced in float32, so a last-bit difference in one log-prob usually shows in them but can
            vanish in the rounding.
        norms: the gradient norms before clipping, one per mini-batch, from their float64 bits; likewise
            a difference in one gradient can vanish in a norm's rounding.

    Returns:
        {"responses" | "rollout_logprobs" | "advantages" | "ref_logprobs" | "actor_statistics" |
        "gradient_norms": fingerprint}; the reference's left out when KL is off, "actor_statistics" when
        ``stats`` is empty and "gradient_norms" when ``norms`` is.

    Raises:
        TypeError: an element of ``stats`` is not a dataclass instance.
    """
    rollout = scored.rollout
    parts = {
        "responses": rollout.responses,
        "rollout_logprobs": rollout.logprobs,
        "advantages": scored.advantages,
        "ref_logprobs": scored.ref_logprobs,
    }
    out = {name: fingerprint(value.float()) for name, value in parts.items() if value is not None}
    statistics = [float(v) for s in stats for v in dataclasses.astuple(s)]
    for name, values in (("actor_statistics", statistics), ("gradient_norms", [float(n) for n in norms])):
        if values:  # float64 bits as float32 pairs: every bit counts
            out[name] = fingerprint(torch.tensor(values, dtype=torch.float64).view(torch.float32))
    return out


def first_difference(a: list[dict], b: list[dict]) -> dict[str, int | None]:
    """Per key of two runs' ``step_fingerprints`` lists, the first step (1-based) where they differ,
    or None where every step the two share agrees."""
    keys = [k for k in (a[0] if a else {}) if all(k in s for s in a + b)]
    return {
        key: next((i + 1 for i, (x, y) in enumerate(zip(a, b)) if x[key] != y[key]), None) for key in keys
    }


def optimizer_fingerprints(optimizer) -> dict[tuple[int, str], int]:
    """``fingerprint`` of each FP32 master weight of a ``memory.chunked_adamw.ChunkedAdamW`` and of its
    AdamW moments, wherever they live (host-pool state is mixed on the parameters' device).

    These show a difference in the update where the bf16 weights may not: at a learning rate of 1e-6 a
    step moves a weight by far less than one bf16 step, and the second moment holds the squared
    gradient itself.

    Returns:
        {(parameter index, "master" | "exp_avg" | "exp_avg_sq"): fingerprint}; a moment AdamW has not
        made yet (no step taken) is left out.
    """
    device = optimizer.device
    return {(index, name): fingerprint(value.to(device)) for index, name, value in optimizer.state_tensors()}


def differing(a: dict, b: dict) -> int:
    """How many tensors of two ``optimizer_fingerprints`` differ: those present in both with other
    fingerprints, and those present in only one."""
    return sum(a.get(key) != b.get(key) for key in a.keys() | b.keys())
