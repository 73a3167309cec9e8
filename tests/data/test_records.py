"""Video-R1 record loading: schema validation, skipped-row accounting, file-level errors."""

import json
import logging
import re
from pathlib import Path

import pytest

from rollplex.data.records import DatasetError, load_records, media_path, parse_record
from rollplex.types import Record

GOOD_MC = {
    "problem_id": 2,
    "problem": "What happens next?",
    "data_type": "video",
    "problem_type": "multiple choice",
    "options": ["A. stop", "B. turn"],
    "solution": "<answer>B</answer>",
    "path": "./LLaVA-Video-178K/videos/ytb_1.mp4",
    "data_source": "LLaVA-Video-178K/30_60_s_youtube_v0_1",
}
GOOD_NUM = {
    "problem_id": 9,
    "problem": "How many cubes?",
    "data_type": "image",
    "problem_type": "numerical",
    "solution": "<answer> 3 </answer>",
    "path": "./Spatial/img/9.png",
    "process": "<think>count</think>",
}


def write_json(path: Path, rows: list) -> Path:
    path.write_text(json.dumps(rows), encoding="utf-8")
    return path


def test_json_array_gives_records_in_order_with_defaults(tmp_path):
    records, skipped = load_records(write_json(tmp_path / "d.json", [GOOD_MC, GOOD_NUM]))
    assert skipped == 0
    mc = Record(
        2, "What happens next?", "video", "multiple choice", ("A. stop", "B. turn"), "<answer>B</answer>",
        "./LLaVA-Video-178K/videos/ytb_1.mp4", "LLaVA-Video-178K/30_60_s_youtube_v0_1",
    )  # fmt: skip
    num = Record(
        9, "How many cubes?", "image", "numerical", (), "<answer> 3 </answer>", "./Spatial/img/9.png", ""
    )
    assert records == [mc, num]


@pytest.mark.parametrize("name", ["d.jsonl", "d.json"])
def test_json_lines_by_extension_or_content(tmp_path, name):
    path = tmp_path / name
    path.write_text(json.dumps(GOOD_MC) + "\n\n" + json.dumps(GOOD_NUM) + "\n", encoding="utf-8")
    records, skipped = load_records(path)
    assert [r.problem_id for r in records] == [2, 9] and skipped == 0


def test_null_options_and_empty_data_source_are_accepted():
    record = parse_record({**GOOD_NUM, "options": None, "data_source": ""})
    assert record.options == () and record.data_source == ""
    assert parse_record({**GOOD_NUM, "options": []}).options == ()


BAD_ROWS = [
    ({**GOOD_MC, "data_type": "audio"}, "data_type"),
    ({**GOOD_MC, "problem_type": "Multiple Choice"}, "problem_type"),
    ({**GOOD_MC, "problem_type": "multiple-choice"}, "problem_type"),
    ({**GOOD_MC, "solution": "B"}, "solution"),
    ({**GOOD_MC, "solution": "<answer>B"}, "solution"),
    ({**GOOD_MC, "options": []}, "options"),
    ({k: v for k, v in GOOD_MC.items() if k != "options"}, "options"),
    ({**GOOD_MC, "options": "A. stop"}, "options"),
    ({**GOOD_MC, "options": ["A. stop", 3]}, "options"),
    ({**GOOD_MC, "problem_id": "2"}, "problem_id"),
    ({**GOOD_MC, "problem_id": True}, "problem_id"),
    ({**GOOD_MC, "problem": ""}, "problem"),
    ({k: v for k, v in GOOD_MC.items() if k != "path"}, "path"),
    ({**GOOD_MC, "path": "LLaVA-Video-178K/v.mp4"}, "path"),
    ({**GOOD_MC, "path": "./../secret.mp4"}, "path"),
    ({**GOOD_MC, "data_source": 5}, "data_source"),
]


@pytest.mark.parametrize(("row", "field"), BAD_ROWS)
def test_bad_record_is_skipped_counted_and_named(tmp_path, caplog, row, field):
    path = write_json(tmp_path / "d.json", [GOOD_NUM, row])
    with caplog.at_level(logging.WARNING, logger="rollplex.data.records"):
        records, skipped = load_records(path)
    assert [r.problem_id for r in records] == [9] and skipped == 1
    [message] = [r.getMessage() for r in caplog.records]
    assert "\n" not in message
    assert "record 1 " in message and f"problem_id={row.get('problem_id')!r}" in message
    assert field in message


def test_non_object_row_is_skipped(tmp_path, caplog):
    records, skipped = load_records(write_json(tmp_path / "d.json", [["not", "a", "record"], GOOD_NUM]))
    assert len(records) == 1 and skipped == 1
    assert "record 0 (problem_id=None)" in caplog.text


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ('[{"problem_id": 1,', "not valid JSON"),
        ("hello", "line 1 is not valid JSON"),
        (json.dumps(GOOD_MC) + "\n{oops\n", "line 2 is not valid JSON"),
        ("[]", "no valid record"),
        ("", "empty dataset file"),
        (json.dumps([{**GOOD_MC, "data_type": "audio"}]), "no valid record"),
        ("[1, 2]", "no valid record"),
    ],
)
def test_unusable_file_raises_dataset_error_naming_path(tmp_path, content, reason):
    path = tmp_path / "bad.json"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DatasetError, match=reason) as error:
        load_records(path)
    assert str(path) in str(error.value)


def test_json_object_instead_of_array_is_rejected(tmp_path):
    path = tmp_path / "obj.json"
    path.write_text(json.dumps({"rows": [GOOD_MC]}, indent=2), encoding="utf-8")
    with pytest.raises(DatasetError, match=re.escape(str(path))):
        load_records(path)


def test_missing_file_raises_dataset_error_which_is_a_value_error(tmp_path):
    path = tmp_path / "absent.json"
    with pytest.raises(ValueError, match=r"absent\.json"):
        load_records(path)
    assert issubclass(DatasetError, ValueError)


def test_media_path_drops_the_leading_dot_under_the_data_root(tmp_path):
    record = parse_record(GOOD_MC)
    assert media_path(record, tmp_path) == tmp_path / "LLaVA-Video-178K" / "videos" / "ytb_1.mp4"
    assert media_path(record, "Video-R1-data") == Path("Video-R1-data/LLaVA-Video-178K/videos/ytb_1.mp4")


def test_media_path_rejects_a_path_outside_the_root(tmp_path):
    record = Record(1, "q", "image", "numerical", (), "<answer>1</answer>", "/etc/passwd", "")
    with pytest.raises(ValueError, match="path"):
        media_path(record, tmp_path)
