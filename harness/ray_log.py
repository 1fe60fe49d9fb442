"""Ray's own log lines go to the run's log file, not the console: its token-authentication notice, "Started a local
Ray instance", what it says when a signal reaches its start-up. The console keeps the harness's own lines.

Ray gives its "ray" logger a stderr handler of its own when it is imported, with propagation off
(generate_logging_config in ray/_private/log.py), and every module of Ray logs below it. `RayLogFile` swaps that
logger's handlers for one appending to a file while a Ray session lasts and puts them back when it ends.
"""

from __future__ import annotations

import logging
from pathlib import Path

RAY_LOGGER = "ray"
FORMAT = "%(asctime)s %(levelname)s %(filename)s:%(lineno)s -- %(message)s"  # Ray's own format, as on the console


class RayLogFile:
    """`open()` sends the "ray" logger's records to `path` (appended), `close()` (idempotent) restores its handlers."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._handler: logging.FileHandler | None = None
        self._saved: list[logging.Handler] = []

    def open(self) -> None:
        if self._handler is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(self.path, encoding="utf-8")
        handler.setFormatter(logging.Formatter(FORMAT))
        ray_logger = logging.getLogger(RAY_LOGGER)
        self._saved = list(ray_logger.handlers)
        for old in self._saved:
            ray_logger.removeHandler(old)
        ray_logger.addHandler(handler)
        ray_logger.propagate = False  # as Ray sets it: nothing reaches the root logger's console handler
        self._handler = handler

    def close(self) -> None:
        handler, self._handler = self._handler, None
        if handler is None:
            return
        ray_logger = logging.getLogger(RAY_LOGGER)
        ray_logger.removeHandler(handler)
        handler.close()
        for old in self._saved:
            ray_logger.addHandler(old)
        self._saved = []
