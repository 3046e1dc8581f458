"""Where a learner's time goes: the wall seconds of each phase of its steps, always on.

The steps' parts are timed where they run: ``timed(phase)`` on the methods the loops call
(collecting, agreeing across learners, replay's writes and samples, reports, evaluations,
checkpoints), ``phase(name)`` around the parts of an update (forward, backward with its
all-reduce, the optimizers; with ``cudagraphs=true`` forward and backward are one phase,
"graph"; with ``compile=true`` the first update of each update path, which compiles the
loss, is "compile").
A phase inside another is the outer one's time, so nothing is counted twice. Two clock
reads a phase, about a microsecond: cheap enough to leave on.

A learner reports each window's phases in its metrics rows and the run's totals in
summary.json, where the recorder writes one line of them at the end. One learner per
process: the counts are the process's.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_window: dict[str, float] = defaultdict(float)  # seconds per phase since the last report
_total: dict[str, float] = defaultdict(float)  # seconds per phase since the learner began
_inside = False  # a phase is being timed: an inner one is part of it


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Add the block's wall seconds to phase ``name`` (unless an outer phase counts them)."""
    global _inside
    if _inside:
        yield
        return
    _inside = True
    started = time.perf_counter()
    try:
        yield
    finally:
        seconds = time.perf_counter() - started
        _inside = False
        _window[name] += seconds
        _total[name] += seconds


def timed(name: str) -> Callable:
    """A method whose calls are phase ``name``."""

    def decorate(method: Callable) -> Callable:
        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            with phase(name):
                return method(*args, **kwargs)

        return wrapper

    return decorate


def take() -> dict[str, float]:
    """The seconds per phase since the last call, and a fresh window."""
    window = dict(_window)
    _window.clear()
    return window


def totals() -> dict[str, float]:
    return dict(_total)


def reset() -> None:
    """A learner begins: nothing timed yet."""
    _window.clear()
    _total.clear()
