"""A Qwen2.5-VL tokenizer and processor built locally, without downloading anything.

The text side is a byte-level BPE with the Qwen2 pipeline (NFC, the Qwen2 split regex, byte-level
alphabet, byte-level decoder: the same pipeline ``transformers.Qwen2Tokenizer`` rebuilds on load). Its
merges are trained with the ``tokenizers`` library on a small built-in English corpus of the Video-R1
task (chat scaffolding, the question template, colours, shapes, counts, directions, ``<think>`` /
``<answer>`` tags). Merges that would glue the option letters A–E to anything are dropped, and digits
are split one per token by the split regex, so every option letter and digit is always its own token.

Id layout (no gaps: every id in ``[0, vocab_size)`` decodes):

    tiny:   [0, 426) trained BPE (256 byte symbols, then merges) | [426, 448) the 22 Qwen added tokens
    real:   [0, 426) trained BPE | [426, 151643) unreachable fillers ``<|reserved_ID|>`` |
            [151643, 151665) the 22 Qwen added tokens at their real ids | fillers up to vocab_size

Fillers sit in the BPE vocabulary without merges that produce them, so encoding never emits them. The
Qwen added tokens, their ids and which of them are special follow the published
``tokenizer_config.json`` of Qwen2.5-VL (docs/qwen2.5-vl.md, "Published sizes"): 151643
``<|endoftext|>`` (pad) … 151645 ``<|im_end|>`` (eos) … 151652–151656 vision tokens; the tool-call and
fill-in-the-middle tokens 151657–151664 are added but not special. The chat template is the Qwen2-VL
template (docs/video-r1-format.md, "Prompt construction"). The processor uses patch 14, merge 2, temporal
patch 2, CLIP mean/std, pixel bounds 3136 … 12,845,056, and never resamples video frames.
"""

from __future__ import annotations

import json

from tokenizers import AddedToken, Regex, Tokenizer, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2_5_VLProcessor,
    Qwen2Tokenizer,
    Qwen2VLImageProcessor,
    Qwen2VLVideoProcessor,
)

TINY = "tiny"
REAL_VOCAB_SIZES = {"qwen2.5-vl-3b": 151936, "qwen2.5-vl-7b": 152064, "qwen2.5-vl-32b": 152064}
QWEN_BASE_VOCAB = 151643
TRAINED_TOKENS = 426
QWEN_ADDED_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)
NUM_SPECIAL = 14  # the first 14 added tokens are special; the tool/FIM tokens are not
EOS_TOKEN, PAD_TOKEN = "<|im_end|>", "<|endoftext|>"
PROTECTED = frozenset("ABCDE")
MODEL_MAX_LENGTH = 131072
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MIN_PIXELS, MAX_PIXELS = 3136, 12845056
PATCH, MERGE, TEMPORAL_PATCH = 14, 2, 2
SPLIT_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

QUESTION_TEMPLATE = (
    "{Question}\nPlease think about this question as if you were a human pondering deeply. Engage in an "
    "internal dialogue using expressions such as 'let me think', 'wait', 'Hmm', 'oh, I see', 'let's break it "
    "down', etc, or other natural language thought expressions It's encouraged to include self-reflection or "
    "verification in the reasoning process. Provide your detailed reasoning between the <think> </think> "
    "tags, and then give your final answer between the <answer> </answer> tags."
)
TYPE_SUFFIXES = (
    " Please provide only the single option letter (e.g., A, B, C, D, etc.) within the <answer> </answer> tags.",
    " Please provide the numerical value (e.g., 42 or 3.14) within the <answer> </answer> tags.",
    " Please transcribe text from the image/video clearly and provide your text answer within the "
    "<answer> </answer> tags.",
    " Please provide your text answer within the <answer> </answer> tags.",
)
COLOURS = ("red", "blue", "green", "yellow", "purple", "cyan", "gray", "brown", "orange", "black", "white")
SHAPES = ("cube", "sphere", "cylinder", "cone", "square", "circle", "triangle", "ball", "box")
COUNTS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
DIRECTIONS = ("left", "right", "up", "down", "forward", "backward", "clockwise", "towards the camera")
SIZES = ("largest", "smallest", "big", "small")
LETTERS = ("A", "B", "C", "D", "E")


