"""Model presets: published config values, meta parameter counts, and the tiny checkpoint on disk.

Oracles: the values table (docs/qwen2.5-vl.md, "Published sizes") and the parameter counts
(docs/qwen2.5-vl.md, "Parameter counts"), typed in here by hand, and an independent parameter-count formula
(same section) checked against those counts.
"""

from __future__ import annotations

import json
import socket

import pytest
import torch
from safetensors import safe_open
from transformers import (
    AutoProcessor,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
)

from rollplex.models.presets import (
    PRESETS,
    TOKENIZER_OF,
    init_checkpoint,
    init_model,
    meta_model,
    preset_config,
    vision_special_ids,
)
from rollplex.models.tokenizer import VOCAB_SIZES, build_tokenizer

# docs/qwen2.5-vl.md, "Published sizes": hidden, layers, heads, kv heads, intermediate, vocab, tied, vision
# intermediate
PUBLISHED = {
    "qwen2.5-vl-3b": (2048, 36, 16, 2, 11008, 151936, True, 3420),
    "qwen2.5-vl-7b": (3584, 28, 28, 4, 18944, 152064, False, 3420),
    "qwen2.5-vl-32b": (5120, 64, 40, 8, 27648, 152064, False, 3456),
}
# docs/qwen2.5-vl.md, "Parameter counts": model totals
PARAMETERS = {
    "qwen2.5-vl-3b": 3_754_622_976,
    "qwen2.5-vl-7b": 8_292_166_656,
    "qwen2.5-vl-32b": 33_452_718_336,
}
TINY_PARAMETERS = 215_264  # by hand: LM 131,648 (2 layers × 37,120 + 2 × 448·64 + 64) + vision 83,616
VISION_FIELDS = (
    "depth",
    "hidden_size",
    "num_heads",
    "intermediate_size",
    "out_hidden_size",
    "patch_size",
    "spatial_merge_size",
    "temporal_patch_size",
    "tokens_per_second",
    "window_size",
    "fullatt_block_indexes",
    "in_channels",
    "hidden_act",
)
TINY_VISION = dict(zip(VISION_FIELDS, (2, 32, 2, 64, 64, 14, 2, 2, 2, 112, [1], 3, "silu"), strict=True))


def formula_parameters(config: Qwen2_5_VLConfig) -> int:
    """The parameter count formula (docs/qwen2.5-vl.md, "Parameter counts") written out: decoder layers,
    embeddings (+ untied head), final norm, vision tower."""
    text, vision = config.text_config, config.vision_config
    h, i, v = text.hidden_size, text.intermediate_size, text.vocab_size
    kv = text.num_key_value_heads * h // text.num_attention_heads
    layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h
    lm = text.num_hidden_layers * layer + v * h * (1 if config.tie_word_embeddings else 2) + h
    vh, vi, out = vision.hidden_size, vision.intermediate_size, vision.out_hidden_size
    block = 2 * vh + (vh * 3 * vh + 3 * vh) + (vh * vh + vh) + 2 * (vh * vi + vi) + (vi * vh + vh)
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2 * vh
    merged = vh * vision.spatial_merge_size**2
    merger = vh + (merged * merged + merged) + (merged * out + out)
    return lm + patch + vision.depth * block + merger


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return init_checkpoint("tiny", tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)


def test_preset_names_match_the_tokenizer():
    assert PRESETS == ("tiny", "qwen2.5-vl-3b", "qwen2.5-vl-7b", "qwen2.5-vl-32b", "tiny-tp")
    assert TOKENIZER_OF == {"tiny-tp": "tiny"}
    assert tuple(VOCAB_SIZES) == tuple(p for p in PRESETS if p not in TOKENIZER_OF)
    with pytest.raises(ValueError, match="'qwen2-vl-7b'"):
        preset_config("qwen2-vl-7b")


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_real_config_has_published_values(name):
    config = preset_config(name)
    text, vision = config.text_config, config.vision_config
    hidden, layers, heads, kv_heads, inter, vocab, tied, vision_inter = PUBLISHED[name]
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads) == (hidden, layers, heads)
    assert (text.num_key_value_heads, text.intermediate_size, text.vocab_size) == (kv_heads, inter, vocab)
    assert hidden // heads == 128
    assert config.tie_word_embeddings is tied and text.tie_word_embeddings is tied
    assert text.rope_parameters["rope_theta"] == 1e6 and text.rope_parameters["mrope_section"] == [16, 24, 24]
    assert (text.max_position_embeddings, text.rms_norm_eps, text.hidden_act) == (128000, 1e-6, "silu")
    assert (text.bos_token_id, text.eos_token_id, text.pad_token_id) == (151643, 151645, None)
    expected_vision = dict(
        TINY_VISION, depth=32, hidden_size=1280, num_heads=16, intermediate_size=vision_inter
    )
    expected_vision.update(out_hidden_size=hidden, fullatt_block_indexes=[7, 15, 23, 31])
    assert {f: getattr(vision, f) for f in VISION_FIELDS} == expected_vision
    ids = (config.vision_start_token_id, config.vision_end_token_id, config.vision_token_id)
    assert ids + (config.image_token_id, config.video_token_id) == (151652, 151653, 151654, 151655, 151656)


