"""The GPU scripts under benchmarks/: ``--help`` prints the script's docstring, and without a CUDA device
each stops at once with a one-line error (exit status 2) instead of a driver traceback. No script imports
a private name (leading underscore) of the package."""

from __future__ import annotations

import ast
import runpy
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted((BENCHMARKS / "scripts").glob("*.py"))
REQUIRED = {"host_lag.py": ["out"]}  # positional arguments a script needs


def _run(monkeypatch, script: Path, args: list[str]) -> int:
    monkeypatch.syspath_prepend(
        str(script.parent)
    )  # as `python benchmarks/scripts/x.py` puts its folder first
    monkeypatch.setattr(sys, "argv", [str(script), *args])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(script), run_name="__main__")
    return stop.value.code


def test_every_python_script_is_found():
    names = {p.name for p in SCRIPTS}
    assert {"attention_sweep.py", "host_lag.py", "prefix_host.py", "suffix_attention_probe.py"} <= names


def private_uses(source: str) -> list[str]:
    """The private names (one leading underscore) of the package that ``source`` uses: imported from a
    ``rollplex`` module, read as an attribute of a name bound to one (``module._x``), or reached through
    ``self`` in a class derived from a package class (``self._x``)."""
    tree = ast.parse(source)
    bound = set()  # names bound to rollplex modules and objects
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rollplex"):
            bound |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            bound |= {alias.asname or alias.name for alias in node.names if alias.name.startswith("rollplex")}
    used = [
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rollplex")
        for alias in node.names
        if _private(alias.name)
    ]
    used += [node.attr for node in ast.walk(tree) if _private_attribute_of(node, bound)]
    for cls in ast.walk(tree):
        if isinstance(cls, ast.ClassDef) and any(
            isinstance(b, ast.Name) and b.id in bound for b in cls.bases
        ):
            used += [node.attr for node in ast.walk(cls) if _private_attribute_of(node, {"self"})]
    return used


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_attribute_of(node: ast.AST, names: set[str]) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and _private(node.attr)
        and isinstance(node.value, ast.Name)
        and node.value.id in names
    )


def test_private_uses_finds_imports_attributes_and_inherited_names():
    source = (
        "import rollplex.schedule.rollplex as sched\n"
        "from rollplex.bench.schedule import ROWS, _Workload\n"
        "from rollplex.observe.metrics import PhaseTimer\n"
        "class Mine:\n    def f(self):\n        return self._own\n"
        "class Timer(PhaseTimer):\n    def f(self):\n        return self._now(), self.now()\n"
        "x = sched._COMPILED, sched.prefix_states, ROWS.__len__\n"
    )
    assert sorted(private_uses(source)) == ["_COMPILED", "_Workload", "_now"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_no_script_imports_a_private_name_of_the_package(script):
    """A script reaches the package through its public names only, so that changing private code cannot
    break a script that runs on a GPU only."""
    assert private_uses(script.read_text()) == []


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help_prints_the_docstring(script, monkeypatch, capsys):
    assert _run(monkeypatch, script, ["--help"]) == 0
    first_line = runpy.run_path(str(script))["__doc__"].splitlines()[0]
    assert first_line[:40] in " ".join(capsys.readouterr().out.split())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the scripts would run on this CUDA device")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_without_a_gpu_each_stops_with_one_line(script, monkeypatch, capsys):
    assert _run(monkeypatch, script, REQUIRED.get(script.name, [])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"{script.name}: error: needs a CUDA device, and none is visible"


@pytest.mark.parametrize(
    ("script", "args"),
    [
        ("product_floor.py", ["--what", "blas,bogus"]),
        ("suffix_attention_probe.py", ["--backends", "causal,bogus"]),
        ("suffix_attention_probe.py", ["--repeats", "0"]),
        ("host_lag.py", ["out", "--row", "both"]),
        ("prefix_host.py", ["checkpoint", "bogus"]),
        ("prefix_host.py", ["--repeats", "0"]),
    ],
)
def test_a_bad_argument_is_a_usage_error_before_anything_runs(script, args, monkeypatch, capsys):
    path = next(p for p in SCRIPTS if p.name == script)
    assert _run(monkeypatch, path, args) == 2
    err = capsys.readouterr().err
    if args[0] == "--repeats":
        assert f"{args[-1]} is not in " in err
    else:
        assert f"{args[-1].split(',')[-1]!r} is not one of" in err


def _suite(*args: str):
    import subprocess

    suite = BENCHMARKS / "gpu_suite.sh"
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}  # this test's python3 (with torch)
    return subprocess.run(["bash", str(suite), *args], capture_output=True, text=True, env=env, timeout=120)


def test_gpu_suite_help_and_a_bad_stage_stop_before_anything_runs(tmp_path):
    shown = _suite("--help")
    assert shown.returncode == 0 and shown.stdout.startswith("GPU tests and benchmarks in one call.")
    assert "GPU_TESTS picks the test paths" in shown.stdout  # the whole usage comment, to its last line:
    assert shown.stdout.rstrip().endswith("(activate the environment that has torch first).")
    bad = _suite("tests", "tset")
    assert bad.returncode == 2 and "unknown stage 'tset'" in bad.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the suite would run on this CUDA device")
def test_gpu_suite_without_a_gpu_stops_with_one_line():
    run = _suite("tests")
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "gpu_suite.sh: error: needs a CUDA device visible to python3's torch, and none is"
    ]


