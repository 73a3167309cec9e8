"""Rule-based rewards of Video-R1 (docs/video-r1-format.md, "Rewards") with the corrected parsing of field
case B13.

A reward function has the signature ``fn(completion: str, record: Record) -> float``; ``completion``
is the decoded response with special tokens skipped. Built-ins:

    format            1.0 iff the completion is exactly one think block then one answer block
    accuracy          per-``problem_type`` score of the single answer block against the gold answer
    answer_format     answer-only template: 1.0 iff the stripped completion is one word without tags
    answer_accuracy   answer-only template: the stripped completion IS the answer

Flagged samples (gold answer unparseable or empty, unknown problem type, or a reward that raised)
score 0.0 - never a free 1.0 - are logged, and are counted in ``RewardResult.errors``.

Also here: the T-GRPO temporal bonus (Video-R1, Feng et al. 2025; field case B14) as a per-group function.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rollplex.config import ConfigError, RewardConfig, conflict
from rollplex.types import Record, RewardResult, ShuffledAccuracy

log = logging.getLogger(__name__)

RewardFn = Callable[[str, Record], float]

THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE = "<think>", "</think>", "<answer>", "</answer>"
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # rewards are stored in float32
_FORMAT_RE = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_OPTION_RE = re.compile(r"\(?\s*([A-Za-z])\s*(?:[.)].*)?", re.DOTALL)
_NUMBER_RE = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_TAG_RE = re.compile(r"<[^<>]*>")
_REL_ERR_FLOOR = 1e-9


@dataclass(frozen=True)
class Score:
    """A reward value and, for a flagged sample, why (``problem`` None when the sample is fine)."""

    value: float
    problem: str | None = None


class _FlaggedSample(Exception):
    """A sample that must score 0.0 and be counted (bad gold answer, unknown problem type)."""


# ---------------------------------------------------------------- answer extraction and parsing


def extract_answer(text: str) -> str | None:
    """Content of the single ``<answer>...</answer>`` block, stripped; None unless the text holds
    exactly one ``<answer>`` and one ``</answer>``, in that order (B13: duplicate tags earn nothing).

    Example: "<think>x</think><answer> B </answer>" -> "B"; "<answer>B</answer></answer>" -> None.
    """
    if text.count(ANSWER_OPEN) != 1 or text.count(ANSWER_CLOSE) != 1:
        return None
    found = _ANSWER_RE.search(text)
    return found.group(1).strip() if found else None


def parse_option(text: str) -> str | None:
    """Upper-case option letter of a multiple-choice answer, or None.

    Accepted: "B", "b", "(B)", "B.", "B) a dog", "B. a dog"; rejected: "B or C", "BC", "Option B".
    """
    found = _OPTION_RE.fullmatch(text.strip())
    return found.group(1).upper() if found else None


def parse_number(text: str) -> float | None:
    """Finite float of a numeric answer after deleting ``$`` and ``,`` and stripping, or None.

    Example: "$1,234.5$" -> 1234.5; "6.0" -> 6.0; "six" -> None; "nan" -> None.
    """
    cleaned = text.replace("$", "").replace(",", "").strip()
    if not _NUMBER_RE.fullmatch(cleaned):
        return None
    value = float(cleaned)
    return value if math.isfinite(value) else None


def word_error_rate(reference: str, hypothesis: str) -> float:
    """Word-level Levenshtein distance (whitespace split, case-sensitive) / max(1, #reference words).

    Source: Video-R1 grpo.py ``wer`` (docs/video-r1-format.md, "Rewards"). Example: "a b c" vs "a x c" -> 1/3.
    """
    ref, hyp = reference.split(), hypothesis.split()
    prev = list(range(len(hyp) + 1))
    for i, r_word in enumerate(ref, start=1):
        cur = [i]
        for j, h_word in enumerate(hyp, start=1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r_word != h_word)))
        prev = cur
    return prev[-1] / max(1, len(ref))


@functools.cache
def _rouge_scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)


def rouge_mean(reference: str, hypothesis: str) -> float:
    """Mean of ROUGE-1, ROUGE-2 and ROUGE-L F-measures (``rouge_score``, Porter stemming), in [0, 1].

    Source: Video-R1 grpo.py ``compute_rouge_score`` (docs/video-r1-format.md, "Rewards").
    """
    scores = _rouge_scorer().score(reference, hypothesis)
    return sum(s.fmeasure for s in scores.values()) / len(scores)


# ---------------------------------------------------------------- per-type comparison


def _clip01(value: float) -> float:
    return min(1.0, max(0.0, value))


def _text(text: str) -> str:
    return text


def _multiple_choice(answer: str, gold: str) -> float:
    return float(parse_option(answer) == gold)


def _numerical(answer: str, gold: float) -> float:
    value = parse_number(answer)
    return float(value is not None and round(value, 2) == round(gold, 2))


def _regression(answer: str, gold: float) -> float:
    value = parse_number(answer)
    if value is None:
        return 0.0
    return 1.0 - _clip01(abs(value - gold) / max(abs(gold), _REL_ERR_FLOOR))


def _ocr(answer: str, gold: str) -> float:
    return _clip01(1.0 - word_error_rate(gold, answer))


def _free_form(answer: str, gold: str) -> float:
    return _clip01(rouge_mean(gold, answer))


# problem_type -> (parser of the gold answer, comparison of an answer with the parsed gold)
_RULES: dict[str, tuple[Callable[[str], Any], Callable[[str, Any], float]]] = {
    "multiple choice": (parse_option, _multiple_choice),
    "numerical": (parse_number, _numerical),
    "OCR": (_text, _ocr),
    "free-form": (_text, _free_form),
    "regression": (parse_number, _regression),
}


def _parsed_gold(record: Record, parse: Callable[[str], Any]) -> Any:
    gold = extract_answer(record.solution)
    parsed = parse(gold) if gold else None
    if parsed is None:
        raise _FlaggedSample(
            f"gold answer of problem_id={record.problem_id} ({record.problem_type}) is missing, empty or "
            f"cannot be parsed: solution={record.solution!r}"
        )
    return parsed


def _compare(answer: str | None, record: Record) -> float:
    """Accuracy of ``answer`` (None: no answer) against the record's gold; the gold is checked first,
    so a bad gold answer is flagged whatever the completion."""
    if record.problem_type not in _RULES:
        raise _FlaggedSample(
            f"problem_id={record.problem_id} has unknown problem_type {record.problem_type!r}"
        )
    parse, compare = _RULES[record.problem_type]
    gold = _parsed_gold(record, parse)
    return 0.0 if answer is None else compare(answer, gold)


def _scored(fn: Callable[[str, Record], float], completion: str, record: Record) -> Score:
    try:
        value = float(fn(completion, record))
    except _FlaggedSample as flag:
        return Score(0.0, str(flag))
    # any failing reward scores 0.0 and is counted (docs/video-r1-format.md, "Rewards")
    except Exception as exc:
        return Score(0.0, f"reward raised on problem_id={record.problem_id}: {exc!r}")
    # NaN, inf, or a value that becomes inf in float32 would reach every weight through the advantages
    if not abs(value) <= _FLOAT32_MAX:
        return Score(0.0, f"reward returned {value} on problem_id={record.problem_id}")
    return Score(value)


# ---------------------------------------------------------------- scorers: value and flag


def score_format(completion: str, record: Record) -> Score:
    """Video-R1 format reward, strict (B13); see :func:`format_reward`."""
    one_each = all(completion.count(tag) == 1 for tag in (THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE))
    return Score(float(one_each and _FORMAT_RE.fullmatch(completion) is not None))


def score_accuracy(completion: str, record: Record) -> Score:
    """Video-R1 accuracy reward with B13 fixes; see :func:`accuracy_reward`."""
    return _scored(lambda c, r: _compare(extract_answer(c), r), completion, record)


def score_answer_format(completion: str, record: Record) -> Score:
    """Answer-only format reward; see :func:`answer_format_reward`."""
    answer = completion.strip()
    if record.problem_type == "multiple choice":
        letters = {parse_option(option) for option in record.options}
        return Score(float(parse_option(answer) in letters - {None}))
    if record.problem_type in ("numerical", "regression"):
        return Score(float(parse_number(answer) is not None))
    words = answer.split()
    return Score(float(len(words) >= 1 and _TAG_RE.search(answer) is None))


def score_answer_lead(completion: str, record: Record) -> Score:
    """Answer-only lead reward; see :func:`answer_lead_reward`."""
    if record.problem_type != "multiple choice":
        return Score(0.0)

    def lead(text: str, rec: Record) -> float:
        answer = text.strip()
        return float(bool(answer) and answer[0].upper() == _parsed_gold(rec, parse_option))

    return _scored(lead, completion, record)


def score_answer_accuracy(completion: str, record: Record) -> Score:
    """Answer-only accuracy reward; see :func:`answer_accuracy_reward`."""
    return _scored(lambda c, r: _compare(c.strip(), r), completion, record)


# ---------------------------------------------------------------- public reward functions


def _logged(score: Score, name: str) -> float:
    if score.problem is not None:
        log.error("reward %s flagged a sample: %s", name, score.problem)
    return score.value


def format_reward(completion: str, record: Record) -> float:
    """1.0 iff the whole completion is one think block, optional whitespace, one answer block; else 0.0.

    Definition: ``re.fullmatch(r"<think>.*?</think>\\s*<answer>.*?</answer>", DOTALL)`` (Video-R1
    grpo.py; docs/video-r1-format.md, "Rewards") AND each of the four tags occurs exactly once (B13). Nothing
    may precede ``<think>`` or follow ``</answer>``; block contents may span lines.

    Example: "<think>\\nstep one\\n</think>\\n<answer>B</answer>" -> 1.0;
    "<think>x</think><answer>B</answer></answer>" -> 0.0; two think blocks -> 0.0.
    """
    return _logged(score_format(completion, record), "format")


def accuracy_reward(completion: str, record: Record) -> float:
    """Accuracy in [0, 1] of the single answer block against the gold ``<answer>`` of ``record.solution``.

    Per ``record.problem_type`` (docs/video-r1-format.md, "Rewards"; corrected per B13):
        multiple choice  option letters equal, case-insensitive, after :func:`parse_option`
                         ("(B)", "b", "B) a dog" match gold "B"; "B or C" scores 0)
        numerical        :func:`parse_number` of both equal after rounding to 2 decimals ("6.0" == "6")
        OCR              clip(1 - :func:`word_error_rate`(gold, answer), 0, 1)
        free-form        clip(:func:`rouge_mean`(gold, answer), 0, 1)
        regression       1 - clip(|answer - gold| / max(|gold|, 1e-9), 0, 1) (exact answer -> exactly 1.0;
                         Video-R1 also adds 1e-9 to the numerator, which scores 0 for gold 0)
    No single answer block -> 0.0. Gold missing, empty or unparseable, or an unknown problem type ->
    0.0, logged and flagged (this includes an empty answer against an empty gold). Any exception -> 0.0.
    """
    return _logged(score_accuracy(completion, record), "accuracy")


def answer_format_reward(completion: str, record: Record) -> float:
    """Answer-only template: 1.0 iff the stripped completion is a well-formed answer of the record's
    type — one of the record's option letters (multiple choice, parsed by :func:`parse_option`), a
    number (numerical, regression), non-empty text without tags (OCR, free-form); else 0.0.
    Example: " B " with options A–D -> 1.0; "E" -> 0.0; "B C" -> 0.0."""
    return _logged(score_answer_format(completion, record), "answer_format")


def answer_lead_reward(completion: str, record: Record) -> float:
    """Answer-only template, multiple choice, shaping term: 1.0 iff the completion's first character
    is the gold option letter (case-insensitive), even if more text follows; 0.0 otherwise and for
    other problem types. It gives a model trained from scratch a signal for the right letter before
    it has learned to stop right after it; ``answer_accuracy`` stays the strict measure."""
    return _logged(score_answer_lead(completion, record), "answer_lead")


def answer_accuracy_reward(completion: str, record: Record) -> float:
    """Answer-only template: the stripped completion is the answer; same per-type comparisons and flags
    as :func:`accuracy_reward`. Example: "6.0" with gold "<answer>6</answer>" (numerical) -> 1.0."""
    return _logged(score_answer_accuracy(completion, record), "answer_accuracy")


ACCURACY_REWARDS = ("accuracy", "answer_accuracy")
FORMAT_REWARDS = ("format", "answer_format")
BUILTIN_REWARDS: dict[str, RewardFn] = {
    "accuracy": accuracy_reward,
    "format": format_reward,
    "answer_accuracy": answer_accuracy_reward,
    "answer_format": answer_format_reward,
    "answer_lead": answer_lead_reward,
}
_BUILTIN_SCORERS: dict[str, Callable[[str, Record], Score]] = {
    "accuracy": score_accuracy,
    "format": score_format,
    "answer_accuracy": score_answer_accuracy,
    "answer_format": score_answer_format,
    "answer_lead": score_answer_lead,
}


# ---------------------------------------------------------------- registry and batch scoring


def resolve_reward(name: str) -> RewardFn:
    """The reward function called ``name``: a built-in name (``BUILTIN_REWARDS``) or a dotted path
    ``package.module:function`` / ``package.module.function`` to a callable ``(str, Record) -> float``.

    Raises:
        ValueError: naming ``name`` when it is neither a built-in nor an importable callable (any
            exception raised while importing its module is reported this way, with its type).
    """
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    module_name, sep, attr = name.rpartition(":") if ":" in name else name.rpartition(".")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"reward {name!r} is not a built-in ({sorted(BUILTIN_REWARDS)}) nor a dotted path 'package.module:function'"
        )
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except Exception as exc:  # noqa: BLE001 - a user module may fail to import in any way (SyntaxError, ...)
        # the module itself (or a package of its path) was not found, not a dependency it imports
        own = isinstance(exc, ModuleNotFoundError) and f"{module_name}.".startswith(f"{exc.name}.")
        hint = " (is its folder on PYTHONPATH? e.g. PYTHONPATH=.)" if own else ""
        raise ValueError(f"reward {name!r} cannot be imported: {type(exc).__name__}: {exc}{hint}") from exc
    if not callable(fn):
        raise ValueError(f"reward {name!r} resolves to a non-callable {type(fn).__name__}")
    return fn


def _resolve_scorer(name: str) -> Callable[[str, Record], Score]:
    if name in _BUILTIN_SCORERS:
        return _BUILTIN_SCORERS[name]
    fn = resolve_reward(name)
    return lambda completion, record: _scored(fn, completion, record)


def compute_rewards(
    completions: list[str],
    records: list[Record],
    names: list[str],
    weights: list[float] | None = None,
    rows: str = "row",
) -> RewardResult:
    """Score B completions with every named reward function and sum them with weights.

    Definition: total[b] = sum_i weights[i] · f_i(completions[b], records[b]) (Video-R1 sums
    ``["accuracy", "format"]`` with unit weights; docs/video-r1-format.md, "Rewards").
    ``RewardResult.accuracy`` / ``.format`` are the values of the first accuracy-type ("accuracy",
    "answer_accuracy") / format-type ("format", "answer_format") function in ``names``, zeros if none is
    present. ``errors`` counts the responses flagged by at least one function (each flagged sample is also
    logged).

    Args:
        completions: B decoded responses. records: B records, ``records[b]`` is the record of row b.
        names: reward names for :func:`resolve_reward`, no duplicates.
        weights: one float per name; None means all 1.0.
        rows: what a row is called in the log line of a flagged sample (e.g. "shuffled-frame row").

    Returns:
        RewardResult with float32 [B] tensors on the CPU.

    Raises:
        ValueError: length mismatch, empty or duplicate ``names``, or an unknown reward name.
    """
    if len(completions) != len(records):
        raise ValueError(f"{len(completions)} completions but {len(records)} records")
    if not names or len(set(names)) != len(names):
        raise ValueError(f"reward names must be non-empty and unique, got {names}")
    weights = [1.0] * len(names) if weights is None else list(weights)
    if len(weights) != len(names):
        raise ValueError(f"{len(weights)} reward weights for {len(names)} reward names {names}")
    per_function: dict[str, torch.Tensor] = {}
    flagged = [False] * len(completions)
    for name in names:
        scorer = _resolve_scorer(name)
        scores = [scorer(c, r) for c, r in zip(completions, records, strict=True)]
        for b, score in enumerate(scores):
            if score.problem is not None:
                log.error("reward %s flagged %s %d: %s", name, rows, b, score.problem)
                flagged[b] = True
        per_function[name] = torch.tensor([s.value for s in scores], dtype=torch.float32)
    total = sum(
        (w * per_function[n] for n, w in zip(names, weights, strict=True)), torch.zeros(len(completions))
    )
    return RewardResult(
        total=total,
        per_function=per_function,
        accuracy=_first_of(per_function, ACCURACY_REWARDS, len(completions)),
        format=_first_of(per_function, FORMAT_REWARDS, len(completions)),
        errors=sum(flagged),
    )


def first_of_kind(names: Sequence[str], kinds: tuple[str, ...]) -> str | None:
    """The first of ``names`` that is one of ``kinds`` (e.g. ``ACCURACY_REWARDS``), or None: the function
    whose values ``RewardResult.accuracy`` / ``.format`` hold."""
    return next((name for name in names if name in kinds), None)


def temporal_reward_name(functions: Sequence[str], chosen: str = "") -> str | None:
    """The reward T-GRPO compares between ordered and shuffled frames: ``chosen``
    (``reward.temporal_reward``, any name in ``functions``, custom ones included), else the first
    built-in accuracy reward among ``functions`` (``ACCURACY_REWARDS``), else None."""
    return chosen or first_of_kind(functions, ACCURACY_REWARDS)


def check_reward_config(reward: RewardConfig) -> None:
    """The checks of the ``reward`` section that need the reward functions themselves (config.py checks
    its syntax at load; the training run calls this before it writes anything): every name of
    ``reward.functions`` resolves (``resolve_reward``), and T-GRPO compares an accuracy
    (``reward.temporal_reward`` a built-in accuracy or a ``module:function``; with
    ``reward.temporal_alpha`` > 0, some accuracy to compare).

    Raises:
        ConfigError: naming the field(s) and value(s) at fault.
    """
    chosen = reward.temporal_reward
    if chosen and ":" not in chosen and chosen not in ACCURACY_REWARDS:
        raise ConfigError(
            f"reward.temporal_reward={chosen!r} is not an accuracy: T-GRPO compares accuracies; "
            f"name one of {list(ACCURACY_REWARDS)} or your own module:function"
        )
    if reward.temporal_alpha > 0 and temporal_reward_name(reward.functions, chosen) is None:
        why = (
            f"the T-GRPO bonus compares accuracies: name one of {list(ACCURACY_REWARDS)}, or set "
            "reward.temporal_reward to your own accuracy function"
        )
        raise conflict(
            "reward.temporal_alpha", reward.temporal_alpha, "reward.functions", reward.functions, why
        )
    for name in reward.functions:
        try:
            resolve_reward(name)
        except ValueError as err:
            raise ConfigError(f"reward.functions: {err}") from err


def compared_values(rewards: RewardResult, shuffled: ShuffledAccuracy) -> torch.Tensor:
    """float32 [B] in [0, 1]: the ordered-frame values of the reward ``shuffled`` was scored with
    (``ShuffledAccuracy.reward``), put in [0, 1] as ``accuracy_range`` does."""
    return accuracy_range(rewards.per_function[shuffled.reward])[0]


def accuracy_range(values: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``values`` with NaN set to 0 and the rest clipped to [0, 1], and how many were changed: T-GRPO's
    rule compares accuracies, and a user's reward named by ``reward.temporal_reward`` may return
    anything."""
    count = int((~((values >= 0) & (values <= 1))).sum())
    return torch.nan_to_num(values, nan=0.0).clamp(0.0, 1.0), count


def _first_of(per_function: dict[str, torch.Tensor], kinds: tuple[str, ...], rows: int) -> torch.Tensor:
    name = first_of_kind(list(per_function), kinds)
    return per_function[name] if name is not None else torch.zeros(rows, dtype=torch.float32)


# ---------------------------------------------------------------- T-GRPO temporal bonus


def temporal_bonus(
    ordered_acc: torch.Tensor,
    shuffled_acc: torch.Tensor,
    alpha: float,
    mu: float,
    *,
    min_accuracy: float = 0.1,
) -> torch.Tensor:
    """T-GRPO bonus of each ordered-frame response, decided per group (question), never per batch.

    Definition (Video-R1 T-GRPO, Feng et al. 2025; docs/video-r1-format.md, "Rewards"; corrected per B14): for
    group g let p_g = mean of its N ordered accuracies and p~_g = mean of its M shuffled-frame accuracies. If
    p_g >= mu · p~_g, every ordered response of g with accuracy > ``min_accuracy`` gets ``alpha``; otherwise
    the group gets nothing. Ties (p_g == mu · p~_g in float32) GRANT the bonus, as Video-R1's ``>=``; a group
    with p = p~ = 0 has no response above the threshold, so it still gets 0. ``mu`` is explicit: Video-R1
    hard-codes 0.8, its maintainers say 1.0 is intended (B14). Shuffled responses only set p~; they never
    receive a bonus or enter the loss.

    Example (B14, alpha 0.3, mu 1.0): ordered [[1,1,1,0],[0,0,0,0]], shuffled [[1,0,0,0],[1,1,0,0]]
        -> [[0.3, 0.3, 0.3, 0], [0, 0, 0, 0]]  (accuracy + bonus: [1.3, 1.3, 1.3, 0] and [0, 0, 0, 0]).

    Args:
        ordered_acc: float [G, N] accuracy rewards of the ordered-frame responses.
        shuffled_acc: float [G, M] accuracy rewards of the shuffled-frame responses, same G.
        alpha: bonus added to an eligible response's accuracy reward.
        mu: >= 0, threshold factor.
        min_accuracy: a response is eligible iff its accuracy is strictly above this (Video-R1 0.1).

    Returns:
        float [G, N], dtype of ``ordered_acc``: the bonus to add (0 or alpha).

    Raises:
        ValueError: inputs not 2-D with the same number of groups, empty, or ``mu`` < 0.
    """
    if ordered_acc.dim() != 2 or shuffled_acc.dim() != 2 or ordered_acc.shape[0] != shuffled_acc.shape[0]:
        raise ValueError(
            f"ordered_acc [G, N] and shuffled_acc [G, M] need the same G, got {tuple(ordered_acc.shape)} "
            f"and {tuple(shuffled_acc.shape)}"
        )
    if ordered_acc.shape[1] == 0 or shuffled_acc.shape[1] == 0:
        raise ValueError(
            f"empty groups: ordered {tuple(ordered_acc.shape)}, shuffled {tuple(shuffled_acc.shape)}"
        )
    if mu < 0:
        raise ValueError(f"mu must be >= 0, got {mu}")
    granted_G = ordered_acc.mean(dim=1) >= mu * shuffled_acc.mean(dim=1)
    eligible_GN = granted_G[:, None] & (ordered_acc > min_accuracy)
    return torch.where(eligible_GN, alpha, 0.0).to(ordered_acc.dtype)


def add_temporal_bonus(
    rewards: RewardResult,
    shuffled: ShuffledAccuracy,
    group_size: int,
    alpha: float,
    mu: float,
    weight: float = 1.0,
) -> RewardResult:
    """``rewards`` with T-GRPO's bonus (``temporal_bonus``) of the groups in ``shuffled``, kept as
    ``per_function["temporal"]`` (float32 [B], 0 outside those groups) and added to the total times
    ``weight``, the compared reward's weight: Video-R1 adds the bonus to the accuracy reward
    (docs/video-r1-format.md, "Rewards"). The ordered values compared are those of the reward ``shuffled`` was
    scored with (``compared_values``). ``accuracy`` is left as it was, so it stays the plain accuracy of the
    responses.

    Args:
        rewards: rewards of B = G·N ordered-frame responses (row b in group b // N).
        shuffled: accuracies of the shuffled-frame responses of some groups.
        group_size: N. alpha, mu: as in ``temporal_bonus`` (``reward.temporal_alpha``, ``temporal_mu``).
        weight: weight of the compared reward in the total (``reward.weights``; 1.0 by default).

    Raises:
        ValueError: as ``temporal_bonus``; B not a multiple of N.
    """
    if rewards.total.numel() % group_size:
        raise ValueError(f"{rewards.total.numel()} rewards do not split into groups of {group_size}")
    bonus = torch.zeros_like(rewards.total)
    if shuffled.groups:
        ordered = compared_values(rewards, shuffled).view(-1, group_size)[shuffled.groups]
        bonus.view(-1, group_size)[shuffled.groups] = temporal_bonus(
            ordered, shuffled.accuracy, alpha, mu
        ).to(bonus.dtype)
    per_function = {**rewards.per_function, "temporal": bonus}
    return dataclasses.replace(rewards, total=rewards.total + weight * bonus, per_function=per_function)