def test_tiny_config_takes_ids_from_the_tiny_tokenizer():
    config = preset_config("tiny")
    text, tokenizer = config.text_config, build_tokenizer("tiny")
    assert text.vocab_size == len(tokenizer) == 448
    assert (text.hidden_size, text.num_attention_heads, text.num_key_value_heads) == (64, 4, 2)
    assert (text.num_hidden_layers, text.intermediate_size) == (2, 128)
    assert sum(text.rope_parameters["mrope_section"]) == text.hidden_size // text.num_attention_heads // 2
    assert config.tie_word_embeddings is False
    assert {f: getattr(config.vision_config, f) for f in VISION_FIELDS} == TINY_VISION
    names = ["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
    assert vision_special_ids(config) == tokenizer.convert_tokens_to_ids(names)
    assert text.bos_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert text.eos_token_id == tokenizer.eos_token_id


def test_vision_special_ids():
    assert vision_special_ids(preset_config("qwen2.5-vl-7b")) == [151652, 151653, 151654, 151655, 151656]
    assert vision_special_ids(preset_config("tiny")) == [435, 436, 437, 438, 439]
    assert vision_special_ids(Qwen2_5_VLConfig()) == [151652, 151653, 151655, 151656]


@pytest.mark.parametrize("name", list(PARAMETERS))
def test_meta_parameter_counts_match_formats_section_4(name):
    model = meta_model(name)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == PARAMETERS[name]
    assert formula_parameters(model.config) == PARAMETERS[name]
    tied = model.lm_head.weight is model.model.language_model.embed_tokens.weight
    assert tied is PUBLISHED[name][6]


def test_tiny_parameter_count():
    model = meta_model("tiny")
    assert sum(p.numel() for p in model.parameters()) == TINY_PARAMETERS
    assert formula_parameters(model.config) == TINY_PARAMETERS


def test_tiny_tp_has_heads_for_tensor_parallelism_4():
    """tiny with 8 query / 4 key-value heads of dim 16 and MLP width 256; the tiny tokenizer's
    vocabulary (448 = 4 · 112) and special ids. Parameters by hand: LM 410,752 (2 layers × 147,968 +
    2 × 448·128 + 128) + vision 91,872 (tiny's, with the merger's last linear 128 → 128)."""
    config = preset_config("tiny-tp")
    text = config.text_config
    assert (text.num_attention_heads, text.num_key_value_heads, text.hidden_size) == (8, 4, 128)
    assert (text.intermediate_size, text.vocab_size) == (256, 448)
    assert sum(text.rope_parameters["mrope_section"]) == text.hidden_size // text.num_attention_heads // 2
    assert vision_special_ids(config) == vision_special_ids(preset_config("tiny"))
    model = meta_model("tiny-tp")
    assert sum(p.numel() for p in model.parameters()) == 502_624 == formula_parameters(config)
    assert preset_config("tiny").text_config.num_attention_heads == 4  # tiny itself unchanged


def test_init_is_seeded_and_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    a, b, c = (init_model("tiny", seed=s).state_dict() for s in (0, 0, 1))
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(
        a["model.language_model.embed_tokens.weight"], c["model.language_model.embed_tokens.weight"]
    )
    assert a["model.language_model.embed_tokens.weight"].std() > 0.01


def test_unsupported_dtype_is_refused(tmp_path):
    with pytest.raises(ValueError, match="int8"):
        init_checkpoint("tiny", tmp_path / "x", dtype=torch.int8)
    assert not (tmp_path / "x").exists()


def test_tiny_checkpoint_round_trip_without_network(tiny_dir, monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("network access during a local load")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    processor = AutoProcessor.from_pretrained(tiny_dir)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_dir)
    expected = init_model("tiny", seed=0).state_dict()
    loaded = model.state_dict()
    assert set(loaded) == set(expected)
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    assert type(processor).__name__ == "Qwen2_5_VLProcessor"
    assert processor.video_processor.do_sample_frames is False
    assert len(processor.tokenizer) == 448 and processor.tokenizer.eos_token == "<|im_end|>"
    assert model.generation_config.eos_token_id == [428, 426]


def test_saved_files(tiny_dir):
    names = {p.name for p in tiny_dir.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    assert not [p for p in tiny_dir.parent.iterdir() if p.name.startswith(".")]
    saved = json.loads((tiny_dir / "config.json").read_text())
    assert {f: saved["vision_config"][f] for f in VISION_FIELDS} == TINY_VISION
    assert json.loads((tiny_dir / "generation_config.json").read_text())["eos_token_id"] == [428, 426]


def test_weights_on_disk_use_checkpoint_names(tiny_dir):
    with safe_open(tiny_dir / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_slice("visual.patch_embed.proj.weight").get_shape() == [32, 3, 2, 14, 14]
    prefixes = ("model.layers.", "model.embed_tokens.", "model.norm.", "lm_head.", "visual.")
    assert all(k.startswith(prefixes) for k in keys)
    assert {"lm_head.weight", "model.embed_tokens.weight", "visual.merger.mlp.0.weight"} <= keys


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_real_config_json_writes_every_vision_field(name, tmp_path):
    preset_config(name).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert set(VISION_FIELDS) <= set(saved["vision_config"])
    assert (saved["vision_config"]["tokens_per_second"], saved["vision_config"]["hidden_size"]) == (2, 1280)


def test_bfloat16_checkpoint(tmp_path):
    out = init_checkpoint("tiny", tmp_path / "bf16", seed=3, dtype=torch.bfloat16)
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert torch.get_default_dtype() == torch.float32


def test_existing_target_is_refused_and_empty_folder_accepted(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="full"):
        init_checkpoint("tiny", tmp_path / "full")
    (tmp_path / "empty").mkdir()
    assert (init_checkpoint("tiny", tmp_path / "empty") / "model.safetensors").is_file()


def test_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    def broken(self, folder, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(Qwen2_5_VLProcessor, "save_pretrained", broken)  # after the weights are written
    with pytest.raises(RuntimeError, match="disk full"):
        init_checkpoint("tiny", tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
