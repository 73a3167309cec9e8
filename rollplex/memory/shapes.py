"""The sizes of a Qwen2.5-VL model that its memory depends on, and its parameters per tensor-parallel rank.

Parameter counts (Qwen2.5-VL technical report, arXiv:2502.13923; module structure of transformers'
``modeling_qwen2_5_vl.py``; K = key/value heads · head_dim, the vision merger's input 4·Hv):

- decoder layer: q (H·heads·hd + heads·hd), k and v (H·K + K each), o (heads·hd·H), gate, up, down
  (3·H·I), two RMSNorms (2·H);
- language model: layers · layer + embedding (V·H) + LM head (V·H; none when tied) + final norm (H);
- vision tower: patch embedding (3·2·14·14·Hv, no bias) + depth · block + merger, block = two norms
  (2·Hv) + qkv (Hv·3Hv + 3Hv) + proj (Hv·Hv + Hv) + gate and up (2·(Hv·Iv + Iv)) + down (Iv·Hv + Hv),
  merger = norm (Hv) + (4Hv·4Hv + 4Hv) + (4Hv·H + H).

Per rank under tensor parallelism of degree t (Megatron-LM, arXiv:1909.08053): q/k/v and gate/up are
column-parallel (their output rows split t ways, biases with them), o and down row-parallel (their
input columns split; the full output kept), the embedding and LM head vocabulary-parallel (⌈V/t⌉ rows
each), norms replicated; key/value heads split t ways, or, where t exceeds their count, one head per rank
(replicated t / kv ways, as Megatron and vLLM do); the vision tower replicated (its MLP width 3420 is
not divisible by 8).

Example:
    arch = Architecture.from_preset("qwen2.5-vl-3b")
    arch.parameters()                    # 3,754,622,976
    arch.rank_parameters(tp=2).language  # the language model's share of one of two ranks
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class RankParameters:
    """Parameter counts of one rank.

    Attributes:
        language: the language model's parameters on the rank (decoder layers, embedding, LM head, norms).
        vision: the vision tower's and merger's (replicated: the same on every rank).
        largest: elements of the rank's largest parameter tensor.
        tensors: how many parameter tensors the rank holds.
        qkv_gate_up: elements of the rank's q/k/v and gate/up weights and biases (decode's fused copies).
    """

    language: int
    vision: int
    largest: int
    tensors: int
    qkv_gate_up: int

    @property
    def total(self) -> int:
        return self.language + self.vision


@dataclasses.dataclass(frozen=True)
class Architecture:
    """Sizes of a Qwen2.5-VL model (names of ``Qwen2_5_VLConfig``'s text and vision configs).

    Example:
        Architecture(2048, 36, 16, 2, 128, 11008, 151936, True, 32, 1280, 16, 3420)  # 3B
    """

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    vision_depth: int
    vision_hidden: int
    vision_heads: int
    vision_intermediate: int
    patch_dim: int = 3 * 2 * 14 * 14  # in_channels · temporal_patch · patch²: one row of pixel values
    merge: int = 2  # spatial_merge_size: a merged vision token is merge² patches

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> Architecture:
        """From a checkpoint's ``config.json`` dict: transformers 5's nested ``text_config`` or the flat
        4.x layout (language fields at the root), with ``vision_config`` in both.

        Raises:
            ValueError: a field the model needs is missing (the message names it).
        """
        text = {**config, **config.get("text_config", {})}
        vision = config.get("vision_config", {})
        try:
            hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
            return cls(
                hidden=hidden,
                layers=int(text["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(text["num_key_value_heads"]),
                head_dim=int(text.get("head_dim") or hidden // heads),
                intermediate=int(text["intermediate_size"]),
                vocab=int(text["vocab_size"]),
                tied=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
                vision_depth=int(vision["depth"]),
                vision_hidden=int(vision["hidden_size"]),
                vision_heads=int(vision["num_heads"]),
                vision_intermediate=int(vision["intermediate_size"]),
                patch_dim=int(vision.get("in_channels", 3))
                * int(vision.get("temporal_patch_size", 2))
                * int(vision.get("patch_size", 14)) ** 2,
                merge=int(vision.get("spatial_merge_size", 2)),
            )
        except KeyError as err:
            raise ValueError(f"model config has no {err.args[0]!r} (a Qwen2.5-VL config.json?)") from err

    @classmethod
    def from_preset(cls, name: str) -> Architecture:
        """From a ``models.presets`` preset (its config, shapes only; nothing allocated).

        Raises:
            ValueError: an unknown preset name.
        """
        from rollplex.models.presets import preset_config

        return cls.from_hf_config(preset_config(name).to_dict())

    def kv_heads_per_rank(self, tp: int) -> int:
        """Key/value heads one rank holds at tensor-parallel degree ``tp``."""
        return max(1, self.kv_heads // tp)

    def check_tp(self, tp: int, field: str) -> None:
        """Raise ValueError naming ``field`` where ``tp`` does not split the heads and MLP evenly."""
        splits = (
            ("attention heads", self.heads, self.heads % tp == 0),
            ("key/value heads", self.kv_heads, self.kv_heads % tp == 0 or tp % self.kv_heads == 0),
            ("MLP width", self.intermediate, self.intermediate % tp == 0),
        )
        for what, count, ok in splits:
            if tp < 1 or not ok:
                raise ValueError(f"{field}={tp} does not split the model's {count} {what} evenly")

    def rank_parameters(self, tp: int = 1) -> RankParameters:
        """Parameter counts of one rank at tensor-parallel degree ``tp`` (``tp`` = 1: the whole model)."""
        h, hd = self.hidden, self.head_dim
        q_out, kv_out = self.heads // tp * hd, self.kv_heads_per_rank(tp) * hd
        qkv = h * q_out + q_out + 2 * (h * kv_out + kv_out)
        gate_up = 2 * h * (self.intermediate // tp)
        layer = qkv + q_out * h + gate_up + h * (self.intermediate // tp) + 2 * h
        vocab_rows = -(-self.vocab // tp)
        embeddings = vocab_rows * h * (1 if self.tied else 2)
        language = self.layers * layer + embeddings + h
        largest = max(vocab_rows * h, h * (self.intermediate // tp), h * q_out)
        tensors = self.layers * 12 + (2 if self.tied else 3) + self.vision_depth * 12 + 6
        return RankParameters(
            language, self.vision_parameters(), largest, tensors, self.layers * (qkv + gate_up)
        )

    def vision_parameters(self) -> int:
        """The vision tower's and merger's parameters."""
        hv, iv, merged = self.vision_hidden, self.vision_intermediate, self.vision_hidden * self.merge**2
        block = 2 * hv + (hv * 3 * hv + 3 * hv) + (hv * hv + hv) + 2 * (hv * iv + iv) + (iv * hv + hv)
        merger = hv + (merged * merged + merged) + (merged * self.hidden + self.hidden)
        return self.patch_dim * hv + self.vision_depth * block + merger

    def parameters(self) -> int:
        """The whole model's parameters."""
        return self.rank_parameters(1).total
