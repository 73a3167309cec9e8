"""Synthetic Video-R1 generator: determinism, schema, and answers checked against independent oracles."""

import json
import math
from collections import deque

import numpy as np
import pytest
import torch

from rollplex.data.records import load_records, media_path
from rollplex.data.synth import (
    COLOUR_RGB,
    COLOURS,
    SUBSTEPS,
    Body,
    generate_dataset,
    make_question,
    render,
    simulate,
)
from rollplex.data.vision import VideoSampling, read_video

SIZE, FRAMES, FPS = 56, 8, 4.0  # 56 is a multiple of 28: read_video keeps the native size
NATIVE = VideoSampling(fps=FPS, max_frames=FRAMES, min_pixels=28 * 28, max_pixels=SIZE * SIZE)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth")
    return out, generate_dataset(out, num=12, seed=3, width=SIZE, height=SIZE, num_frames=FRAMES, fps=FPS)


def decoded(path):
    return read_video(path, NATIVE).frames


def test_same_arguments_give_identical_files_and_pixels(dataset, tmp_path):
    out, _ = dataset
    again = tmp_path / "again"
    generate_dataset(again, num=12, seed=3, width=SIZE, height=SIZE, num_frames=FRAMES, fps=FPS)
    for name in ("train.json", "val.json"):
        assert (out / name).read_bytes() == (again / name).read_bytes()
    videos = sorted((out / "CLEVRER" / "synth").iterdir())
    assert len(videos) == 12
    for video in videos:
        twin = again / "CLEVRER" / "synth" / video.name
        assert torch.equal(decoded(video), decoded(twin))
        assert video.read_bytes() == twin.read_bytes()


def test_record_depends_on_its_index_not_on_num(dataset, tmp_path):
    out, _ = dataset
    generate_dataset(
        tmp_path, num=2, seed=3, width=SIZE, height=SIZE, num_frames=FRAMES, fps=FPS, val_fraction=0
    )
    name = "CLEVRER/synth/video_000001.mp4"
    assert (tmp_path / name).read_bytes() == (out / name).read_bytes()
    assert json.loads((tmp_path / "val.json").read_text()) == []


def test_schema_split_and_summary(dataset):
    out, summary = dataset
    train, skipped_train = load_records(summary.train_json)
    val, skipped_val = load_records(summary.val_json)
    assert skipped_train == skipped_val == 0
    assert len(val) == round(12 * 0.2) and len(train) == 12 - len(val)
    assert sorted(r.problem_id for r in train + val) == list(range(12))
    families = ("color", "count", "direction", "collision")
    for records, counts in ((train, summary.train_counts), (val, summary.val_counts)):
        assert counts == {f: sum(r.data_source == f"rollplex-synth/{f}" for r in records) for f in families}
    for record in train + val:
        family = families[record.problem_id % 4]
        assert record.data_source == f"rollplex-synth/{family}" and record.data_type == "video"
        assert record.path == f"./CLEVRER/synth/video_{record.problem_id:06d}.mp4"
        assert media_path(record, out).is_file()
        answer = record.solution.removeprefix("<answer>").removesuffix("</answer>")
        if family in ("color", "direction"):
            names = COLOURS if family == "color" else ("left", "right", "up", "down")
            assert record.problem_type == "multiple choice"
            assert record.options == tuple(
                f"{letter}. {name}" for letter, name in zip("ABCD", names, strict=True)
            )
            assert answer in "ABCD" and len(answer) == 1
        else:
            assert record.problem_type == "numerical" and record.options == () and answer.isdigit()
    fields = [
        "problem_id",
        "problem",
        "data_type",
        "problem_type",
        "options",
        "solution",
        "path",
        "data_source",
    ]
    assert all(list(row) == fields for row in json.loads(summary.train_json.read_text()))


def test_video_decodes_to_the_requested_frame_count(dataset):
    out, summary = dataset
    record = load_records(summary.train_json)[0][0]
    clip = read_video(media_path(record, out), NATIVE)
    assert clip.frames.shape == (FRAMES, 3, SIZE, SIZE) and clip.sample_fps == FPS
    default = read_video(media_path(record, out), VideoSampling())  # 2 s clip at Video-R1's 2 fps
    assert default.frames.shape[0] == 4 and default.sample_fps == 2.0


