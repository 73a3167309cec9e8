"""Rewards: Video-R1 rules with the field case B13 corrections, registry, batch scoring, B14 bonus."""

import logging
import textwrap

import pytest
import torch

from rollplex.algo.rewards import (
    accuracy_range,
    accuracy_reward,
    add_temporal_bonus,
    answer_accuracy_reward,
    answer_format_reward,
    answer_lead_reward,
    check_reward_config,
    compute_rewards,
    extract_answer,
    format_reward,
    parse_number,
    parse_option,
    resolve_reward,
    temporal_bonus,
    temporal_reward_name,
    word_error_rate,
)
from rollplex.config import Config, ConfigError, load_config
from rollplex.types import Record, RewardResult, ShuffledAccuracy


def _record(problem_type: str, gold: str, solution: str | None = None) -> Record:
    return Record(
        problem_id=7,
        problem="q",
        data_type="video",
        problem_type=problem_type,
        options=("A. x", "B. y") if problem_type == "multiple choice" else (),
        solution=f"<answer>{gold}</answer>" if solution is None else solution,
        path="./CLEVRER/video_7.mp4",
        data_source="synth",
    )


MC_B = _record("multiple choice", "B")
NUM_6 = _record("numerical", "6")


# ---------------------------------------------------------------- format (B13)


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>\nstep one\nstep two\n</think>\n<answer>B</answer>", 1.0),
        ("<think>x</think><answer>B</answer>", 1.0),
        ("<think>x</think> \n <answer>multi\nline</answer>", 1.0),
        ("<think>x</think><answer>B</answer></answer>", 0.0),
        ("<think>a</think><think>b</think><answer>B</answer>", 0.0),
        ("<think>x</think><answer>A</answer><answer>B</answer>", 0.0),
        ("hi <think>x</think><answer>B</answer>", 0.0),
        ("<think>x</think><answer>B</answer> done", 0.0),
        ("<think>x</think>so<answer>B</answer>", 0.0),
        ("<answer>B</answer><think>x</think>", 0.0),
        ("I think it is B", 0.0),
    ],
)
def test_format_reward(completion, expected):
    assert format_reward(completion, MC_B) == expected


# ---------------------------------------------------------------- accuracy (B13)


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ("B", 1.0),
        ("b", 1.0),
        (" (B) ", 1.0),
        ("B) a dog", 1.0),
        ("B. a dog", 1.0),
        ("A", 0.0),
        ("B or C", 0.0),
    ],
)
def test_multiple_choice(answer, expected):
    assert accuracy_reward(f"<think>t</think><answer>{answer}</answer>", MC_B) == expected


def test_gold_option_is_normalised_too():
    assert accuracy_reward("<answer>b</answer>", _record("multiple choice", "(B) y")) == 1.0


def test_no_answer_block_scores_zero():
    assert accuracy_reward("I think it is B", MC_B) == 0.0
    assert accuracy_reward("<answer>B</answer><answer>B</answer>", MC_B) == 0.0
    assert accuracy_reward("<answer>B</answer></answer>", MC_B) == 0.0


@pytest.mark.parametrize(
    ("answer", "expected"),
    [("6", 1.0), ("6.0", 1.0), ("$6$", 1.0), ("6.001", 1.0), ("6.01", 0.0), ("7", 0.0), ("six", 0.0)],
)
def test_numerical(answer, expected):
    assert accuracy_reward(f"<answer>{answer}</answer>", NUM_6) == expected


def test_numerical_strips_commas():
    assert accuracy_reward("<answer>1,234.5</answer>", _record("numerical", "1234.50")) == 1.0


def test_unparseable_gold_scores_zero_for_every_completion_and_is_logged(caplog):
    bad = _record("numerical", "six")
    with caplog.at_level(logging.ERROR, logger="rollplex.algo.rewards"):
        values = [accuracy_reward(c, bad) for c in ("<answer>six</answer>", "<answer>6</answer>", "none")]
    assert values == [0.0, 0.0, 0.0]
    assert len(caplog.records) == 3 and "cannot be parsed" in caplog.records[0].getMessage()


def test_empty_answer_against_empty_gold_is_zero_and_flagged():
    result = compute_rewards(["<answer></answer>"], [_record("free-form", "")], ["accuracy"], None)
    assert result.accuracy.tolist() == [0.0] and result.errors == 1


