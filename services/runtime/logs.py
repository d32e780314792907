"""Logging: structlog configured once per process, request/batch ids bound per task.

`configure_logging()` is called by `main()` (never at import time). Every module logs through
`structlog.get_logger(__name__)`; ids bound with `log_context()` appear on every line logged
inside that block, including lines from other modules, because they live in contextvars
(one copy per asyncio task).

Tracebacks are bounded: plain text (console) or frames without locals (JSON), at most
MAX_TRACEBACK_FRAMES frames. structlog's defaults render every frame's locals (rich); a local
that is a tensor or a batch message would turn one failure into a flood of log, formatted on the
event loop for long enough to miss heartbeats.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

import structlog

MAX_TRACEBACK_FRAMES = 20
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure_logging(json: bool | None = None, level: str = "info", stream: TextIO | None = None) -> None:
    """Configure structlog for the whole process; safe to call again (the last call wins).

    json: one JSON object per line (for log shippers); None reads `SPECBUS_LOG_JSON=1` now.
    Lines go to `stream` (default stderr, so stdout stays free for command output).
    """
    if level not in LEVELS:
        raise ValueError(f"level: unknown log level {level!r}, expected one of {sorted(LEVELS)}")
    if json is None:
        json = os.environ.get("SPECBUS_LOG_JSON", "0").strip().lower() in ("1", "true", "yes")
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if json:
        tracebacks = structlog.tracebacks.ExceptionDictTransformer(show_locals=False, max_frames=MAX_TRACEBACK_FRAMES)
        renderer = [structlog.processors.ExceptionRenderer(tracebacks), structlog.processors.JSONRenderer()]
    else:
        renderer = [structlog.dev.ConsoleRenderer(colors=False, exception_formatter=plain_traceback)]
    structlog.configure(
        processors=[*shared, *renderer],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stderr),
        cache_logger_on_first_use=False,
    )


def plain_traceback(sio: TextIO, exc_info) -> None:
    """The standard library's traceback text, without locals, its last MAX_TRACEBACK_FRAMES frames."""
    sio.write("\n" + "".join(traceback.format_exception(*exc_info, limit=-MAX_TRACEBACK_FRAMES)))


@contextmanager
def log_context(**ids: object) -> Iterator[None]:
    """Bind ids (request_id=..., batch_id=..., worker_id=...) to every log line in this block.

    Ids given as None are skipped, so callers can pass what they know without checking.
    """
    known = {key: value for key, value in ids.items() if value is not None}
    with structlog.contextvars.bound_contextvars(**known):
        yield
