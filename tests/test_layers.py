"""Layers import one way: every ``rollplex`` import of every module, read with ``ast`` (imports inside
functions and under ``TYPE_CHECKING`` included), goes to the module's own layer or a lower one.

The order, lowest first (docs/architecture.md):

    1  types, config (+ small leaf helpers with no rollplex imports)
    2  data, models
    3  rollout, algo
    4  memory, parallel
    5  phases, schedule
    6  bench, loop, checkpoint
    7  cli

``observe`` is a side layer: layers 4 and up may import it, but types/config, data, models, rollout and
algo never do (profiling reaches them through ``rollplex.hooks``), and observe itself imports only
layer 1. Within the order, bench imports nothing from loop, and schedule reaches the model through
phases only (not models). ``from __future__``, the standard library and third-party packages are not rollplex imports
and are ignored.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rollplex"

LAYERS = (
    ("types", "config"),
    ("data", "models"),
    ("rollout", "algo"),
    ("memory", "parallel"),
    ("phases", "schedule"),
    ("bench", "loop", "checkpoint"),
    ("cli",),
)
# layer 1's small leaf helpers: they import nothing of rollplex
LEAF_HELPERS = ("__init__", "hooks", "determinism", "files", "optim")
# modules the order does not name, and the layer each sits in: the embedded default job builds its
# model and data (models, data) and only the command line reads it; ``python -m rollplex`` is the cli
PLACED = {"default_job": 6, "__main__": 7}
OBSERVE = "observe"
# pairs the order allows but the design does not: bench shares no code with the training loop (what
# both need sits lower), and the schedules reach the model only through the phases (one forward API)
APART = {
    ("bench", "loop"): "bench imports nothing from loop",
    ("schedule", "models"): "schedule reaches the model through phases only",
}
NEVER_IMPORT_OBSERVE = ("types", "config", "data", "models", "rollout", "algo", *LEAF_HELPERS)


def layer_of(component: str) -> int | None:
    """The layer (1 = lowest) of a top-level module or package of rollplex; None for observe and for a
    component the order does not place."""
    for index, names in enumerate(LAYERS, start=1):
        if component in names:
            return index
    if component in LEAF_HELPERS:
        return 1
    return PLACED.get(component)


def component(module: str) -> str:
    """``rollplex.models.forward`` -> ``models``; ``rollplex`` itself -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path) -> str:
    """Dotted name of a file under the package (``rollplex/models/__init__.py`` -> ``rollplex.models``)."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def rollplex_imports(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, imported rollplex module) of every import statement anywhere in ``source`` (function bodies
    and ``if TYPE_CHECKING:`` blocks included); ``from rollplex import x`` counts as ``rollplex.x`` when x
    is a module of the package, and relative imports are resolved against ``module``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join([*package, base] if base else package)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                is_module = (PACKAGE.parent / sub.replace(".", "/")).with_suffix(".py").exists() or (
                    PACKAGE.parent / sub.replace(".", "/")
                ).is_dir()
                found.append((node.lineno, sub if is_module else base))
    return [(line, name) for line, name in found if name == "rollplex" or name.startswith("rollplex.")]


def violations(importer: str, imported: str) -> str | None:
    """Why module ``importer`` may not import ``imported`` (both dotted rollplex names), or None."""
    own, other = component(importer), component(imported)
    if own == other:
        return None
    if other == OBSERVE:
        if own in NEVER_IMPORT_OBSERVE:
            return f"{own} never imports rollplex.observe (spans go through rollplex.hooks)"
        return None
    if own in LEAF_HELPERS:
        return f"{own} is a leaf helper of layer 1: it imports nothing of rollplex"
    target = layer_of(other)
    if target is None:
        return f"{other} has no layer: place it in LAYERS, LEAF_HELPERS or PLACED"
    if (own, other) in APART:
        return APART[own, other]
    if own == OBSERVE:
        return None if target == 1 else f"observe imports layer 1 only, not {other} (layer {target})"
    here = layer_of(own)
    if target > here:
        return f"{own} (layer {here}) imports {other} (layer {target}), a higher layer"
    return None


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer():
    unplaced = {component(module_name(p)) for p in _modules()} - {OBSERVE}
    unplaced = sorted(c for c in unplaced if layer_of(c) is None)
    assert unplaced == [], f"place these in LAYERS, LEAF_HELPERS or PLACED: {unplaced}"


def test_imports_go_to_the_same_or_a_lower_layer():
    found = []
    for path in _modules():
        module = module_name(path)
        for line, imported in rollplex_imports(path.read_text(), module, path.name == "__init__.py"):
            why = violations(module, imported)
            if why is not None:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: imports {imported}: {why}")
    assert found == []


@pytest.mark.parametrize(
    ("importer", "source", "reason"),
    [
        ("rollplex.models.forward", "from rollplex.rollout.sampler import race_tokens", "a higher layer"),
        ("rollplex.models.forward", "def f():\n    import rollplex.observe.metrics", "never imports"),
        (
            "rollplex.algo.rewards",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rollplex.phases import Roles",
            "a higher layer",
        ),
        ("rollplex.config", "from rollplex.algo.rewards import resolve_reward", "a higher layer"),
        ("rollplex.bench.schedule", "from rollplex.loop import train", "nothing from loop"),
        ("rollplex.bench.schedule", "from rollplex.phases import Roles", None),
        ("rollplex.schedule.serial", "from rollplex.models.forward import prefix_states", "through phases"),
        ("rollplex.bench.schedule", "from rollplex.cli import main", "a higher layer"),
        ("rollplex.hooks", "from rollplex.types import Prompt", "leaf helper"),
        ("rollplex.observe.metrics", "from rollplex import hooks", None),
        ("rollplex.observe.report", "from rollplex.loop import train", "layer 1 only"),
        ("rollplex.schedule.serial", "from rollplex.observe.metrics import PhaseTimer", None),
        ("rollplex.schedule.serial", "from .concurrency import on_stream", None),
        ("rollplex.data.encode", "from ..phases import Roles", "a higher layer"),
        ("rollplex.models.forward", "import torch\nfrom rollplex.sideways import x", "has no layer"),
    ],
)
def test_the_check_finds_a_forbidden_import(importer, source, reason):
    """The checker itself: each kind of import it must refuse (an upward one at module level, in a
    function, under TYPE_CHECKING, relative; observe from a low layer; anything from a leaf helper; an
    unplaced module), and some it must allow."""
    reasons = [violations(importer, name) for _, name in rollplex_imports(source, importer, False)]
    assert reasons, "no rollplex import was read"
    if reason is None:
        assert reasons == [None] * len(reasons)
    else:
        assert any(r is not None and reason in r for r in reasons), reasons