def test_ocr_is_one_minus_word_error_rate():
    gold = _record("OCR", "the quick brown fox")
    assert accuracy_reward("<answer>the quick red fox</answer>", gold) == pytest.approx(0.75)
    assert accuracy_reward("<answer>the quick brown fox</answer>", gold) == 1.0
    assert accuracy_reward("<answer>a b c d e f g h i</answer>", gold) == 0.0  # WER > 1 clips to 0


def test_word_error_rate_hand_values():
    assert word_error_rate("a b c", "a x c") == pytest.approx(1 / 3)
    assert word_error_rate("a b c", "a c") == pytest.approx(1 / 3)
    assert word_error_rate("a b", "a b c d") == pytest.approx(1.0)
    assert word_error_rate("", "x") == 1.0


def test_free_form_rouge_mean():
    gold = _record("free-form", "red cat sat down")
    # ROUGE-1 F 3/4, ROUGE-2 F 1/3, ROUGE-L F 3/4.
    assert accuracy_reward("<answer>red dog sat down</answer>", gold) == pytest.approx(
        (0.75 + 1 / 3 + 0.75) / 3
    )
    assert accuracy_reward("<answer>cat runs</answer>", _record("free-form", "cats running")) == 1.0


@pytest.mark.parametrize(
    ("answer", "expected"), [("10", 1.0), ("8", 0.8), ("12.5", 0.75), ("25", 0.0), ("x", 0.0)]
)
def test_regression(answer, expected):
    assert accuracy_reward(f"<answer>{answer}</answer>", _record("regression", "10")) == pytest.approx(
        expected
    )


def test_regression_exact_zero_gold():
    assert accuracy_reward("<answer>0</answer>", _record("regression", "0")) == 1.0
    assert accuracy_reward("<answer>0.5</answer>", _record("regression", "0")) == 0.0


def test_unknown_problem_type_is_flagged():
    result = compute_rewards(["<answer>B</answer>"], [_record("essay", "B")], ["accuracy"], None)
    assert result.accuracy.tolist() == [0.0] and result.errors == 1


def test_parsers():
    assert extract_answer("<think>x</think><answer>\n B \n</answer>") == "B"
    assert extract_answer("no tags") is None
    assert parse_option("Option B") is None and parse_option("BC") is None and parse_option("(c)") == "C"
    assert (
        parse_number("$1,234.5$") == 1234.5 and parse_number("-.5") == -0.5 and parse_number("1e3") == 1000.0
    )
    assert parse_number("nan") is None and parse_number("6 apples") is None and parse_number("") is None


# ---------------------------------------------------------------- answer-only template


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (" B ", 1.0),
        ("a", 1.0),
        ("(A)", 1.0),
        ("D", 0.0),
        ("6.0", 0.0),
        ("B C", 0.0),
        ("", 0.0),
        ("<answer>B</answer>", 0.0),
    ],
)
def test_answer_format_multiple_choice(completion, expected):
    """Well-formed = one of the record's option letters (A and B here)."""
    assert answer_format_reward(completion, MC_B) == expected


@pytest.mark.parametrize(("completion", "expected"), [("6.0", 1.0), (" 7 ", 1.0), ("six", 0.0), ("", 0.0)])
def test_answer_format_numerical(completion, expected):
    assert answer_format_reward(completion, NUM_6) == expected


@pytest.mark.parametrize(
    ("completion", "expected"), [("B", 1.0), ("bx", 1.0), ("Cx", 0.0), ("", 0.0), (" ", 0.0)]
)
def test_answer_lead(completion, expected):
    assert answer_lead_reward(completion, MC_B) == expected
    assert answer_lead_reward(completion, NUM_6) == 0.0


def test_answer_accuracy():
    assert answer_accuracy_reward(" 6.0\n", NUM_6) == 1.0
    assert answer_accuracy_reward("(b)", MC_B) == 1.0
    assert answer_accuracy_reward("<answer>B</answer>", MC_B) == 0.0
    assert answer_accuracy_reward("", _record("OCR", "")) == 0.0


