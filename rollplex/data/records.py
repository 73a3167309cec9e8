"""Video-R1 dataset records: reading a dataset file and validating each row (docs/video-r1-format.md,
"Files and layout" and "Record schema").

A dataset file is one JSON array of objects (``Video-R1-260k.json``) or JSON Lines (one object per
line). Every row is checked against the record schema; a row that fails is skipped with a one-line
warning naming its index, its ``problem_id`` and the reason, and counted. A file that cannot be read
or parsed, or that leaves no usable record, raises :class:`DatasetError`.

Example:
    records, skipped = load_records(Path("Video-R1-260k.json"))
    video = media_path(records[0], Path("Video-R1-data"))   # Video-R1-data/LLaVA-Video-178K/...mp4
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path, PurePosixPath

from rollplex.types import Record

logger = logging.getLogger(__name__)

DATA_TYPES = ("video", "image")
PROBLEM_TYPES = ("multiple choice", "numerical", "OCR", "free-form", "regression")
# Answer extraction regex of the Video-R1 reward (docs/video-r1-format.md, "Rewards"), applied to
# ``solution``.
ANSWER_PATTERN = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)
_TEXT_FIELDS = ("problem", "data_type", "problem_type", "solution", "path")


class DatasetError(ValueError):
    """A dataset file as a whole is unusable: missing, not JSON / JSON Lines, or no valid record."""


class RecordError(ValueError):
    """One row of a dataset file violates the record schema; the message names the field."""


def parse_record(row: object) -> Record:
    """Validate one decoded JSON row and return it as a :class:`Record` (docs/video-r1-format.md,
    "Record schema").

    Rules: ``problem_id`` is an int (not a bool); ``problem``, ``data_type``, ``problem_type``,
    ``solution`` and ``path`` are non-empty strings; ``data_type`` is ``"video"`` or ``"image"``;
    ``problem_type`` is one of :data:`PROBLEM_TYPES` (exact case and spacing); ``solution`` contains an
    ``<answer>…</answer>`` block; ``path`` starts with ``"./"`` and has no ``..`` component;
    ``options`` is a list of strings, and may be missing or null (-> ``()``) unless the problem is
    multiple choice, which needs at least one option; ``data_source`` is a string, and missing, null
    or empty becomes ``""``. Other keys (e.g. ``process`` of the CoT file) are ignored.

    Raises:
        RecordError: naming the first offending field and its value.
    """
    if not isinstance(row, dict):
        raise RecordError(f"record must be a JSON object, got {type(row).__name__}")
    problem_id = row.get("problem_id")
    if not isinstance(problem_id, int) or isinstance(problem_id, bool):
        raise RecordError(f"problem_id must be an int, got {problem_id!r}")
    for name in _TEXT_FIELDS:
        value = row.get(name)
        if not isinstance(value, str) or not value.strip():
            raise RecordError(f"{name} must be a non-empty string, got {value!r}")
    if row["data_type"] not in DATA_TYPES:
        raise RecordError(f"data_type {row['data_type']!r} is not one of {DATA_TYPES}")
    if row["problem_type"] not in PROBLEM_TYPES:
        raise RecordError(f"problem_type {row['problem_type']!r} is not one of {PROBLEM_TYPES}")
    if ANSWER_PATTERN.search(row["solution"]) is None:
        raise RecordError(f"solution {row['solution']!r} has no <answer>...</answer> block")
    _check_media_path(row["path"])
    return Record(
        problem_id=problem_id,
        problem=row["problem"],
        data_type=row["data_type"],
        problem_type=row["problem_type"],
        options=_parse_options(row.get("options"), row["problem_type"]),
        solution=row["solution"],
        path=row["path"],
        data_source=_parse_data_source(row.get("data_source")),
    )


def load_records(path: Path | str) -> tuple[list[Record], int]:
    """Read a Video-R1 dataset file and return its valid records and the number skipped.

    The format is JSON Lines when the extension is ``.jsonl`` or the content does not start with
    ``[``; otherwise one JSON array (the reference loader accepts both: docs/video-r1-format.md,
    "Files and layout"). Records keep file order. Each invalid row is logged (``logging.WARNING`` on this
    module's logger) as ``"<path>: record <index> (problem_id=<id>) skipped: <reason>"`` and counted.

    Returns:
        (records, skipped): the validated records and the count of skipped rows.

    Raises:
        DatasetError: the file is missing or unreadable, is not valid JSON / JSON Lines (the message
            gives the line of the first bad JSON Lines row), is JSON but not an array, or contains no
            valid record. The message names the path.
    """
    path = Path(path)
    rows = _read_rows(path)
    records: list[Record] = []
    for index, row in enumerate(rows):
        try:
            records.append(parse_record(row))
        except RecordError as error:
            problem_id = row.get("problem_id") if isinstance(row, dict) else None
            logger.warning("%s: record %d (problem_id=%r) skipped: %s", path, index, problem_id, error)
    skipped = len(rows) - len(records)
    if not records:
        raise DatasetError(f"{path}: no valid record ({len(rows)} rows, {skipped} skipped)")
    return records, skipped


def media_path(record: Record, data_root: Path | str) -> Path:
    """Absolute-or-relative media path of ``record``: its ``path`` field resolved under ``data_root``.

    Follows the reference trainer (docs/video-r1-format.md, "Files and layout"): the leading ``.`` of
    ``"./Folder/..."`` is dropped and the rest is joined to the data root, e.g. ``"./CLEVRER/v.mp4"`` under
    ``Video-R1-data`` gives ``Video-R1-data/CLEVRER/v.mp4``.

    Raises:
        ValueError: ``record.path`` does not start with ``"./"`` or contains ``..``.
    """
    _check_media_path(record.path)
    return Path(data_root) / record.path[2:]


def _check_media_path(path: str) -> None:
    if not path.startswith("./"):
        raise RecordError(f"path {path!r} must start with './'")
    if ".." in PurePosixPath(path).parts:
        raise RecordError(f"path {path!r} must not contain '..'")


def _parse_options(options: object, problem_type: str) -> tuple[str, ...]:
    if options is None:
        options = []
    if not isinstance(options, list) or not all(isinstance(o, str) for o in options):
        raise RecordError(f"options must be a list of strings, got {options!r}")
    if problem_type == "multiple choice" and not options:
        raise RecordError("options must be non-empty for problem_type 'multiple choice'")
    return tuple(options)


def _parse_data_source(data_source: object) -> str:
    if data_source is None:
        return ""
    if not isinstance(data_source, str):
        raise RecordError(f"data_source must be a string, got {data_source!r}")
    return data_source


def _read_rows(path: Path) -> list[object]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise DatasetError(f"{path}: cannot read dataset file ({error})") from error
    if path.suffix != ".jsonl" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as error:
            raise DatasetError(f"{path}: not valid JSON ({error})") from error
        if not isinstance(rows, list):
            raise DatasetError(f"{path}: expected a JSON array, got {type(rows).__name__}")
        return rows
    return _read_json_lines(path, text)


def _read_json_lines(path: Path, text: str) -> list[object]:
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise DatasetError(f"{path}: line {number} is not valid JSON ({error})") from error
    if not rows:
        raise DatasetError(f"{path}: empty dataset file")
    return rows
