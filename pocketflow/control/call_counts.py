"""How many calls the ``Controller`` served, per method: what shows that work stays off the
control plane (a shuffle's tasks make none per object; only its driver calls, a fixed number
of times per job).

A call counts when it comes from outside the controller: a method that another counted method,
``__init__`` or the monitor loop calls on ``self`` is the controller's own work and is not
counted (a thread-local depth tells them apart). Ray runs an actor's calls through the class's
functions, bound when the actor starts, so the counting wraps the class, not the instance.
"""

from __future__ import annotations

import functools
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

__all__ = ["CallCounts", "counted_calls"]

METHODS_MAX = 256
"""Most method names one :class:`CallCounts` keeps (a class has a fixed set)."""

T = TypeVar("T", bound=type)


class CallCounts:
    """Counts per method name, safe to add to from many threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, method: str) -> None:
        with self._lock:
            if method in self._counts or len(self._counts) < METHODS_MAX:
                self._counts[method] += 1

    def snapshot(self) -> dict[str, int]:
        """The counts so far, by method name."""
        with self._lock:
            return dict(self._counts)


_depth = threading.local()


def _enter() -> int:
    depth = getattr(_depth, "value", 0)
    _depth.value = depth + 1
    return depth


def _leave() -> None:
    _depth.value -= 1


def counted_calls(counts: CallCounts, *, internal: Iterable[str] = ("__init__",)
                  ) -> Callable[[T], T]:
    """Class decorator: every public method of the class adds one to ``counts`` per call from
    outside; the methods named in ``internal`` (the constructor, a loop the class runs in a
    thread of its own) count nothing and make what they call on ``self`` uncounted too."""

    def wrap(cls: T) -> T:
        for name, member in list(vars(cls).items()):
            if not callable(member) or isinstance(member, (staticmethod, classmethod, type)):
                continue
            if name in internal:
                setattr(cls, name, _uncounted(member))
            elif not name.startswith("_"):
                setattr(cls, name, _counted(counts, name, member))
        return cls

    return wrap


def _counted(counts: CallCounts, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        if _enter() == 0:
            counts.add(name)
        try:
            return method(*args, **kwargs)
        finally:
            _leave()

    return call


def _uncounted(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        _enter()
        try:
            return method(*args, **kwargs)
        finally:
            _leave()

    return call