# ---------------------------------------------------------------- registry and batch scoring


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "custom_rewards_mod.py").write_text(
        textwrap.dedent(
            """
            def length(completion, record):
                return len(completion) / 10

            def broken(completion, record):
                raise RuntimeError("boom")

            def not_a_number(completion, record):
                return {"A": float("nan"), "B": float("inf"), "D": 1e39}.get(completion, 1.0)

            NOT_CALLABLE = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "custom_rewards_mod"


def test_resolve_builtin_and_dotted(reward_module):
    assert resolve_reward("accuracy") is accuracy_reward and resolve_reward("format") is format_reward
    assert resolve_reward(f"{reward_module}:length")("abcde", MC_B) == 0.5
    assert resolve_reward(f"{reward_module}.length")("abcde", MC_B) == 0.5


@pytest.mark.parametrize(
    "name",
    ["accuracyy", "no_such_module_xyz:fn", "custom_rewards_mod:missing", "custom_rewards_mod:NOT_CALLABLE"],
)
def test_resolve_bad_names_raise(reward_module, name):
    with pytest.raises(ValueError, match=repr(name)):
        resolve_reward(name)


def test_compute_rewards_weights_fields_and_errors(reward_module, caplog):
    completions = [
        "<think>t</think><answer>B</answer>",
        "<answer>A</answer>",
        "<think>t</think><answer>6.0</answer>",
    ]
    records = [MC_B, MC_B, NUM_6]
    names = ["format", "accuracy", f"{reward_module}:length"]
    result = compute_rewards(completions, records, names, [0.5, 1.0, 0.0])
    assert result.per_function["format"].tolist() == [1.0, 0.0, 1.0]
    assert result.per_function["accuracy"].tolist() == [1.0, 0.0, 1.0]
    assert torch.equal(result.accuracy, result.per_function["accuracy"])
    assert torch.equal(result.format, result.per_function["format"])
    assert result.total.tolist() == [1.5, 0.0, 1.5] and result.total.dtype == torch.float32
    assert result.errors == 0
    with caplog.at_level(logging.ERROR, logger="rollplex.algo.rewards"):
        broken = compute_rewards(completions, records, ["accuracy", f"{reward_module}:broken"], None)
    assert broken.per_function[f"{reward_module}:broken"].tolist() == [0.0, 0.0, 0.0]
    assert broken.errors == 3 and broken.total.tolist() == [1.0, 0.0, 1.0]
    assert any("boom" in r.getMessage() for r in caplog.records)


def test_a_reward_that_is_not_finite_scores_zero_and_is_counted(reward_module, caplog):
    """A custom reward returning NaN or inf for a row scores that row 0 and counts it as an error: a
    NaN reward would reach every weight through the group's advantages."""
    with caplog.at_level(logging.ERROR, logger="rollplex.algo.rewards"):
        result = compute_rewards(["A", "B", "C", "D"], [MC_B] * 4, [f"{reward_module}:not_a_number"], None)
    assert result.total.tolist() == [0.0, 0.0, 1.0, 0.0] and bool(torch.isfinite(result.total).all())
    assert result.errors == 3  # 1e39 is finite in Python but inf in float32
    assert any("returned nan" in r.getMessage() for r in caplog.records)


def test_compute_rewards_answer_only_and_absent_fields():
    result = compute_rewards(["B", "B C"], [MC_B, MC_B], ["answer_accuracy", "answer_format"], None)
    assert result.accuracy.tolist() == [1.0, 0.0] and result.format.tolist() == [1.0, 0.0]
    only_format = compute_rewards(["B"], [MC_B], ["answer_format"], None)
    assert only_format.accuracy.tolist() == [0.0]


def test_compute_rewards_counts_a_flagged_row_once():
    bad = _record("numerical", "six")
    result = compute_rewards(["6", "6"], [bad, NUM_6], ["answer_accuracy", "accuracy"], None)
    assert result.errors == 1


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((["a"], [MC_B, MC_B], ["format"], None), "records"),
        ((["a"], [MC_B], ["format", "format"], None), "unique"),
        ((["a"], [MC_B], [], None), "unique"),
        ((["a"], [MC_B], ["format"], [1.0, 2.0]), "weights"),
        ((["a"], [MC_B], ["nope"], None), "'nope'"),
    ],
)
def test_compute_rewards_bad_arguments(args, field):
    with pytest.raises(ValueError, match=field):
        compute_rewards(*args)


# ---------------------------------------------------------------- temporal bonus (B14)


B14_ORDERED = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
B14_SHUFFLED = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])


