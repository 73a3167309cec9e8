"""Trace spans: how model, rollout and schedule code names the part of the step it runs.

Code at any layer marks its work with ``span(name)`` (a context manager) or ``spanned(name)`` (a
decorator) and imports nothing of ``rollplex.observe``. A span opens a range of the installed factory:
by default ``torch.profiler.record_function``, so a torch.profiler trace shows which part of the step
launched each kernel (observe.idle charges idle device time to those ranges). Another factory, any
callable ``name -> context manager``, can be installed with ``set_span_factory`` (a test records the
names; observe may add its own timing); it applies to every thread from then on.

Names in use: ``rollplex/phase/<phase>`` (observe.metrics.PhaseTimer and the prefix-overlap schedule),
``rollplex/prefix``, ``rollplex/suffix``, ``rollplex/vision`` (models.forward).

Example:
    with span("rollplex/phase/rollout"):
        ...

    @spanned("rollplex/prefix")
    def prefix_states(...): ...
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

SpanFactory = Callable[[str], AbstractContextManager]

_factory: SpanFactory = torch.profiler.record_function


def span(name: str) -> AbstractContextManager:
    """A fresh range ``name`` of the installed factory around the ``with`` block (it closes when the
    block ends or raises)."""
    return _factory(name)


def spanned(name: str) -> Callable[[Callable], Callable]:
    """Decorator: each call of the function runs inside a fresh ``span(name)``, so calls from several
    threads, or nested calls, do not share one. Not for generator functions, whose body runs after the
    call has returned."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with span(name):
                return fn(*args, **kwargs)

        return inner

    return wrap


def set_span_factory(factory: SpanFactory | None) -> SpanFactory:
    """Install ``factory`` for every span opened from now on (None: the default,
    ``torch.profiler.record_function``); returns the factory it replaces, to restore it later."""
    global _factory
    previous, _factory = _factory, factory or torch.profiler.record_function
    return previous


@contextlib.contextmanager
def span_factory(factory: SpanFactory | None):
    """``set_span_factory(factory)`` for the ``with`` block, the previous factory restored after it."""
    previous = set_span_factory(factory)
    try:
        yield
    finally:
        set_span_factory(previous)
