"""The model folder check (models.folder) on small folders of stub files, one per fault a user meets,
and on the tiny preset's checkpoint, which a run loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollplex.models.folder import check_model_folder, read_model_config
from rollplex.models.presets import init_checkpoint

_FILES = {
    "config.json": json.dumps({"model_type": "qwen2_5_vl", "image_token_id": 151655}),
    "model.safetensors": "",
    "tokenizer.json": "{}",
    "tokenizer_config.json": "{}",
    "processor_config.json": "{}",
    "chat_template.jinja": "{{ messages }}",
}


def _folder(root: Path, drop: tuple[str, ...] = (), **replace: str) -> Path:
    """A folder of the files a run looks for, without ``drop``, with ``replace`` (name: text)."""
    folder = root / "model"
    folder.mkdir()
    for name, text in {**_FILES, **replace}.items():
        if name not in drop:
            (folder / name).write_text(text)
    return folder


def test_a_complete_folder_passes_and_its_config_is_read(tmp_path):
    folder = _folder(tmp_path)
    check_model_folder(folder)
    assert read_model_config(str(folder)) == json.loads(_FILES["config.json"])


def test_the_tiny_preset_checkpoint_passes(tmp_path):
    folder = init_checkpoint("tiny", tmp_path / "tiny", seed=0)
    check_model_folder(folder)
    assert read_model_config(folder)["model_type"] == "qwen2_5_vl"


def test_a_corrupt_config_json_is_named_with_the_line(tmp_path):
    folder = _folder(tmp_path, **{"config.json": '{"model_type": "qwen2_5_vl",\n'})
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON: .* line 2, column 1") as info:
        check_model_folder(folder)
    assert str(folder / "config.json") in str(info.value)


def test_a_config_json_that_is_not_an_object_is_refused(tmp_path):
    with pytest.raises(
        ValueError, match=r"config\.json is not a model configuration: expected a JSON object"
    ):
        read_model_config(_folder(tmp_path, **{"config.json": "[1, 2]"}))


def test_a_folder_without_config_json_is_not_a_model_folder(tmp_path):
    folder = _folder(tmp_path, drop=("config.json",))
    with pytest.raises(ValueError) as info:
        check_model_folder(folder)
    assert str(info.value) == f"{folder} is not a Hugging Face model folder (no config.json)"
    with pytest.raises(ValueError, match="is not a folder"):
        read_model_config(folder / "model.safetensors")


@pytest.mark.parametrize(
    ("config", "got"), [({"model_type": "llama"}, "model_type 'llama'"), ({}, "no model_type")]
)
def test_another_architecture_is_refused_naming_the_supported_types(tmp_path, config, got):
    folder = _folder(tmp_path, **{"config.json": json.dumps(config)})
    with pytest.raises(
        ValueError, match=f"{got}: rollplex trains Qwen2.5-VL models \\(model_type qwen2_5_vl\\)"
    ):
        check_model_folder(folder)


@pytest.mark.parametrize(
    ("drop", "named"),
    [
        (("tokenizer.json",), "the tokenizer's vocabulary (tokenizer.json, or vocab.json and merges.txt)"),
        (("tokenizer_config.json",), "tokenizer_config.json (the tokenizer's special tokens"),
        (
            ("processor_config.json",),
            "processor settings (preprocessor_config.json or processor_config.json)",
        ),
        (("chat_template.jinja",), "a chat template (chat_template.jinja, chat_template.json"),
        (("model.safetensors",), "the weights (model.safetensors, or model.safetensors.index.json"),
    ],
)
def test_a_missing_tokenizer_processor_or_weight_file_is_named(tmp_path, drop, named):
    with pytest.raises(ValueError, match="lacks files a run loads: ") as info:
        check_model_folder(_folder(tmp_path, drop=drop))
    assert named in str(info.value)
    assert ";" not in str(info.value)  # only what is missing


def test_every_missing_file_is_named_at_once(tmp_path):
    drop = ("tokenizer.json", "processor_config.json")
    with pytest.raises(ValueError) as info:
        check_model_folder(_folder(tmp_path, drop=drop))
    assert "tokenizer.json" in str(info.value) and "preprocessor_config.json" in str(info.value)


def test_the_other_forms_of_each_file_are_accepted(tmp_path):
    """The hub's Qwen2.5-VL repositories: vocab.json and merges.txt beside tokenizer.json, the processor
    in preprocessor_config.json, the template in tokenizer_config.json, weights in shards."""
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    hub = {
        "vocab.json": "{}",
        "merges.txt": "",
        "preprocessor_config.json": "{}",
        "tokenizer_config.json": json.dumps({"chat_template": "{{ messages }}"}),
        "model.safetensors.index.json": json.dumps(index),
        "model-00001-of-00002.safetensors": "",
    }
    drop = ("tokenizer.json", "processor_config.json", "chat_template.jinja", "model.safetensors")
    folder = _folder(tmp_path, drop=drop, **hub)
    with pytest.raises(
        ValueError, match=r"weight shards named by model\.safetensors\.index\.json: model-00002-of"
    ):
        check_model_folder(folder)
    (folder / "model-00002-of-00002.safetensors").write_text("")
    check_model_folder(folder)
    (folder / "merges.txt").unlink()
    with pytest.raises(ValueError, match="tokenizer's vocabulary"):
        check_model_folder(folder)