VOCAB_SIZES = {TINY: TRAINED_TOKENS + len(QWEN_ADDED_TOKENS), **REAL_VOCAB_SIZES}


def _check_preset(preset: str) -> None:
    if preset not in VOCAB_SIZES:
        raise ValueError(f"unknown model preset {preset!r}; expected one of {', '.join(VOCAB_SIZES)}")


def vocab_size(preset: str) -> int:
    """Number of token ids of ``preset``'s vocabulary: 448 for ``tiny``, 151936 (3B) or 152064 (7B/32B).

    Source: the published sizes (docs/qwen2.5-vl.md, "Published sizes"); tiny = 426 trained tokens + 22 Qwen
    added tokens.

    Raises:
        ValueError: unknown preset name.
    """
    _check_preset(preset)
    return VOCAB_SIZES[preset]


def added_token_ids(preset: str) -> dict[str, int]:
    """Id of each of the 22 Qwen added tokens in ``preset``'s vocabulary (token text -> id).

    Real presets: the published ids 151643 ``<|endoftext|>`` … 151664 ``<|file_sep|>`` (docs/qwen2.5-vl.md,
    "Published sizes"); tiny: the same order starting at 426. ``build_tokenizer(preset)`` assigns exactly
    these ids.

    Raises:
        ValueError: unknown preset name.
    """
    _check_preset(preset)
    base = TRAINED_TOKENS if preset == TINY else QWEN_BASE_VOCAB
    return {token: base + i for i, token in enumerate(QWEN_ADDED_TOKENS)}


def training_corpus() -> list[str]:
    """The built-in English corpus the merges are trained on (deterministic, about 1,700 lines).

    Chat scaffolding, the Video-R1 question template and answer-type suffixes (docs/video-r1-format.md,
    "Prompt construction"), question sentences over colours × shapes × directions × sizes, counts and
    option lists, and ``<think>`` / ``<answer>`` completions.
    """
    lines = ["system\nYou are a helpful assistant.\nuser\n", "assistant\n", QUESTION_TEMPLATE, *TYPE_SUFFIXES]
    for i, colour in enumerate(COLOURS):
        for j, shape in enumerate(SHAPES):
            direction = DIRECTIONS[(i + j) % len(DIRECTIONS)]
            count = COUNTS[(i * len(SHAPES) + j) % len(COUNTS)]
            size = SIZES[(i + 2 * j) % len(SIZES)]
            lines += [
                f"What colour is the {shape}? Which {shape} is {colour}? Is the {colour} {shape} moving {direction}?",
                f"How many {colour} objects are there? There are {count} {colour} {shape}s in the video.",
                f"<think>Let me think. The {colour} {shape} moves {direction}.</think>",
                f"What color is the {size} shape? The {size} object in the first frame is a {colour} {shape}.",
            ]
    for k, letter in enumerate(LETTERS):
        options = "".join(f"{x}. {COLOURS[(k + n) % len(COLOURS)]}\n" for n, x in enumerate(LETTERS[:4]))
        lines += [f"Options:\n{options}", f"<answer>{letter}</answer>", f"<answer>{k}</answer>"]
    return lines * 4


def _pipeline(model: BPE) -> Tokenizer:
    """A tokenizers.Tokenizer with the Qwen2 normalizer and pre-tokenizer around ``model``."""
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    return tokenizer


