"""Prompt text of a Video-R1 record (docs/video-r1-format.md, "Prompt construction").

Two templates:

- ``video_r1``: Video-R1's RL prompt — the question (multiple choice: problem + "Options:\\n" + one
  option per line), the "think then answer" instruction and the per-type answer suffix, exactly as in
  Video-R1's ``grpo.py``. Completions are scored by the ``accuracy`` and ``format`` rewards.
- ``answer_only``: the question followed by a one-line instruction to give only the answer; the
  completion *is* the answer. Used by the embedded default run, whose model is trained from scratch
  and could not discover the think/answer format by sampling; scored by ``answer_accuracy`` and
  ``answer_format``.
"""

from __future__ import annotations

from rollplex.types import Record

TEMPLATES = ("video_r1", "answer_only")

QUESTION_TEMPLATE = (
    "{Question}\nPlease think about this question as if you were a human pondering deeply. Engage in an "
    "internal dialogue using expressions such as 'let me think', 'wait', 'Hmm', 'oh, I see', 'let's break "
    "it down', etc, or other natural language thought expressions It's encouraged to include "
    "self-reflection or verification in the reasoning process. Provide your detailed reasoning between the "
    "<think> </think> tags, and then give your final answer between the <answer> </answer> tags."
)

TYPE_SUFFIX = {
    "multiple choice": " Please provide only the single option letter (e.g., A, B, C, D, etc.) within the "
    "<answer> </answer> tags.",
    "numerical": " Please provide the numerical value (e.g., 42 or 3.14) within the <answer> </answer> tags.",
    "OCR": " Please transcribe text from the image/video clearly and provide your text answer within the "
    "<answer> </answer> tags.",
    "free-form": " Please provide your text answer within the <answer> </answer> tags.",
    "regression": " Please provide the numerical value (e.g., 42 or 3.14) within the <answer> </answer> tags.",
}

ANSWER_ONLY_SUFFIX = {
    "multiple choice": "Answer with the option letter only.",
    "numerical": "Answer with the number only.",
    "regression": "Answer with the number only.",
    "OCR": "Answer with the text only.",
    "free-form": "Answer briefly.",
}


def question_text(record: Record) -> str:
    """The question: ``problem``, plus "Options:\\n" and one option per line for multiple choice.

    No separator is inserted between the problem and "Options:" (as in Video-R1).
    """
    if record.problem_type == "multiple choice":
        return record.problem + "Options:\n" + "".join(option + "\n" for option in record.options)
    return record.problem


def prompt_text(record: Record, template: str) -> str:
    """The user-turn text of ``record`` under ``template``.

    Raises:
        ValueError: unknown template.
    """
    if template == "video_r1":
        return QUESTION_TEMPLATE.format(Question=question_text(record)) + TYPE_SUFFIX[record.problem_type]
    if template == "answer_only":
        return question_text(record).rstrip("\n") + "\n" + ANSWER_ONLY_SUFFIX[record.problem_type]
    raise ValueError(f"data.template: unknown template {template!r}; choose one of {TEMPLATES}")


def chat_messages(record: Record, template: str) -> list[dict]:
    """A single user turn: [media part (type = data_type), text part]; no system message (the chat
    template inserts Qwen's default system turn), as in Video-R1."""
    content = [] if record.data_type not in ("video", "image") else [{"type": record.data_type}]
    content.append({"type": "text", "text": prompt_text(record, template)})
    return [{"role": "user", "content": content}]
