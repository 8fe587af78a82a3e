"""Process-wide values computed once, also when several threads ask for them first at the same time."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Once(Generic[T]):
    """``function()``, computed by the first caller while any other waits, then kept.

    Used for the per-process initialisations (the exporter's translation table, the shared CPU arena, the
    CPU's NCHWc probe): ``functools.cache`` alone lets two threads run them at once.

    Args:
        function: what to compute; it takes no arguments.

    Example:
        >>> calls = []
        >>> table = Once(lambda: calls.append(1) or len(calls))
        >>> table(), table(), calls
        (1, 1, [1])
    """

    def __init__(self, function: Callable[[], T]) -> None:
        self._function = function
        self._lock = threading.Lock()
        self._values: list[T] = []
        functools.update_wrapper(self, function)

    def __call__(self) -> T:
        with self._lock:
            if not self._values:
                self._values.append(self._function())
            return self._values[0]

    def cache_clear(self) -> None:
        """Compute again on the next call."""
        with self._lock:
            self._values.clear()