def test_the_cprofile_report_lists_the_run_by_own_and_cumulative_time(tmp_path):
    from rollplex.bench.common import cprofile_report

    def busy_leaf():
        return sum(i * i for i in range(200_000))  # own time well above scheduling noise

    def run():
        return [busy_leaf() for _ in range(3)]

    path = tmp_path / "p.cprofile.txt"
    text = cprofile_report(run, str(path), own_rows=5, cumulative_rows=7)
    assert path.read_text() == text
    own, cumulative = text.split("Ordered by: cumulative time")
    assert "Ordered by: internal time" in own and "(busy_leaf)" in own and "(busy_leaf)" in cumulative
    assert own.index("(<genexpr>)") < own.index("(busy_leaf)")  # by own time: the squares first
    with pytest.raises(ZeroDivisionError):  # the run's error reaches the caller; profiling stops
        cprofile_report(lambda: 1 / 0, str(tmp_path / "q.txt"), 5, 5)


def test_host_lag_pairs_neighbouring_layers_of_one_pass_and_labels_recomputation(monkeypatch):
    """benchmarks/scripts/host_lag.py's bookkeeping, without a GPU: a forward probe off the main thread is a
    recomputation; intervals are taken only between neighbouring layers on one thread."""
    import threading

    script = next(p for p in SCRIPTS if p.name == "host_lag.py")
    space = runpy.run_path(str(script))

    class FakeEvent:
        def __init__(self, enable_timing=False):
            pass

        def record(self):
            pass

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    probes = space["_Probes"]()
    probes.on = True
    probes("actor:text:fwd", 0)
    worker = threading.Thread(target=lambda: (probes("actor:text:fwd", 1), probes("actor:text:bwd", 1)))
    worker.start()
    worker.join()
    assert [row[1] for row in probes.rows] == ["actor:text:fwd", "actor:text:recompute", "actor:text:bwd"]

    def row(layer, thread, t):
        return {"layer": layer, "thread": thread, "host_s": t}

    rows = [row(0, 1, 0.0), row(1, 1, 0.1), row(2, 1, 0.2), row(0, 1, 0.3), row(1, 2, 0.4), row(0, 2, 0.5)]
    pairs = space["_pairs"](rows)
    assert [(a["host_s"], b["host_s"]) for a, b in pairs] == [(0.0, 0.1), (0.1, 0.2), (0.4, 0.5)]
