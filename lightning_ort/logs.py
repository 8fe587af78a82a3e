"""Logging without process-wide changes: the package's loggers honour each model's ``log_level`` during its
calls, and filters on other libraries' loggers exist only while one of our calls needs them.

Logger levels belong to the application. An ORTModule's ``log_level`` (``DebugOptions``) therefore sets no
logger's level: while the model builds or runs (:func:`model_log_level`), the package's records at that level
and above are emitted even where the ``lightning_ort`` logger's level would drop them. The application's own
configuration (``logging.getLogger("lightning_ort").setLevel(logging.DEBUG)``) still enables more.

Example:
    >>> log = get_logger("lightning_ort.example")
    >>> with model_log_level(logging.INFO):
    ...     log.isEnabledFor(logging.INFO)
    True
    >>> log.isEnabledFor(logging.INFO)  # outside a model's calls, the logger's own level decides
    False
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

_MODEL_LEVEL: contextvars.ContextVar[int | None] = contextvars.ContextVar("lightning_ort_log_level", default=None)


@contextlib.contextmanager
def model_log_level(level: int) -> Iterator[None]:
    """Emit the package's records at ``level`` and above while the block runs (in this thread or task)."""
    token = _MODEL_LEVEL.set(level)
    try:
        yield
    finally:
        _MODEL_LEVEL.reset(token)


class PackageLogger(logging.LoggerAdapter[logging.Logger]):
    """A package module's logger: enabled by the logger's own level, or by the calling model's ``log_level``."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__(logger, {})

    def isEnabledFor(self, level: int) -> bool:
        model = _MODEL_LEVEL.get()
        return self.logger.isEnabledFor(level) or (model is not None and level >= model)

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        if not self.isEnabledFor(level) or self.logger.disabled:
            return
        if self.logger.isEnabledFor(level):
            self.logger.log(level, msg, *args, stacklevel=kwargs.pop("stacklevel", 1) + 2, **kwargs)
            return
        file, line, function, stack = self.logger.findCaller(
            stack_info=False, stacklevel=kwargs.pop("stacklevel", 1) + 2
        )
        record = self.logger.makeRecord(
            self.logger.name, level, file, line, msg, args, kwargs.get("exc_info"), function, kwargs.get("extra"), stack
        )
        self.logger.handle(record)

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        return msg, kwargs


def get_logger(name: str) -> PackageLogger:
    """The logger of the package module ``name`` (pass ``__name__``)."""
    return PackageLogger(logging.getLogger(name))


class ScopedFilter(logging.Filter):
    """A filter on other libraries' loggers, attached only while some call of ours is inside :meth:`scope`, and
    applied to records of the threads inside it only.

    A logger's filters do not reach its children's records, so the filter is attached to each logger named
    ``prefixes`` or below them that exists when the first scope opens, and detached when the last one closes.

    Args:
        prefixes: the loggers (and their children) to filter.
        keep: whether a record of a thread inside a scope passes.

    Example:
        >>> quiet = ScopedFilter(("example.library",), keep=lambda record: record.levelno >= logging.ERROR)
        >>> with quiet.scope():
        ...     quiet in logging.getLogger("example.library").filters
        True
        >>> quiet in logging.getLogger("example.library").filters
        False
    """

    def __init__(self, prefixes: tuple[str, ...], keep: Callable[[logging.LogRecord], bool]) -> None:
        super().__init__()
        self._prefixes = prefixes
        self._keep = keep
        self._state = threading.local()
        self._lock = threading.Lock()
        self._open = 0
        self._attached: list[logging.Logger] = []
        self._found: tuple[int, list[logging.Logger]] = (-1, [])

    @property
    def active(self) -> bool:
        """Whether this thread is inside a scope."""
        return getattr(self._state, "depth", 0) > 0

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Filter this thread's records on the loggers while the block runs."""
        with self._lock:
            if self._open == 0:
                self._attached = self._loggers()
                for logger in self._attached:
                    logger.addFilter(self)
            self._open += 1
        self._state.depth = getattr(self._state, "depth", 0) + 1
        try:
            yield
        finally:
            self._state.depth -= 1
            with self._lock:
                self._open -= 1
                if self._open == 0:
                    for logger in self._attached:
                        logger.removeFilter(self)
                    self._attached = []

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.active or self._keep(record)

    def _loggers(self) -> list[logging.Logger]:
        """The loggers named ``prefixes`` or below them, found again only when loggers were added since."""
        known = logging.root.manager.loggerDict
        count, found = self._found
        if count != len(known):
            names = [
                name
                for name in list(known)
                if any(name == prefix or name.startswith(prefix + ".") for prefix in self._prefixes)
            ]
            found = [logging.getLogger(name) for name in {*names, *self._prefixes}]
            self._found = (len(known), found)
        return found
