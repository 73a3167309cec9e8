"""What a model folder (``model.path``) must hold, checked before anything is loaded from it.

A run loads from one Hugging Face model folder, as ``save_pretrained`` writes it and as the hub's
Qwen2.5-VL repositories hold it: ``config.json`` (the architecture; ``model_type`` ``qwen2_5_vl``), the
weights (``model.safetensors``, or shards named by ``model.safetensors.index.json``; the older
``pytorch_model.bin`` forms too), the tokenizer (``tokenizer.json``, or ``vocab.json`` with
``merges.txt``, and ``tokenizer_config.json``), the image and video processor settings
(``preprocessor_config.json`` or, as transformers 5 writes them, ``processor_config.json``) and a chat
template (``chat_template.jinja``, ``chat_template.json``, or a ``chat_template`` entry of
``tokenizer_config.json`` or ``processor_config.json``). ``generation_config.json`` is optional (the EOS
ids then come from the tokenizer).

Without this check each of these fails late, deep in a load, or not at all: a corrupt ``config.json``
surfaces as a bare JSON parser message, a folder of another architecture (``llama``) is loaded into the
Qwen2.5-VL classes and trains, and a folder without ``tokenizer.json`` loads a tokenizer of its special
tokens alone, which encodes every prompt's text as nothing (transformers 5.25). ``check_model_folder``
reads only small JSON files, before a model or processor is built.
"""

from __future__ import annotations

import json
from pathlib import Path

CONFIG_FILE = "config.json"
SUPPORTED_MODEL_TYPES = ("qwen2_5_vl",)  # transformers' Qwen2_5_VLConfig.model_type
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
_TOKENIZER_CONFIG = "tokenizer_config.json"
_CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
_TEMPLATE_HOLDERS = (_TOKENIZER_CONFIG, "processor_config.json")  # files that may hold the template itself


def _read_json(file: Path) -> dict:
    """The JSON object in ``file``.

    Raises:
        ValueError: ``file`` is not UTF-8 JSON, or holds something other than an object; the message
            names the file (and the line and column of a syntax error).
    """
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{file} is not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}"
        ) from None
    except UnicodeDecodeError:
        raise ValueError(f"{file} is not valid JSON: not UTF-8 text") from None
    if not isinstance(value, dict):
        raise ValueError(f"{file} is not a model configuration: expected a JSON object, got {value!r:.60}")
    return value


def read_model_config(path: str | Path) -> dict:
    """The parsed ``config.json`` of the model folder ``path`` (the architecture: ``model_type``,
    ``text_config``, ``vision_config``, token ids), as transformers' ``PretrainedConfig`` reads it,
    without building a config object or checking the architecture.

    Raises:
        ValueError: ``path`` is not a folder, has no ``config.json``, or that file is not a JSON object.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder (a Hugging Face model folder is expected)")
    file = folder / CONFIG_FILE
    if not file.is_file():
        raise ValueError(f"{folder} is not a Hugging Face model folder (no {CONFIG_FILE})")
    return _read_json(file)


def check_model_folder(path: str | Path) -> None:
    """Check that ``path`` is a Qwen2.5-VL model folder a run can load (the files in the module
    docstring), reading only its small JSON files.

    Raises:
        ValueError: ``read_model_config``'s errors; a ``model_type`` other than
            ``SUPPORTED_MODEL_TYPES`` (named with the supported ones); a missing file, named with what
            would stand for it (every missing one in one message); a weight index or
            ``tokenizer_config.json`` that is not valid JSON.
    """
    folder = Path(path)
    _check_model_type(folder, read_model_config(folder))
    missing = _missing_weights(folder) + _missing_tokenizer(folder) + _missing_processor(folder)
    if missing:
        raise ValueError(f"{folder} lacks files a run loads: {'; '.join(missing)}")


def _check_model_type(folder: Path, config: dict) -> None:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        got = f"model_type {model_type!r}" if model_type is not None else "no model_type"
        raise ValueError(
            f"{folder / CONFIG_FILE} has {got}: rollplex trains Qwen2.5-VL models "
            f"(model_type {', '.join(SUPPORTED_MODEL_TYPES)})"
        )


def _has(folder: Path, *names: str) -> bool:
    """Whether ``folder`` holds a file of any of ``names``."""
    return any((folder / name).is_file() for name in names)


def _missing_weights(folder: Path) -> list[str]:
    """What is missing of the weights: all of them, or the shards that an index names."""
    if _has(folder, *_WEIGHT_FILES):
        return []
    for index in _WEIGHT_INDEXES:
        if (folder / index).is_file():
            shards = sorted(set(_read_json(folder / index).get("weight_map", {}).values()))
            absent = [name for name in shards if not (folder / name).is_file()]
            return [f"weight shards named by {index}: {', '.join(absent)}"] if absent else []
    return ["the weights (model.safetensors, or model.safetensors.index.json and its shards)"]


def _missing_tokenizer(folder: Path) -> list[str]:
    missing = []
    if not _has(folder, "tokenizer.json") and not all(_has(folder, n) for n in ("vocab.json", "merges.txt")):
        missing.append("the tokenizer's vocabulary (tokenizer.json, or vocab.json and merges.txt)")
    if not _has(folder, _TOKENIZER_CONFIG):
        missing.append(f"{_TOKENIZER_CONFIG} (the tokenizer's special tokens: EOS, padding)")
    return missing


def _missing_processor(folder: Path) -> list[str]:
    missing = []
    if not _has(folder, *_PROCESSOR_FILES):
        missing.append(f"the image and video processor settings ({' or '.join(_PROCESSOR_FILES)})")
    if not _has_chat_template(folder):
        missing.append(
            f"a chat template ({', '.join(_CHAT_TEMPLATE_FILES)}, or a chat_template entry in "
            f"{' or '.join(_TEMPLATE_HOLDERS)})"
        )
    return missing


def _has_chat_template(folder: Path) -> bool:
    if _has(folder, *_CHAT_TEMPLATE_FILES):
        return True
    return any(
        _has(folder, name) and "chat_template" in _read_json(folder / name) for name in _TEMPLATE_HOLDERS
    )
