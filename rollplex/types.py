"""Stage-boundary records of one GRPO iteration.

Every hand-off between phases is one of these dataclasses; no dicts of strings cross a stage
boundary. Shapes use the legend:

    G  prompt groups in the batch          N  responses per group (group size)
    B  = G·N response rows                 R  response budget (padded response length)
    P  prompt length of one group          P_max  longest prompt in the batch
    L  decoder layers                      H_kv   key/value heads, D head dim
    V  vocabulary size

Padding: response tensors are right-padded to R; which positions are real comes from the recorded
lengths (``response_lens``), never from token values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

VISION_KINDS = ("video", "image", "none")


@dataclass(frozen=True)
class Record:
    """One validated Video-R1 record (docs/video-r1-format.md, "Record schema").

    Example:
        Record(problem_id=7, problem="What colour is the cube?", data_type="video",
               problem_type="multiple choice", options=["A. red", "B. blue"],
               solution="<answer>B</answer>", path="./CLEVRER/video_7.mp4", data_source="synth")
    """

    problem_id: int
    problem: str
    data_type: str
    problem_type: str
    options: tuple[str, ...]
    solution: str
    path: str
    data_source: str


@dataclass(frozen=True)
class VisualInput:
    """Decoded media of one prompt, before the processor.

    ``frames``: uint8 [T, 3, H, W] already resized to multiples of 28 (video; T even) or
    uint8 [1, 3, H, W] (image); ``None`` for text-only prompts. ``sample_fps`` is the rate of the
    frames actually sampled (frames per second of source time); it defines
    ``second_per_grid_ts = temporal_patch_size / sample_fps`` (docs/video-r1-format.md, "Video sampling";
    field case B04).

    Example:
        VisualInput(kind="video", frames=torch.zeros(8, 3, 56, 56, dtype=torch.uint8), sample_fps=2.0)
    """

    kind: str
    frames: torch.Tensor | None
    sample_fps: float | None


@dataclass
class Prompt:
    """One tokenised prompt with its vision tensors and 3D positions; the unit of a GRPO group.

    Fields:
        record: the source record.
        input_ids: int64 [P], chat-templated prompt with placeholders expanded.
        position_ids: int64 [3, P], M-RoPE positions (temporal, height, width) by the reference rule.
        next_position: first response position (max prompt position + 1), same on all 3 axes.
        pixel_values: float [rows, 1176] image patch rows or ``None``; ``image_grid_thw`` int64 [n, 3].
        pixel_values_videos: float [rows, 1176] or ``None``; ``video_grid_thw`` int64 [n, 3];
        second_per_grid_ts: float64 [n] seconds per temporal grid of each video.
        content_key: hex digest of the token ids and the actual pixel bytes; two prompts share
            prefix state only if their keys are equal.
        shuffled: the same prompt with the video's sampled frames in a fixed random order (T-GRPO,
            data.encode.shuffled_twin), or ``None`` (images, text, or T-GRPO off).

    Example:
        Prompt(record=r, input_ids=ids[P], position_ids=pos[3, P], next_position=12, ...)
    """

    record: Record
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    next_position: int
    content_key: str
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None
    shuffled: Prompt | None = None

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class PrefixState:
    """Boundary state of G prompt prefixes under one set of weights (paper §2.3).

    Fields:
        keys, values: per layer, [G, H_kv, P_max, D] in the model dtype, keys after RoPE; positions
            at or beyond ``prompt_lens[g]`` are padding and are never attended.
        prompt_lens: int64 [G].
        host_prompt_lens: the same G lengths on the host (the suffix attention slices each group's
            boundary by them without reading ``prompt_lens`` back).
        next_position: int64 [G], 3D position of the first response token of each group.
        last_logprobs: float32 [G, V], log-probs (trainer definition, see models.logprobs) at the last
            prompt position; they score the first response token.
        content_keys: the groups' ``Prompt.content_key``.
        attached: True for the actor prefix (autograd graph kept), False for detached prefixes.

    Example:
        PrefixState(keys=[k0, k1], values=[v0, v1], prompt_lens=tensor([30, 41]), host_prompt_lens=(30, 41),
                    next_position=tensor([25, 33]), last_logprobs=lp[2, V], content_keys=["ab..", "cd.."],
                    attached=False)
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    prompt_lens: torch.Tensor
    host_prompt_lens: tuple[int, ...]
    next_position: torch.Tensor
    last_logprobs: torch.Tensor
    content_keys: list[str]
    attached: bool

    @property
    def num_groups(self) -> int:
        return int(self.prompt_lens.shape[0])


