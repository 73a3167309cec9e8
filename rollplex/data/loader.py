"""Batches of prompts from a record list, with a resumable cursor and skip accounting.

Records are visited in a per-epoch permutation derived from (seed, epoch), so the cursor
(epoch, index) is all a checkpoint needs to resume the same order. A record that cannot become a
prompt is skipped with one warning line naming it and the reason, and counted; it is remembered and not
retried. The run stops (DatasetError) only when a whole epoch yields no usable prompt.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from rollplex.data.encode import PromptBuilder, SkipSample
from rollplex.data.records import DatasetError
from rollplex.types import Prompt, Record

log = logging.getLogger("rollplex.data")


class PromptSource:
    """Serves ``batch_size`` prompts per call from ``records``.

    Args:
        records: validated records.
        builder: turns a record into a Prompt (raises SkipSample for bad samples).
        batch_size: prompts per batch (the number of GRPO groups G).
        seed: permutation seed; shuffle: permute each epoch (else file order).
        cache_bytes: host memory for built prompts kept between epochs (LRU by record index; 0 = none).
            A prompt of real video costs tens of MB of float pixel rows, so the cap is in bytes.
    """

    def __init__(
        self,
        records: list[Record],
        builder: PromptBuilder,
        batch_size: int,
        *,
        seed: int,
        shuffle: bool,
        cache_bytes: int = 2 * 2**30,
    ):
        self.records, self.builder, self.batch_size = records, builder, batch_size
        self.seed, self.shuffle, self.cache_bytes = seed, shuffle, cache_bytes
        self._cached_bytes = 0
        self.epoch, self.index = 0, 0
        self.skipped: dict[int, str] = {}
        self._cache: OrderedDict[int, Prompt] = OrderedDict()

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.records)))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.records), generator=generator).tolist()

    def _prompt(self, i: int) -> Prompt | None:
        if i in self.skipped:
            return None
        if i in self._cache:
            self._cache.move_to_end(i)
            return self._cache[i]
        try:
            prompt = self.builder.build(self.records[i])
        except SkipSample as err:
            record = self.records[i]
            log.warning("skipping problem_id %s (%s): %s", record.problem_id, record.path, err)
            self.skipped[i] = str(err)
            return None
        size = _nbytes(prompt)
        if size <= self.cache_bytes:
            self._cache[i] = prompt
            self._cached_bytes += size
            while self._cached_bytes > self.cache_bytes:
                _, evicted = self._cache.popitem(last=False)
                self._cached_bytes -= _nbytes(evicted)
        return prompt

    def next_batch(self) -> list[Prompt]:
        """The next ``batch_size`` usable prompts, wrapping into new epochs.

        Raises:
            DatasetError: no record of the dataset can be used.
        """
        batch: list[Prompt] = []
        order = self._order(self.epoch)
        while len(batch) < self.batch_size:
            if self.index >= len(order):
                self.epoch, self.index = self.epoch + 1, 0
                order = self._order(self.epoch)
            prompt = self._prompt(order[self.index])
            self.index += 1
            if prompt is None:
                if len(self.skipped) >= len(self.records):
                    raise DatasetError(f"no usable sample left: all {len(self.records)} records were skipped")
                continue
            batch.append(prompt)
        return batch

    def all_prompts(self, limit: int) -> list[Prompt]:
        """Up to ``limit`` usable prompts in file order (held-out evaluation); skips are counted too."""
        prompts = []
        for i in range(len(self.records)):
            if len(prompts) >= limit:
                break
            prompt = self._prompt(i)
            if prompt is not None:
                prompts.append(prompt)
        return prompts

    def state_dict(self) -> dict:
        """Cursor and skip record, for checkpoints."""
        return {"epoch": self.epoch, "index": self.index, "skipped": dict(self.skipped)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self.skipped = {int(k): v for k, v in state["skipped"].items()}


def _nbytes(prompt: Prompt) -> int:
    tensors = (prompt.input_ids, prompt.position_ids, prompt.pixel_values, prompt.pixel_values_videos)
    twin = _nbytes(prompt.shuffled) if prompt.shuffled is not None else 0
    return twin + sum(t.numel() * t.element_size() for t in tensors if t is not None)
