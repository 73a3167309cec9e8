"""The locally built tokenizer and processor: id layout, special tokens, chat template, vision expansion.

Expected ids are the published Qwen2.5-VL ones (docs/qwen2.5-vl.md, "Published sizes"), written
out here by hand; the chat layout follows (docs/video-r1-format.md, "Prompt construction").
"""

from __future__ import annotations

import json

import pytest
import torch

from rollplex.models.tokenizer import (
    QWEN_ADDED_TOKENS,
    build_image_processor,
    build_processor,
    build_tokenizer,
    train_merges,
    vocab_size,
)

REAL = "qwen2.5-vl-3b"
PUBLISHED_IDS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|object_ref_start|>": 151646,
    "<|object_ref_end|>": 151647,
    "<|box_start|>": 151648,
    "<|box_end|>": 151649,
    "<|quad_start|>": 151650,
    "<|quad_end|>": 151651,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
    "<tool_call>": 151657,
    "</tool_call>": 151658,
    "<|fim_prefix|>": 151659,
    "<|fim_middle|>": 151660,
    "<|fim_suffix|>": 151661,
    "<|fim_pad|>": 151662,
    "<|repo_name|>": 151663,
    "<|file_sep|>": 151664,
}
NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"}
NOT_SPECIAL |= {"<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
VIDEO_LAYOUT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "<|vision_start|><|video_pad|><|vision_end|>What colour is the cube?<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def real():
    return build_tokenizer(REAL)


@pytest.fixture(scope="module")
def tiny():
    return build_tokenizer("tiny")


def _user(kind: str, text: str = "What colour is the cube?") -> list[dict]:
    return [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": text}]}]


def test_vocab_sizes():
    assert vocab_size("tiny") == 448
    assert vocab_size("qwen2.5-vl-3b") == 151936
    assert vocab_size("qwen2.5-vl-7b") == 152064
    assert vocab_size("qwen2.5-vl-32b") == 152064
    with pytest.raises(ValueError, match="qwen2.5-vl-72b"):
        vocab_size("qwen2.5-vl-72b")
    with pytest.raises(ValueError, match="'big'"):
        build_tokenizer("big")


def test_real_special_tokens_at_published_ids(real):
    assert real.convert_tokens_to_ids(list(PUBLISHED_IDS)) == list(PUBLISHED_IDS.values())
    for token, i in PUBLISHED_IDS.items():
        assert real.added_tokens_decoder[i].content == token
        assert real.added_tokens_decoder[i].special == (token not in NOT_SPECIAL)
    assert (real.eos_token, real.eos_token_id) == ("<|im_end|>", 151645)
    assert (real.pad_token, real.pad_token_id) == ("<|endoftext|>", 151643)
    assert real.bos_token is None


def test_real_vocabulary_fills_every_id(real):
    assert len(real) == 151936
    assert sorted(real.get_vocab().values()) == list(range(151936))
    assert real.decode([151700]) == "<|reserved_151700|>"
    assert real.decode([1000]) == "<|reserved_1000|>"


def test_larger_real_vocabulary_keeps_the_same_special_ids():
    tokenizer = build_tokenizer("qwen2.5-vl-7b")
    assert len(tokenizer) == 152064
    assert tokenizer.convert_tokens_to_ids(list(PUBLISHED_IDS)) == list(PUBLISHED_IDS.values())
    assert tokenizer.convert_ids_to_tokens(152063) == "<|reserved_152063|>"


def test_tiny_vocabulary_is_small_and_complete(tiny):
    assert len(tiny) == 448
    assert sorted(tiny.get_vocab().values()) == list(range(448))
    assert tiny.convert_tokens_to_ids(list(QWEN_ADDED_TOKENS)) == list(range(426, 448))
    assert (tiny.eos_token_id, tiny.pad_token_id) == (428, 426)
    assert tiny.convert_tokens_to_ids("<|video_pad|>") == 439


@pytest.mark.parametrize("symbol", list("ABCDE0123456789"))
@pytest.mark.parametrize("context", ["{}", "<answer>{}</answer>", " {}", "{}. red", "Options:\n{}. blue\n"])
def test_option_letters_and_digits_are_single_tokens(tiny, symbol, context):
    (symbol_id,) = tiny.encode(symbol)
    ids = tiny.encode(context.format(symbol))
    assert symbol_id in ids
    assert tiny.decode(ids) == context.format(symbol)


def test_answer_tags_tokenize_around_the_letter(tiny):
    tokens = tiny.convert_ids_to_tokens(tiny.encode("<answer>B</answer>"))
    assert tokens == ["<", "answer", ">", "B", "</", "answer", ">"]


def test_fillers_are_never_produced_by_encoding(real):
    ids = real.encode("<|reserved_500|> <|reserved_151700|>")
    assert max(ids) < 426
    assert real.decode(ids) == "<|reserved_500|> <|reserved_151700|>"


@pytest.mark.parametrize(
    "text", ["What colour is the largest cube?", "naïve café, 你好 🙂\n\t x", "3.14 or 42"]
)
def test_decode_inverts_encode(tiny, real, text):
    assert tiny.decode(tiny.encode(text)) == text
    assert real.decode(real.encode(text)) == text


def test_special_tokens_are_matched_whole_and_skipped_on_decode(real):
    text = "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>Hi<|im_end|><tool_call>"
    ids = real.encode(text)
    start = ids.index(151652)
    assert ids[0] == 151644 and ids[start : start + 3] == [151652, 151656, 151653]
    assert ids[-2:] == [151645, 151657]
    assert real.decode(ids, skip_special_tokens=True) == "user\nHi<tool_call>"


def test_chat_template_layout_video(real):
    text = real.apply_chat_template(_user("video"), tokenize=False, add_generation_prompt=True)
    assert text == VIDEO_LAYOUT
    ids = real.encode(text)
    tail = [151644, *real.encode("assistant\n")]
    assert ids[:1] == [151644] and ids[-len(tail) :] == tail
    assert ids.count(151644) == 3 and ids.count(151645) == 2
    assert ids.count(151656) == 1 and ids[ids.index(151656) - 1] == 151652


def test_chat_template_layout_image_and_system(tiny):
    text = tiny.apply_chat_template(_user("image", "Q"), tokenize=False, add_generation_prompt=True)
    assert text == VIDEO_LAYOUT.replace("video_pad", "image_pad").replace("What colour is the cube?", "Q")
    messages = [{"role": "system", "content": "S"}, *_user("video", "Q")]
    text = tiny.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    expected = (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>Q"
    )
    assert text == expected + "<|im_end|>\n"


@pytest.mark.parametrize("frames, height, width, grid", [(4, 56, 84, (2, 4, 6)), (6, 56, 56, (3, 4, 4))])
def test_processor_expands_video_pad(frames, height, width, grid):
    processor = build_processor("tiny")
    video = torch.zeros(frames, 3, height, width, dtype=torch.uint8)
    video[:, 0] = 255
    text = processor.apply_chat_template(_user("video"), tokenize=False, add_generation_prompt=True)
    batch = processor(text=[text], videos=[video], return_tensors="pt")
    t, h, w = grid
    assert batch["video_grid_thw"].tolist() == [[t, h, w]]
    assert int((batch["input_ids"] == 439).sum()) == t * h * w // 4
    rows = batch["pixel_values_videos"]
    assert rows.shape == (t * h * w, 3 * 2 * 14 * 14)
    red = (1.0 - CLIP_MEAN[0]) / CLIP_STD[0]
    green = (0.0 - CLIP_MEAN[1]) / CLIP_STD[1]
    torch.testing.assert_close(rows[:, :392], torch.full((t * h * w, 392), red), rtol=0, atol=1e-5)
    torch.testing.assert_close(rows[:, 392:784], torch.full((t * h * w, 392), green), rtol=0, atol=1e-5)


def test_processor_image_grid_and_video_settings():
    processor = build_processor("tiny")
    text = processor.apply_chat_template(_user("image"), tokenize=False, add_generation_prompt=True)
    batch = processor(text=[text], images=[torch.zeros(3, 56, 84, dtype=torch.uint8)], return_tensors="pt")
    assert batch["image_grid_thw"].tolist() == [[1, 4, 6]]
    assert int((batch["input_ids"] == 438).sum()) == 6
    assert processor.video_processor.do_sample_frames is False
    image = build_image_processor()
    assert (image.patch_size, image.merge_size, image.temporal_patch_size) == (14, 2, 2)
    assert dict(image.size) == {"shortest_edge": 3136, "longest_edge": 12845056}


def test_merge_training_is_deterministic():
    """Every training run hashes words with a fresh randomly seeded map (also within one process), so
    repeated runs would disagree if frequency ties were broken by hash order."""
    runs = [json.dumps(train_merges()) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    vocab, merges = train_merges()
    assert len(vocab) == 426 and len(merges) >= 170
    assert sorted(vocab.values()) == list(range(426))


def test_merges_never_absorb_option_letters():
    corpus = ["AB AB CD CD <answer>B</answer> Ed Ed"] * 20  # unfiltered: AB, CD, Ed come first
    vocab, merges = train_merges(corpus, num_tokens=262)
    assert len(vocab) == 262
    assert not [a + b for a, b in merges if set(a + b) & set("ABCDE")]
    assert "answer" in vocab
    with pytest.raises(ValueError, match="num_tokens=400"):
        train_merges(corpus, num_tokens=400)