@dataclass
class DecodeTimeline:
    """When the decode loop reached its round boundaries, in host-clock seconds (``time.perf_counter``).

    ``marks`` are (decode steps run so far, seconds) pairs: the first once the step graphs exist and the
    device has caught up, then one at the end of every round of ``eos_check_every`` steps (on CUDA the
    time a CUDA event on the decode stream completed, converted to the host clock). They time decode
    without adding synchronisation, and tell how fast decode ran before and after concurrent work ended
    (Eq. 1's ΔD). ``steps`` counts steps run: at most R − 1, and on CUDA one
    round more than needed when every row finishes early (the host reads each round's flag one round
    late).
    """

    marks: list[tuple[int, float]] = field(default_factory=list)

    @property
    def start(self) -> float:
        return self.marks[0][1] if self.marks else float("nan")

    @property
    def end(self) -> float:
        return self.marks[-1][1] if self.marks else float("nan")

    @property
    def steps(self) -> int:
        return self.marks[-1][0] if self.marks else 0


@dataclass
class RolloutBatch:
    """N sampled responses for each of G prompts.

    Fields:
        prompts: the G prompts, in group order.
        group_size: N.
        responses: int64 [B, R], right-padded with ``pad_token_id``; row b belongs to group b // N.
        response_lens: int64 [B], number of real tokens (EOS included when it was sampled).
        logprobs: float32 [B, R], log-probs recorded at sampling under the trainer's definition;
            0 at padding.
        texts: decoded responses (special tokens skipped), length B.
        truncated: bool [B], True when the budget ran out before an EOS.
        timeline: when the decode loop reached its synchronisation points (empty if not recorded).
        setup_s: seconds (host clock) from building the decode step to its CUDA graphs captured,
            warm-up passes included; 0 where no decode loop ran.

    Example:
        RolloutBatch(prompts=[p0, p1], group_size=2, responses=ids[4, 6], response_lens=tensor([3, 6, 2, 4]),
                     logprobs=lp[4, 6], texts=["B", ...], truncated=tensor([False, True, False, False]))
    """

    prompts: list[Prompt]
    group_size: int
    responses: torch.Tensor
    response_lens: torch.Tensor
    logprobs: torch.Tensor
    texts: list[str]
    truncated: torch.Tensor
    timeline: DecodeTimeline = field(default_factory=DecodeTimeline)
    setup_s: float = 0.0

    def response_mask(self) -> torch.Tensor:
        """bool [B, R], True at real response tokens (from ``response_lens``)."""
        steps = torch.arange(self.responses.shape[1], device=self.responses.device)
        return steps[None, :] < self.response_lens[:, None]


@dataclass
class RewardResult:
    """Rewards of B responses.

    Fields:
        total: float32 [B], weighted sum over reward functions.
        per_function: name -> float32 [B], unweighted value of each function.
        accuracy: float32 [B] in [0, 1]; format: float32 [B] in {0, 1}.
        errors: number of responses whose gold answer could not be parsed or whose reward raised.
    """

    total: torch.Tensor
    per_function: dict[str, torch.Tensor]
    accuracy: torch.Tensor
    format: torch.Tensor
    errors: int = 0


@dataclass
class ShuffledAccuracy:
    """Accuracies of T-GRPO's shuffled-frame rollout (Video-R1, Feng et al. 2025).

    Fields:
        groups: indices (into the rollout's G groups) of the groups that have a shuffled twin, ascending.
        accuracy: float32 [len(groups), M] in [0, 1], the compared reward (below) of each of the M
            shuffled-frame responses of those groups; these responses set the bonus only and never enter
            the loss.
        errors: number of shuffled-frame responses whose compared reward flagged a problem or fell outside
            [0, 1].
        reward: name of the compared reward function (``reward.temporal_reward``, else the run's first
            built-in accuracy reward; ``algo.rewards.temporal_reward_name``), keyword only.

    Example:
        ShuffledAccuracy(groups=[0, 2], accuracy=torch.tensor([[1.0, 0.0], [0.0, 0.0]]), reward="accuracy")
    """

    groups: list[int]
    accuracy: torch.Tensor
    errors: int = 0
    reward: str = field(kw_only=True)


@dataclass
class ScoredBatch:
    """A rollout batch with rewards, advantages and reference log-probs: the input of training.

    Fields:
        rollout: the rollout batch.
        rewards: its rewards.
        advantages: float32 [B], group advantages (one value per response).
        zero_variance_groups: number of groups whose rewards were all equal (advantage exactly 0).
        ref_logprobs: float32 [B, R] under the frozen reference, 0 at padding; None when KL is off.
        shuffled: T-GRPO's shuffled-frame accuracies (None when T-GRPO is off).
    """

    rollout: RolloutBatch
    rewards: RewardResult
    advantages: torch.Tensor
    zero_variance_groups: int
    ref_logprobs: torch.Tensor | None
    shuffled: ShuffledAccuracy | None = None


@dataclass
class StepStats:
    """Scalars of one optimizer step, written as one line of metrics.jsonl."""

    step: int
    values: dict[str, float] = field(default_factory=dict)