def test_b14_per_group_bonus():
    bonus = temporal_bonus(B14_ORDERED, B14_SHUFFLED, alpha=0.3, mu=1.0)
    assert torch.allclose(B14_ORDERED + bonus, torch.tensor([[1.3, 1.3, 1.3, 0.0], [0.0, 0.0, 0.0, 0.0]]))


def test_b14_groups_are_independent_of_batch_neighbours():
    together = temporal_bonus(B14_ORDERED, B14_SHUFFLED, alpha=0.3, mu=1.0)
    alone = [
        temporal_bonus(B14_ORDERED[g : g + 1], B14_SHUFFLED[g : g + 1], alpha=0.3, mu=1.0) for g in (0, 1)
    ]
    assert torch.equal(together, torch.cat(alone))


def test_b14_boundary_depends_on_mu():
    ordered = torch.tensor([[1.0, 1.0, 0.0, 0.0]])  # p = 0.5
    shuffled = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0]])  # p~ = 0.6
    assert temporal_bonus(ordered, shuffled, alpha=0.3, mu=1.0).tolist() == [[0.0, 0.0, 0.0, 0.0]]
    assert torch.allclose(
        temporal_bonus(ordered, shuffled, alpha=0.3, mu=0.8), torch.tensor([[0.3, 0.3, 0.0, 0.0]])
    )


def test_b14_tie_grants_and_threshold_is_strict():
    tie = temporal_bonus(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), torch.tensor([[0.0, 1.0, 0.0, 0.0]]), 0.3, 1.0)
    assert torch.allclose(tie, torch.tensor([[0.3, 0.0, 0.0, 0.0]]))
    partial = temporal_bonus(torch.tensor([[0.1, 0.5]]), torch.tensor([[0.0, 0.0]]), 0.3, 1.0)
    assert torch.allclose(partial, torch.tensor([[0.0, 0.3]]))


def test_temporal_bonus_bad_shapes():
    with pytest.raises(ValueError, match="same G"):
        temporal_bonus(torch.zeros(2, 4), torch.zeros(3, 4), 0.3, 1.0)
    with pytest.raises(ValueError, match="mu"):
        temporal_bonus(torch.zeros(1, 4), torch.zeros(1, 4), 0.3, -1.0)


