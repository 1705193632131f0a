"""What hpcgnn says, through Python's :mod:`logging` (the logger ``hpcgnn`` and its children).

Levels and where they go (:func:`configure`, called once by the ``hpcgnn`` command):

* ``INFO``: what a command reports (a run's start banner, epoch lines, summary): stdout, as is;
* ``DEBUG``: what ``hpcgnn -v`` adds (phase times, the data plane): stdout, as is;
* ``WARNING``: stderr, as ``hpcgnn: warning: MESSAGE``;
* ``ERROR`` and above: stderr, as ``hpcgnn: error: MESSAGE``.

Under a launcher every rank runs the same command; the handler passes only rank 0's records
(the rank the launcher announced, :func:`hpcgnn.supervisor.launcher_rank`; no launcher counts as
rank 0), except those logged with ``extra=EVERY_RANK`` (a message about this rank only).
``hpcgnn --quiet`` keeps warnings and errors; ``-v`` adds ``DEBUG``. A program that imports
hpcgnn and never calls :func:`configure` gets the same handler at ``INFO`` on first use (so a
library call prints what the command would), unless it gave the ``hpcgnn`` logger handlers of
its own, which then decide alone.
"""
from __future__ import annotations

import logging
import sys

LOGGER = "hpcgnn"
EVERY_RANK = {"every_rank": True}   # ``extra=`` of a record that every rank prints
QUIET, NORMAL, VERBOSE = -1, 0, 1


class RankZeroFilter(logging.Filter):
    """Pass a record on rank 0 (or outside a launcher), or one marked :data:`EVERY_RANK`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "every_rank", False):
            return True
        from hpcgnn.supervisor import launcher_rank

        return launcher_rank() in (None, 0)


class ConsoleHandler(logging.Handler):
    """stdout below ``WARNING`` (the message as is), stderr from it (``hpcgnn: warning: ...``,
    ``hpcgnn: error: ...``). The streams are looked up when a record is written, so a replaced
    ``sys.stdout`` (pytest's capture, a redirect) gets the output."""

    def __init__(self):
        super().__init__()
        self.addFilter(RankZeroFilter())

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.levelno >= logging.ERROR:
                stream, text = sys.stderr, f"hpcgnn: error: {text}"
            elif record.levelno >= logging.WARNING:
                stream, text = sys.stderr, f"hpcgnn: warning: {text}"
            else:
                stream = sys.stdout
            stream.write(text + "\n")
            stream.flush()
        except BrokenPipeError:
            raise
        except Exception:  # noqa: BLE001 - logging's own policy for a failed emit
            self.handleError(record)


def _ours(logger: logging.Logger) -> list[logging.Handler]:
    return [h for h in logger.handlers if isinstance(h, ConsoleHandler)]


def configure(verbosity: int = NORMAL) -> logging.Logger:
    """Set up the ``hpcgnn`` logger for a command: :data:`QUIET` (warnings and errors),
    :data:`NORMAL` (``INFO``) or :data:`VERBOSE` and above (``DEBUG``). Idempotent: a second call
    replaces the first's level and handler."""
    logger = logging.getLogger(LOGGER)
    for h in _ours(logger):
        logger.removeHandler(h)
    logger.addHandler(ConsoleHandler())
    logger.setLevel(logging.WARNING if verbosity < NORMAL else
                    logging.INFO if verbosity == NORMAL else logging.DEBUG)
    logger.propagate = False
    return logger


def get(name: str = "") -> logging.Logger:
    """The logger ``hpcgnn`` (``name``: a child, ``hpcgnn.NAME``), configured at ``INFO`` on first
    use when nobody configured it (module docstring)."""
    root = logging.getLogger(LOGGER)
    if not root.handlers:
        configure(NORMAL)
    return root.getChild(name) if name else root


def verbose() -> bool:
    """Whether ``DEBUG`` records are shown (``hpcgnn -v``)."""
    return get().isEnabledFor(logging.DEBUG)


def info(message: str) -> None:
    get().info(message)


def debug(message: str) -> None:
    get().debug(message)


def warning(message: str, every_rank: bool = False) -> None:
    """``hpcgnn: warning: MESSAGE`` on stderr (rank 0's only unless ``every_rank``)."""
    get().warning(message, extra=EVERY_RANK if every_rank else None)


def error(message: str, every_rank: bool = False) -> None:
    """``hpcgnn: error: MESSAGE`` on stderr (rank 0's only unless ``every_rank``)."""
    get().error(message, extra=EVERY_RANK if every_rank else None)
