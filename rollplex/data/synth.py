"""Procedural Video-R1 data: bouncing coloured shapes encoded as MP4, with questions of known answer.

A scene is a few bodies (circle, square or triangle; red, green, blue or yellow) on a plain dark
background, moving with constant velocity, bouncing off the frame edges and colliding elastically with
each other. Every body collides and bounces as a disc of its ``radius``; it is drawn as a circle of that
radius, a square of half-side 0.8·radius or an equilateral triangle of circumradius ``radius``.

Question families and how their ground truth comes from the simulation:

- ``color`` (multiple choice): colour of the body with the largest drawn area. Scenes are built with
  one dominant body whose drawn area is at least twice any other's.
- ``count`` (numerical): number of bodies (1-5; bodies never overlap at the first frame).
- ``direction`` (multiple choice): sign of the dominant body's net displacement between the first and
  the last frame along the axis where it is larger (image y grows downwards, so +y is "down"). Scenes
  are resampled until that axis has at least twice the other's displacement and 10 % of the short
  side.
- ``collision`` (numerical): number of body-body contacts during the clip, counted once per contact
  when two discs overlap while approaching (wall bounces are not collisions).

Records follow the Video-R1 schema (docs/video-r1-format.md, "Record schema") with paths under the ``CLEVRER``
video folder, so the generated folder is the ``data_root`` of :func:`rollplex.data.records.media_path`.

Example:
    summary = generate_dataset(Path("synth"), num=100, seed=0)
    records, skipped = load_records(summary.train_json)   # 80 records, 0 skipped
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from tqdm import tqdm

COLOURS = ("red", "green", "blue", "yellow")
COLOUR_RGB = {"red": (220, 50, 50), "green": (50, 180, 70), "blue": (60, 100, 235), "yellow": (235, 205, 40)}
BACKGROUND_RGB = (24, 24, 24)
KINDS = ("circle", "square", "triangle")
# Drawn area of each kind divided by radius**2.
AREA_PER_RADIUS2 = {"circle": math.pi, "square": 4 * 0.8**2, "triangle": 3 * math.sqrt(3) / 4}
SQUARE_HALF_SIDE = 0.8
DIRECTIONS = ("left", "right", "up", "down")
FAMILIES = ("color", "count", "direction", "collision")
VIDEO_FOLDER = "CLEVRER/synth"
SUBSTEPS = 8  # integration steps per frame interval
_LETTERS = "ABCDEFGH"
_MAX_TRIES = 200


@dataclass(frozen=True)
class Body:
    """One shape: ``kind`` in :data:`KINDS`, ``colour`` in :data:`COLOURS`, ``radius`` in pixels."""

    kind: str
    colour: str
    radius: float

    @property
    def area(self) -> float:
        """Drawn area in square pixels."""
        return AREA_PER_RADIUS2[self.kind] * self.radius**2


@dataclass(frozen=True, eq=False)
class Scene:
    """A simulated clip: bodies, their centres per frame and the number of body-body collisions.

    Fields:
        bodies: the S bodies, in draw order.
        positions: float64 [T, S, 2], centre (x, y) of each body at each frame, in pixels from the
            top-left corner (y grows downwards).
        collisions: body-body contacts between the first and the last frame.

    Example:
        Scene(bodies=(Body("circle", "red", 10.0),), positions=np.zeros((8, 1, 2)), collisions=0)
    """

    bodies: tuple[Body, ...]
    positions: np.ndarray
    collisions: int


@dataclass(frozen=True)
class Question:
    """One Video-R1 question: text, ``problem_type``, letter-prefixed options and the bare answer."""

    problem: str
    problem_type: str
    options: tuple[str, ...]
    answer: str


@dataclass(frozen=True)
class SynthSummary:
    """What :func:`generate_dataset` wrote: the two JSON files and record counts per split and family.

    Example:
        SynthSummary(train_json=Path("synth/train.json"), val_json=Path("synth/val.json"),
                     train_counts={"color": 40, "count": 40}, val_counts={"color": 10, "count": 10})
    """

    train_json: Path
    val_json: Path
    train_counts: dict[str, int]
    val_counts: dict[str, int]


def simulate(
    bodies: tuple[Body, ...],
    start: np.ndarray,
    velocity: np.ndarray,
    *,
    num_frames: int,
    width: int,
    height: int,
) -> Scene:
    """Move discs with constant velocity, wall reflections and elastic collisions.

    ``start`` is float [S, 2] centres (x, y) in pixels and ``velocity`` float [S, 2] in pixels per
    frame interval. Each interval is split into :data:`SUBSTEPS` explicit Euler steps; after each
    step a disc past a wall is mirrored back inside with that velocity component reversed, then every
    pair of overlapping, approaching discs exchanges momentum along the line of centres (equal-mass
    elastic collision generalised to masses ∝ radius², e.g. equal discs swap normal velocities) and
    counts one collision. Contact is thus detected up to one substep late.

    Raises:
        ValueError: shapes of ``start``/``velocity`` do not match the bodies, or ``num_frames`` < 1.
    """
    count = len(bodies)
    if start.shape != (count, 2) or velocity.shape != (count, 2) or num_frames < 1:
        raise ValueError(f"simulate needs start/velocity of shape ({count}, 2) and num_frames >= 1")
    pos = start.astype(np.float64)
    vel = velocity.astype(np.float64)
    radius = np.array([b.radius for b in bodies], dtype=np.float64)
    size = np.array([width, height], dtype=np.float64)
    pairs = np.triu_indices(count, k=1)
    positions = np.empty((num_frames, count, 2))
    positions[0] = pos
    collisions = 0
    for frame in range(1, num_frames):
        for _ in range(SUBSTEPS):
            pos += vel / SUBSTEPS
            _reflect_walls(pos, vel, radius, size)
            collisions += _collide(pos, vel, radius, pairs)
        positions[frame] = pos
    return Scene(bodies=tuple(bodies), positions=positions, collisions=collisions)


def _reflect_walls(pos: np.ndarray, vel: np.ndarray, radius: np.ndarray, size: np.ndarray) -> None:
    low = pos < radius[:, None]
    high = pos > size - radius[:, None]
    pos[:] = np.where(low, 2 * radius[:, None] - pos, pos)
    pos[:] = np.where(high, 2 * (size - radius[:, None]) - pos, pos)
    vel[:] = np.where(low, np.abs(vel), np.where(high, -np.abs(vel), vel))


def _collide(pos: np.ndarray, vel: np.ndarray, radius: np.ndarray, pairs: tuple[np.ndarray, ...]) -> int:
    first, second = pairs
    delta = pos[second] - pos[first]
    dist = np.linalg.norm(delta, axis=1)
    closing = np.einsum("pk,pk->p", vel[second] - vel[first], delta)
    hits = np.flatnonzero((dist < radius[first] + radius[second]) & (dist > 0) & (closing < 0))
    mass = radius**2
    for pair in hits:
        i, j = first[pair], second[pair]
        normal = delta[pair] / dist[pair]
        normal_speed = float(np.dot(vel[j] - vel[i], normal))
        vel[i] += 2 * mass[j] / (mass[i] + mass[j]) * normal_speed * normal
        vel[j] -= 2 * mass[i] / (mass[i] + mass[j]) * normal_speed * normal
    return len(hits)


def render(scene: Scene, width: int, height: int, *, anti_alias: bool = True) -> np.ndarray:
    """Draw a scene: uint8 [T, height, width, 3] RGB frames on :data:`BACKGROUND_RGB`.

    Bodies are drawn in decreasing area, so small bodies stay visible over large ones. Coverage of a
    pixel (centre at +0.5) is ``clip(0.5 - d, 0, 1)`` for the signed distance ``d`` to the shape's
    edge when ``anti_alias``, else ``d <= 0``.
    """
    frames = np.empty((scene.positions.shape[0], height, width, 3), dtype=np.uint8)
    order = sorted(range(len(scene.bodies)), key=lambda s: -scene.bodies[s].area)
    canvas = np.empty((height, width, 3), dtype=np.float32)
    for t in range(frames.shape[0]):
        canvas[:] = BACKGROUND_RGB
        for s in order:
            _paint(canvas, scene.bodies[s], scene.positions[t, s], anti_alias)
        frames[t] = np.rint(canvas)
    return frames


def _paint(frame: np.ndarray, body: Body, centre: np.ndarray, anti_alias: bool) -> None:
    height, width = frame.shape[:2]
    reach = body.radius + 1.0
    x0, x1 = max(0, int(centre[0] - reach)), min(width, int(centre[0] + reach) + 1)
    y0, y1 = max(0, int(centre[1] - reach)), min(height, int(centre[1] + reach) + 1)
    if x0 >= x1 or y0 >= y1:
        return
    dx = np.arange(x0, x1, dtype=np.float32)[None, :] + 0.5 - centre[0]
    dy = np.arange(y0, y1, dtype=np.float32)[:, None] + 0.5 - centre[1]
    distance = _signed_distance(body.kind, dx, dy, body.radius)
    coverage = np.clip(0.5 - distance, 0.0, 1.0) if anti_alias else (distance <= 0).astype(np.float32)
    region = frame[y0:y1, x0:x1]
    region += coverage[..., None] * (np.asarray(COLOUR_RGB[body.colour], dtype=np.float32) - region)


def _signed_distance(kind: str, dx: np.ndarray, dy: np.ndarray, radius: float) -> np.ndarray:
    if kind == "circle":
        return np.hypot(dx, dy) - radius
    if kind == "square":
        return np.maximum(np.abs(dx), np.abs(dy)) - SQUARE_HALF_SIDE * radius
    half_root3 = math.sqrt(3) / 2  # apex up: edge normals (0, 1), (±√3/2, -1/2); inradius = radius / 2
    return np.maximum(dy, np.abs(dx) * half_root3 - dy / 2) - radius / 2


def write_mp4(frames: np.ndarray, path: Path, fps: float) -> None:
    """Encode uint8 [T, H, W, 3] RGB frames (H, W even) as a yuv420p MP4 at ``fps`` frames per second.

    Uses the first encoder of libx264 (CRF 12, veryfast, assembly off) / mpeg4 (qscale 2) present in
    the PyAV build, with one thread, so the same frames always give the same bytes.
    """
    codec, options = _encoder()
    with av.open(str(path), mode="w", format="mp4") as container:
        stream = container.add_stream(codec, rate=Fraction(fps).limit_denominator(1001), options=options)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        stream.codec_context.thread_count = 1
        for index, pixels in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(pixels), format="rgb24")
            frame.pts = index
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))


@functools.cache
def _encoder() -> tuple[str, dict[str, str]]:
    # x264's assembly kernels make its output vary from run to run; its C paths are deterministic.
    x264 = {"crf": "12", "preset": "veryfast", "x264-params": "asm=0"}
    candidates = (("libx264", x264), ("mpeg4", {"qscale": "2"}))
    for name, options in candidates:
        try:
            av.codec.Codec(name, "w")
        except av.codec.codec.UnknownCodecError:
            continue
        return name, options
    raise RuntimeError("PyAV has neither a libx264 nor an mpeg4 encoder")


def largest_body(scene: Scene) -> int:
    """Index of the body with the largest drawn area (first on ties)."""
    return int(np.argmax([body.area for body in scene.bodies]))


def net_direction(scene: Scene, body: int) -> tuple[str, float, float]:
    """Overall direction of ``body``: (direction, |major displacement|, |minor displacement|) in pixels.

    The displacement is last-frame centre minus first-frame centre; the major axis is x when
    |dx| >= |dy|; "right" is +x and "down" is +y (image coordinates).
    """
    dx, dy = scene.positions[-1, body] - scene.positions[0, body]
    if abs(dx) >= abs(dy):
        return ("right" if dx > 0 else "left"), abs(dx), abs(dy)
    return ("down" if dy > 0 else "up"), abs(dy), abs(dx)


def make_question(family: str, scene: Scene, rng: np.random.Generator, shuffle_options: bool) -> Question:
    """Question of ``family`` about ``scene`` with its ground truth (see the module docstring).

    Options keep the canonical order of :data:`COLOURS` / :data:`DIRECTIONS` unless ``shuffle_options``,
    in which case ``rng`` permutes them; letters are assigned after ordering.

    Raises:
        ValueError: unknown ``family``.
    """
    if family == "color":
        colour = scene.bodies[largest_body(scene)].colour
        text = "What colour is the largest shape in the video?"
        return _multiple_choice(text, COLOURS, colour, rng, shuffle_options)
    if family == "direction":
        direction = net_direction(scene, largest_body(scene))[0]
        text = "In which direction does the largest shape move overall?"
        return _multiple_choice(text, DIRECTIONS, direction, rng, shuffle_options)
    if family == "count":
        return Question("How many shapes are in the video?", "numerical", (), str(len(scene.bodies)))
    if family == "collision":
        text = "How many times do two shapes collide with each other in the video?"
        return Question(text, "numerical", (), str(scene.collisions))
    raise ValueError(f"unknown question family {family!r}; expected one of {FAMILIES}")


def _multiple_choice(
    text: str, choices: tuple[str, ...], correct: str, rng: np.random.Generator, shuffle: bool
) -> Question:
    ordered = [choices[i] for i in rng.permutation(len(choices))] if shuffle else list(choices)
    options = tuple(f"{_LETTERS[i]}. {choice}" for i, choice in enumerate(ordered))
    return Question(text, "multiple choice", options, _LETTERS[ordered.index(correct)])


def sample_scene(
    family: str,
    rng: np.random.Generator,
    *,
    width: int,
    height: int,
    num_frames: int,
    dominant_scale: float = 1.0,
) -> Scene:
    """Random scene suited to ``family`` (sizes relative to min(width, height), speeds to the clip length).

    ``color`` and ``direction`` scenes have one dominant body (radius 0.17-0.20 of the short side, times
    ``dominant_scale``)
    and 1-3 small ones (0.06-0.075); ``count`` scenes have 1-5 bodies of 0.06-0.10; ``collision``
    scenes 2-3 bodies of 0.06-0.09 moving fast enough to meet. ``direction`` scenes are resampled
    until the answer is clear (module docstring).

    Raises:
        ValueError: unknown ``family``.
        RuntimeError: no acceptable scene in 200 tries (frame too small for the bodies).
    """
    short = min(width, height)
    for _ in range(_MAX_TRIES):
        if family in ("color", "direction"):
            small = rng.uniform(0.06, 0.075, rng.integers(1, 4)) * short
            radii, travel = [rng.uniform(0.17, 0.20) * dominant_scale * short, *small], (0.15, 0.5)
        elif family == "count":
            radii, travel = list(rng.uniform(0.06, 0.10, rng.integers(1, 6)) * short), (0.2, 0.8)
        elif family == "collision":
            radii, travel = list(rng.uniform(0.06, 0.09, rng.integers(2, 4)) * short), (0.4, 1.0)
        else:
            raise ValueError(f"unknown question family {family!r}; expected one of {FAMILIES}")
        start = _place(rng, np.array(radii), width, height)
        if start is None:
            continue
        bodies = tuple(Body(str(rng.choice(KINDS)), str(rng.choice(COLOURS)), float(r)) for r in radii)
        velocity = _velocities(rng, len(radii), travel, short, num_frames)
        if family == "direction":
            velocity[0] = _axis_velocity(rng, short, num_frames)
        scene = simulate(bodies, start, velocity, num_frames=num_frames, width=width, height=height)
        if family != "direction" or _clear_direction(scene, short):
            return scene
    raise RuntimeError(f"no acceptable {family!r} scene in {_MAX_TRIES} tries at {width}x{height}")


def _place(rng: np.random.Generator, radii: np.ndarray, width: int, height: int) -> np.ndarray | None:
    """Non-overlapping centres float [S, 2] inside the frame (2 px gap), or None after 100 tries each."""
    centres: list[np.ndarray] = []
    for r in radii:
        for _ in range(100):
            centre = rng.uniform([r, r], [width - r, height - r])
            if all(np.linalg.norm(centre - c) > r + rc + 2 for c, rc in zip(centres, radii, strict=False)):
                centres.append(centre)
                break
        else:
            return None
    return np.array(centres)


def _velocities(
    rng: np.random.Generator, count: int, travel: tuple[float, float], short: int, num_frames: int
) -> np.ndarray:
    angle = rng.uniform(0, 2 * math.pi, count)
    speed = rng.uniform(*travel, count) * short / max(num_frames - 1, 1)
    return np.stack([np.cos(angle), np.sin(angle)], axis=1) * speed[:, None]


def _axis_velocity(rng: np.random.Generator, short: int, num_frames: int) -> np.ndarray:
    axis = np.array([[-1, 0], [1, 0], [0, -1], [0, 1]], dtype=np.float64)[rng.integers(4)]
    speed = rng.uniform(0.25, 0.45) * short / max(num_frames - 1, 1)
    return axis * speed + rng.uniform(-0.1, 0.1, 2) * speed


def _clear_direction(scene: Scene, short: int) -> bool:
    _, major, minor = net_direction(scene, largest_body(scene))
    return major >= 2 * minor and major >= 0.1 * short


def generate_dataset(
    out: Path,
    num: int,
    seed: int,
    *,
    width: int = 112,
    height: int = 112,
    num_frames: int = 8,
    fps: float = 4.0,
    val_fraction: float = 0.2,
    families: tuple[str, ...] = FAMILIES,
    shuffle_options: bool = False,
    anti_alias: bool = True,
    dominant_scale: float = 1.0,
    progress: bool = False,
) -> SynthSummary:
    """Write ``num`` synthetic Video-R1 records with MP4 media under ``out`` (the data root).

    Record i has ``problem_id`` i, family ``families[i % len(families)]``, media
    ``out/CLEVRER/synth/video_{i:06d}.mp4`` (``num_frames`` frames, width x height, ``fps``) and is
    drawn from its own generator seeded with (seed, i), so it does not depend on ``num``.
    ``round(num * val_fraction)`` records chosen with a (seed, num)-seeded permutation go to
    ``out/val.json``, the rest to ``out/train.json``; both are JSON arrays in ``problem_id`` order
    (``val.json`` is ``[]`` when no record falls in it). Same arguments give byte-identical files.

    Args:
        width, height: frame size in pixels (even, for yuv420p).
        num_frames, fps: frames per clip and their rate in frames per second.
        shuffle_options: permute multiple-choice options per record instead of the canonical order.
        anti_alias: soft shape edges (see :func:`render`).
        dominant_scale: size factor of the dominant body of ``color`` and ``direction`` scenes (1.0 =
            radius 0.17-0.20 of the short side; the embedded default run uses a larger body).
        progress: show a tqdm progress bar.

    Raises:
        ValueError: ``num`` < 1, ``seed`` < 0, odd or < 32 ``width``/``height``, ``num_frames`` < 2,
            ``fps`` <= 0, ``val_fraction`` outside [0, 1) or leaving no training record, an unknown
            family, or no family.
    """
    _check_arguments(num, seed, width, height, num_frames, fps, val_fraction, families)
    out = Path(out)
    (out / VIDEO_FOLDER).mkdir(parents=True, exist_ok=True)
    val_ids = set(np.random.default_rng([seed, num]).permutation(num)[: round(num * val_fraction)].tolist())
    splits: dict[str, list[dict]] = {"train": [], "val": []}
    for index in tqdm(range(num), desc="synth", disable=not progress):
        family = families[index % len(families)]
        rng = np.random.default_rng([seed, index])
        scene = sample_scene(
            family, rng, width=width, height=height, num_frames=num_frames, dominant_scale=dominant_scale
        )
        relative = f"{VIDEO_FOLDER}/video_{index:06d}.mp4"
        write_mp4(render(scene, width, height, anti_alias=anti_alias), out / relative, fps)
        question = make_question(family, scene, rng, shuffle_options)
        splits["val" if index in val_ids else "train"].append(_record(index, family, question, relative))
    for split, rows in splits.items():
        (out / f"{split}.json").write_text(
            json.dumps(rows, indent=1, ensure_ascii=False) + "\n", encoding="utf-8"
        )
    return SynthSummary(
        train_json=out / "train.json",
        val_json=out / "val.json",
        train_counts=_count_families(splits["train"], families),
        val_counts=_count_families(splits["val"], families),
    )


def _record(index: int, family: str, question: Question, relative: str) -> dict:
    return {
        "problem_id": index,
        "problem": question.problem,
        "data_type": "video",
        "problem_type": question.problem_type,
        "options": list(question.options),
        "solution": f"<answer>{question.answer}</answer>",
        "path": f"./{relative}",
        "data_source": f"rollplex-synth/{family}",
    }


def _count_families(rows: list[dict], families: tuple[str, ...]) -> dict[str, int]:
    counts = dict.fromkeys(families, 0)
    for row in rows:
        counts[row["data_source"].split("/", 1)[1]] += 1
    return counts


def _check_arguments(
    num: int,
    seed: int,
    width: int,
    height: int,
    num_frames: int,
    fps: float,
    val_fraction: float,
    families: tuple[str, ...],
) -> None:
    if num < 1 or seed < 0:
        raise ValueError(f"generate_dataset needs num >= 1 and seed >= 0, got num={num}, seed={seed}")
    if width % 2 or height % 2 or min(width, height) < 32:
        raise ValueError(f"width and height must be even and >= 32 (yuv420p), got {width}x{height}")
    if num_frames < 2 or not fps > 0:
        raise ValueError(f"generate_dataset needs num_frames >= 2 and fps > 0, got {num_frames}, {fps}")
    if not 0 <= val_fraction < 1 or round(num * val_fraction) >= num:
        raise ValueError(f"val_fraction must be in [0, 1) and leave a training record, got {val_fraction}")
    unknown = [family for family in families if family not in FAMILIES]
    if unknown or not families:
        raise ValueError(f"families must be a non-empty subset of {FAMILIES}, got {families}")