def train_merges(
    corpus: list[str] | None = None, num_tokens: int = TRAINED_TOKENS
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Trained byte-level BPE: (vocab of exactly ``num_tokens`` tokens, merges in priority order).

    ``tokenizers.trainers.BpeTrainer`` over ``corpus`` (default ``training_corpus()``) with the 256-symbol
    byte-level alphabet; merges whose result contains an option letter A–E are dropped (with every merge
    that builds on them), then merges are kept until the vocabulary has ``num_tokens`` entries (426 = 256
    symbols + 170 merges for the built-in corpus). The trainer breaks frequency ties by pair id, so the result
    does not depend on hash order and is the same in every process.

    Raises:
        ValueError: the corpus yields fewer than ``num_tokens`` tokens.
    """
    tokenizer = _pipeline(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=4 * num_tokens, min_frequency=2, initial_alphabet=alphabet, show_progress=False
    )
    tokenizer.train_from_iterator(training_corpus() if corpus is None else corpus, trainer=trainer)
    model = json.loads(tokenizer.to_str())["model"]
    symbols = sorted((t for t in model["vocab"] if len(t) == 1), key=model["vocab"].get)
    assert len(symbols) == len(alphabet)
    vocab = {symbol: i for i, symbol in enumerate(symbols)}
    merges: list[tuple[str, str]] = []
    for left, right in model["merges"]:
        merged = left + right
        if len(vocab) == num_tokens:
            break
        if left in vocab and right in vocab and not PROTECTED & set(merged):
            vocab.setdefault(merged, len(vocab))
            merges.append((left, right))
    if len(vocab) != num_tokens:
        raise ValueError(f"the corpus yields {len(vocab)} tokens, fewer than num_tokens={num_tokens}")
    return vocab, merges


def _full_vocab(preset: str, trained: dict[str, int]) -> dict[str, int]:
    """Trained tokens, fillers and the Qwen added tokens at ``added_token_ids(preset)``: ids 0..V-1."""
    vocab = dict(trained)
    taken = {i: token for token, i in added_token_ids(preset).items()}
    for i in range(len(trained), vocab_size(preset)):
        vocab[taken.get(i, f"<|reserved_{i}|>")] = i
    return vocab


def build_tokenizer(preset: str) -> PreTrainedTokenizerFast:
    """The locally built tokenizer of ``preset`` (a ``transformers.Qwen2Tokenizer``, tokenizers-backed).

    ``len(tokenizer) == vocab_size(preset)``; the Qwen added tokens sit at ``added_token_ids(preset)`` (the
    first 14 special, the tool/FIM tokens plain added tokens); eos ``<|im_end|>``, pad ``<|endoftext|>``, no
    bos token is prepended; the chat template is ``CHAT_TEMPLATE``. A real preset builds a 151k-entry
    vocabulary; the result is a fresh object each call.

    Raises:
        ValueError: unknown preset name.
    """
    _check_preset(preset)
    trained, merges = train_merges()
    tokenizer = Qwen2Tokenizer(
        vocab=_full_vocab(preset, trained),
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens=list(QWEN_ADDED_TOKENS[1:NUM_SPECIAL]),
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=i < NUM_SPECIAL, normalized=False) for i, t in enumerate(QWEN_ADDED_TOKENS)]
    )
    assert len(tokenizer) == vocab_size(preset)
    return tokenizer


def build_image_processor() -> Qwen2VLImageProcessor:
    """Image processor: patch 14, merge 2, temporal patch 2, CLIP mean/std, 3136 … 12,845,056 pixels,
    bicubic (published ``preprocessor_config.json``; docs/qwen2.5-vl.md, "Published sizes")."""
    return Qwen2VLImageProcessor(**_pixel_kwargs())


def build_video_processor() -> Qwen2VLVideoProcessor:
    """Video processor with the image processor's settings; it never resamples frames
    (``do_sample_frames=False``) and applies no total-video pixel cap (frames arrive already sized)."""
    return Qwen2VLVideoProcessor(**_pixel_kwargs(), do_sample_frames=False, cap_pixels_per_frame=False)


def _pixel_kwargs() -> dict:
    return dict(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        patch_size=PATCH,
        temporal_patch_size=TEMPORAL_PATCH,
        merge_size=MERGE,
        image_mean=list(CLIP_MEAN),
        image_std=list(CLIP_STD),
        do_resize=True,
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        do_convert_rgb=True,
    )


def build_processor(preset: str) -> Qwen2_5_VLProcessor:
    """``Qwen2_5_VLProcessor`` of ``preset``: image and video processors, tokenizer, chat template.

    A uint8 video of T frames [T, 3, H, W] (T even, else the last frame is repeated; H, W multiples of 28
    within the pixel bounds, so no resize happens) becomes
    ``pixel_values_videos`` float32 [T/2·H/14·W/14, 1176] with ``video_grid_thw`` (T/2, H/14, W/14), and its
    ``<|video_pad|>`` is expanded to T/2·H/28·W/28 tokens (docs/qwen2.5-vl.md, "Processor video inputs").

    Raises:
        ValueError: unknown preset name.
    """
    return Qwen2_5_VLProcessor(
        image_processor=build_image_processor(),
        tokenizer=build_tokenizer(preset),
        video_processor=build_video_processor(),
        chat_template=CHAT_TEMPLATE,
    )
