"""``rollplex bench profile``: one GRPO step of a schedule bench row under torch.profiler (CPU smoke on the
tiny preset; the idle-time table on CUDA)."""

from __future__ import annotations

import json
import types

import pytest
import torch

from rollplex.bench.profile import ProfileBenchConfig, run_profile_bench
from rollplex.cli import main

TINY = dict(preset="tiny", groups=2, group_size=2, response_tokens=4, text_tokens=20, grid=(2, 4, 4))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the bench would run on this CUDA device")
def test_a_profiled_step_of_the_tiny_workload_on_the_cpu(tmp_path):
    out = tmp_path / "profile.json"
    result = run_profile_bench(ProfileBenchConfig(**TINY, dtype="float32", warmup=1), out)
    labels = [step["label"] for step in result.steps]
    assert labels == ["warm-up 1", "profiled: operators", "profiled: idle gaps"]
    for step in result.steps:  # every step ran the serial schedule's phases
        assert {"time/rollout", "time/reference", "time/actor", "time/optimizer"} <= set(step["phases"])
        assert step["seconds"] >= sum(step["phases"].values()) * 0.99
    # the operator table sees the phases' profiler ranges, so a kernel can be told by the phase that ran it
    assert "rollplex/phase/actor" in result.operators and "rollplex/phase/rollout" in result.operators
    assert result.idle == "no idle-time table: a profile on cpu holds no device activity"
    assert json.loads(out.read_text()) == json.loads(json.dumps(vars(result)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_idle_table_of_a_cuda_step_charges_gaps_to_launchers():
    result = run_profile_bench(ProfileBenchConfig(**TINY, warmup=1))
    assert result.idle.startswith("device span ")
    assert "idle s  gaps  launcher of the work after the gap" in result.idle


def test_the_command_line_reaches_the_config(monkeypatch):
    seen = []
    monkeypatch.setattr(
        "rollplex.bench.profile.run_profile_bench",
        lambda cfg, out: seen.append((cfg, out)) or types.SimpleNamespace(),
    )
    assert (
        main(["bench", "profile", "--preset", "tiny", "--row", "both", "--warmup", "0", "--groups", "2"]) == 0
    )
    cfg, out = seen[0]
    assert (cfg.preset, cfg.row, cfg.warmup, cfg.groups, out) == ("tiny", "both", 0, 2, None)
    assert main(["bench", "profile"]) == 0
    assert seen[1][0] == ProfileBenchConfig()  # the schedule bench's workload and its serial row


def test_an_unknown_row_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["bench", "profile", "--row", "sereal"])
    assert stop.value.code == 2
    assert "argument --row: invalid choice: 'sereal'" in capsys.readouterr().err