def blobs(frame: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """Connected components of pixels within 60 of a palette colour: (colour, [k, 2] (y, x)) each."""
    names = list(COLOUR_RGB)
    palette = np.array([COLOUR_RGB[n] for n in names], dtype=np.float64)
    distance = np.linalg.norm(frame[:, :, None, :].astype(np.float64) - palette, axis=-1)
    label = np.where(distance.min(-1) < 60, distance.argmin(-1), -1)
    seen = np.zeros(label.shape, bool)
    found = []
    for y, x in zip(*np.nonzero(label >= 0), strict=True):
        if seen[y, x]:
            continue
        seen[y, x], queue, pixels = True, deque([(y, x)]), []
        while queue:
            cy, cx = queue.popleft()
            pixels.append((cy, cx))
            for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                inside = 0 <= ny < label.shape[0] and 0 <= nx < label.shape[1]
                if inside and not seen[ny, nx] and label[ny, nx] == label[y, x]:
                    seen[ny, nx] = True
                    queue.append((ny, nx))
        found.append((names[label[y, x]], np.array(pixels)))
    return found


def test_colour_and_direction_answers_match_the_decoded_pixels(tmp_path):
    summary = generate_dataset(
        tmp_path, num=16, seed=11, width=112, height=112, families=("color", "direction")
    )
    records = load_records(summary.train_json)[0] + load_records(summary.val_json)[0]
    for record in records:
        frames = decoded_native(media_path(record, tmp_path))
        first, last = (max(blobs(f), key=lambda b: len(b[1])) for f in (frames[0], frames[-1]))
        option = dict(o.split(". ") for o in record.options)[record.solution[8]]
        if record.data_source.endswith("color"):
            assert first[0] == option, record
        else:
            dy, dx = last[1].mean(0) - first[1].mean(0)
            seen = ("right" if dx > 0 else "left") if abs(dx) >= abs(dy) else ("down" if dy > 0 else "up")
            assert first[0] == last[0] and seen == option, record


def decoded_native(path):
    clip = read_video(path, VideoSampling(fps=4.0, max_frames=8, min_pixels=28 * 28, max_pixels=112 * 112))
    return clip.frames.permute(0, 2, 3, 1).numpy()


def moving(radius, start, velocity, kind="circle", colour="red", frames=8, width=200, height=120):
    bodies = tuple(Body(kind, colour, r) for r in radius) if kind != "mixed" else radius
    return simulate(bodies, np.array(start, float), np.array(velocity, float), num_frames=frames,
                    width=width, height=height)  # fmt: skip


@pytest.mark.parametrize(
    ("velocity", "direction", "letter"),
    [
        ((3.0, 0.5), "right", "B"),
        ((-3.0, 0.0), "left", "A"),
        ((0.4, -3.0), "up", "C"),
        ((0.0, 2.0), "down", "D"),
    ],
)
def test_single_shape_direction(velocity, direction, letter):
    scene = moving([10.0], [[100.0, 60.0]], [velocity])
    expected = np.array([[100.0, 60.0]]) + np.arange(8)[:, None, None] * np.array(velocity)
    assert np.allclose(scene.positions, expected)
    question = make_question("direction", scene, np.random.default_rng(0), False)
    assert question.answer == letter and question.options[ord(letter) - 65] == f"{letter}. {direction}"


def test_head_on_equal_discs_collide_once_and_swap_velocities():
    scene = moving([10.0, 10.0], [[30.0, 60.0], [90.0, 60.0]], [[5.0, 0.0], [-5.0, 0.0]])
    assert scene.collisions == 1
    # Contact at t = 4 (gap 40 closing at 10/frame); afterwards each moves back at 5/frame. Detection
    # happens at most one substep late, so positions lag the exact event by <= 2 * 5 / SUBSTEPS.
    exact_t7 = np.array([[50.0 - 15.0, 60.0], [70.0 + 15.0, 60.0]])
    assert np.abs(scene.positions[7] - exact_t7).max() <= 2 * 5.0 / SUBSTEPS + 1e-9
    assert np.allclose(scene.positions[7] - scene.positions[6], [[-5.0, 0.0], [5.0, 0.0]])
    assert make_question("collision", scene, np.random.default_rng(0), False).answer == "1"


def test_unequal_masses_follow_the_1d_elastic_formula():
    m1, m2, v1, v2 = 10.0**2, 20.0**2, 4.0, -1.0
    scene = moving([10.0, 20.0], [[40.0, 60.0], [90.0, 60.0]], [[v1, 0.0], [v2, 0.0]], frames=12, width=400)
    after = scene.positions[-1] - scene.positions[-2]
    assert scene.collisions == 1
    assert after[0, 0] == pytest.approx(((m1 - m2) * v1 + 2 * m2 * v2) / (m1 + m2))  # -4
    assert after[1, 0] == pytest.approx(((m2 - m1) * v2 + 2 * m1 * v1) / (m1 + m2))  # 1
    assert m1 * after[0, 0] + m2 * after[1, 0] == pytest.approx(m1 * v1 + m2 * v2)


def test_near_miss_and_wall_bounces_are_not_collisions():
    miss = moving([10.0, 10.0], [[30.0, 40.0], [90.0, 61.0]], [[5.0, 0.0], [-5.0, 0.0]])
    assert miss.collisions == 0  # centre lines 21 apart > 10 + 10
    wall = moving([5.0], [[20.0, 60.0]], [[-10.0, 0.0]], frames=5, width=100)
    assert wall.collisions == 0
    assert np.allclose(wall.positions[:, 0, 0], [20.0, 10.0, 10.0, 20.0, 30.0])  # mirrored at x = 5


def test_colour_answer_uses_drawn_area_and_option_order():
    bodies = (Body("triangle", "yellow", 20.0), Body("circle", "green", 13.0), Body("square", "red", 12.0))
    # areas: 1.299 * 400 = 519.6, pi * 169 = 530.9, 2.56 * 144 = 368.6 -> the green circle.
    assert bodies[1].area == pytest.approx(math.pi * 169) and bodies[0].area < bodies[1].area
    scene = moving(bodies, [[40.0, 40.0], [120.0, 60.0], [170.0, 90.0]], np.zeros((3, 2)), kind="mixed")
    canonical = make_question("color", scene, np.random.default_rng(0), False)
    assert canonical.answer == "B" and canonical.options == ("A. red", "B. green", "C. blue", "D. yellow")
    shuffled = make_question("color", scene, np.random.default_rng(5), True)
    assert sorted(o[3:] for o in shuffled.options) == sorted(COLOURS)
    assert f"{shuffled.answer}. green" in shuffled.options
    assert make_question("count", scene, np.random.default_rng(0), False).answer == "3"


def test_render_draws_each_shape_with_its_geometry():
    bodies = (Body("circle", "red", 10.0), Body("square", "blue", 10.0), Body("triangle", "green", 10.0))
    scene = moving(
        bodies, [[20.0, 20.0], [60.0, 20.0], [100.0, 20.0]], np.zeros((3, 2)), kind="mixed", frames=1
    )
    frame = render(scene, 120, 40, anti_alias=False)[0]
    counts = {n: int(np.all(frame == COLOUR_RGB[n], axis=-1).sum()) for n in ("red", "blue", "green")}
    assert counts["blue"] == 16 * 16  # half-side 8: pixel centres 52.5 .. 67.5
    assert abs(counts["red"] - math.pi * 100) < 12
    assert abs(counts["green"] - 3 * math.sqrt(3) / 4 * 100) < 12
    assert np.all(frame[0, 0] == (24, 24, 24))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"width": 63},
        {"height": 30},
        {"num_frames": 1},
        {"fps": 0.0},
        {"val_fraction": 1.0},
        {"val_fraction": 0.6},  # round(0.6) = 1 of 1 record: no training record
        {"families": ("shape",)},
    ],
)
def test_invalid_arguments_raise_value_error(tmp_path, kwargs):
    with pytest.raises(ValueError):
        generate_dataset(tmp_path, num=1, seed=0, **kwargs)