def test_bonus_lands_on_the_groups_with_twins_only():
    """B14's two questions as groups 0 and 2 of a batch of 3 (group 1, an image, has no shuffled twin):
    total = accuracy + format + bonus, hand-computed; accuracy itself is unchanged."""
    accuracy = torch.cat([B14_ORDERED[0], torch.ones(4), B14_ORDERED[1]])
    fmt = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    rewards = RewardResult(accuracy + fmt, {"accuracy": accuracy, "format": fmt}, accuracy, fmt)
    out = add_temporal_bonus(
        rewards, ShuffledAccuracy([0, 2], B14_SHUFFLED, reward="accuracy"), 4, alpha=0.3, mu=1.0
    )
    expected_bonus = [0.3, 0.3, 0.3, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert out.per_function["temporal"].tolist() == pytest.approx(expected_bonus)
    expected_total = [2.3, 1.3, 2.3, 1.0, 2.0, 2.0, 2.0, 2.0, 0.0, 0.0, 1.0, 1.0]
    assert out.total.tolist() == pytest.approx(expected_total)
    assert torch.equal(out.accuracy, accuracy) and torch.equal(rewards.total, accuracy + fmt)


def test_bonus_counts_with_the_accuracy_weight():
    """Video-R1 adds the bonus to the accuracy reward, so it enters the total times that reward's weight."""
    acc = torch.tensor([1.0, 0.0])
    rewards = RewardResult(2.0 * acc, {"accuracy": acc}, acc, torch.zeros(2))
    out = add_temporal_bonus(
        rewards, ShuffledAccuracy([0], torch.zeros(1, 1), reward="accuracy"), 2, alpha=0.3, mu=1.0, weight=2.0
    )
    assert out.per_function["temporal"].tolist() == pytest.approx([0.3, 0.0])
    assert out.total.tolist() == pytest.approx([2.6, 0.0])


def test_bonus_without_twins_is_zero_and_rows_must_split_into_groups():
    acc = torch.ones(4)
    rewards = RewardResult(acc, {"accuracy": acc}, acc, torch.zeros(4))
    out = add_temporal_bonus(
        rewards, ShuffledAccuracy([], torch.zeros(0, 1), reward="accuracy"), 2, alpha=0.3, mu=1.0
    )
    assert torch.equal(out.total, acc) and out.per_function["temporal"].tolist() == [0.0] * 4
    with pytest.raises(ValueError, match="groups of 3"):
        add_temporal_bonus(
            rewards, ShuffledAccuracy([], torch.zeros(0, 1), reward="accuracy"), 3, alpha=0.3, mu=1.0
        )


def test_temporal_reward_name_prefers_the_configured_one():
    """reward.temporal_reward wins over a built-in accuracy listed before it; empty, the first built-in
    accuracy; None without one."""
    assert temporal_reward_name(["accuracy", "mod:fn", "format"], "mod:fn") == "mod:fn"
    assert temporal_reward_name(["format", "answer_accuracy", "accuracy"]) == "answer_accuracy"
    assert temporal_reward_name(["format", "mod:fn"]) is None


def test_compared_values_are_put_in_range():
    """T-GRPO compares accuracies: a user's values are clipped to [0, 1], NaN counts as 0, and the
    changed ones are counted."""
    values, count = accuracy_range(torch.tensor([0.5, 1.5, -0.2, float("nan"), 1.0, 0.0]))
    assert torch.equal(values, torch.tensor([0.5, 1.0, 0.0, 0.0, 1.0, 0.0])) and count == 3


# ---------------------------------------------------------------- the run's check of the reward section


def _checked(overrides: list[str]) -> Config:
    """A config loaded with ``overrides`` and passed through the run's reward check."""
    cfg = load_config(None, overrides)
    check_reward_config(cfg.reward)
    return cfg


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (["reward.functions=[nosuch]"], ["reward.functions", "'nosuch'", "built-in"]),
        (
            ["reward.functions=[no.such_module:fn]"],
            ["reward.functions", "cannot be imported", "PYTHONPATH=."],
        ),
        (
            ["reward.functions=[format]", "reward.temporal_alpha=0.3"],
            [
                "reward.temporal_alpha=0.3",
                "reward.functions=['format']",
                "accuracy",
                "reward.temporal_reward",
            ],
        ),
        (
            ["reward.functions=[accuracy, format]", "reward.temporal_reward=format"],
            ["reward.temporal_reward='format' is not an accuracy", "['accuracy', 'answer_accuracy']"],
        ),
    ],
)
def test_the_run_check_names_the_reward_fields(overrides, needles):
    """The reward names load (config.py checks their syntax only) and fail the run's check, as a
    ConfigError naming the field and value."""
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError) as info:
        check_reward_config(cfg.reward)
    for needle in needles:
        assert needle in str(info.value)


def test_reward_module_that_fails_to_import_is_a_config_error(tmp_path, monkeypatch):
    """A reward module with a syntax error fails the run's check as a ConfigError naming the field, the
    reward and the error type, not as a traceback."""
    (tmp_path / "broken_reward.py").write_text("def score(text, record):\n    return (\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as info:
        _checked(["reward.functions=[broken_reward:score]"])
    for needle in ("reward.functions", "broken_reward:score", "SyntaxError"):
        assert needle in str(info.value)


def test_only_a_reward_module_that_is_not_found_itself_suggests_pythonpath(tmp_path, monkeypatch):
    """A module missing from the path gets the PYTHONPATH hint; a module that is found but imports a
    missing dependency does not (the path is not what is wrong)."""
    (tmp_path / "needs_a_dependency.py").write_text("import no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as found:
        _checked(["reward.functions=[needs_a_dependency:score]"])
    assert "no_such_dependency" in str(found.value) and "PYTHONPATH" not in str(found.value)
    with pytest.raises(ConfigError) as missing:
        _checked(["reward.functions=[not_on_the_path.rewards:score]"])
    assert "PYTHONPATH=." in str(missing.value)


def test_custom_reward_can_drive_t_grpo(tmp_path, monkeypatch):
    """A run whose only accuracy reward is a custom function passes when reward.temporal_reward names it."""
    (tmp_path / "my_accuracy.py").write_text("def score(text, record):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    functions = "reward.functions=[my_accuracy:score, format]"
    cfg = _checked([functions, "reward.temporal_alpha=0.3", "reward.temporal_reward=my_accuracy:score"])
    assert cfg.reward.temporal_reward == "my_accuracy:score"
    with pytest.raises(ConfigError, match="reward.temporal_reward"):
        _checked([functions, "reward.temporal_alpha=0.3"])
