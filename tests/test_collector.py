"""``rollplex.collector.StepCollector``: no automatic passes inside a step, the step's cyclic garbage
freed at ``step_done``, what outlives the first step frozen, and the collector's state restored on exit
(also after an error); disabled, it changes nothing."""

from __future__ import annotations

import gc
import weakref

import pytest

from rollplex.collector import StepCollector


class _Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


def _garbage_cycle() -> weakref.ref:
    return weakref.ref(_Node())


def test_a_steps_cycles_are_freed_at_step_done_and_not_before():
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with StepCollector() as collector:
        assert not gc.isenabled()
        cycle = _garbage_cycle()
        for _ in range(5000):  # would cross the automatic thresholds many times over
            _garbage_cycle()
        assert cycle() is not None
        collector.step_done()
        assert cycle() is None
        frozen = gc.get_freeze_count()
        assert frozen > 0  # what outlived the first step
        second = _garbage_cycle()
        collector.step_done()
        assert second() is None and gc.get_freeze_count() == frozen  # frozen once, after the first step
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_the_state_is_restored_after_an_error():
    with pytest.raises(RuntimeError):
        with StepCollector() as collector:
            collector.step_done()
            raise RuntimeError("a failed step")
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_collector_that_was_off_stays_off():
    gc.disable()
    try:
        with StepCollector() as collector:
            collector.step_done()
        assert not gc.isenabled() and gc.get_freeze_count() == 0
    finally:
        gc.enable()


def test_disabled_it_changes_nothing():
    with StepCollector(enabled=False) as collector:
        assert gc.isenabled()
        collector.step_done()
        assert gc.get_freeze_count() == 0
