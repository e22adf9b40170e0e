"""Logging for every pdserve process: the ``pdserve serve`` controller, the router and each
worker (Ray actors or plain processes) call ``configure`` once at entry with the same
``LogConfig``, so one ``--log-level`` and one ``--log-format`` hold everywhere.

A library module only does ``logging.getLogger(__name__)``; without ``configure`` its INFO
lines (the autoscaler's decisions among them) would go nowhere. ``text`` lines read
``TIME PROCESS LEVEL LOGGER: MESSAGE``; ``json`` writes one object per line with the same
fields, for log shippers. HTTP requests are logged by ``ACCESS_LOGGER`` in ``ACCESS_FORMAT``
(aiohttp's access-log syntax), at INFO.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")

ACCESS_LOGGER = logging.getLogger("pdserve.access")
# client, request line, status, response bytes, seconds, user agent
ACCESS_FORMAT = '%a "%r" %s %b %Tf "%{User-Agent}i"'


class LogConfigError(ValueError):
    """A log setting is not one pdserve knows; the message names the setting."""


@dataclass(frozen=True)
class LogConfig:
    level: str = "info"  # one of LEVELS
    format: str = "text"  # one of FORMATS

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise LogConfigError(f"log_level: {self.level!r} is not one of {', '.join(LEVELS)}")
        if self.format not in FORMATS:
            raise LogConfigError(f"log_format: {self.format!r} is not one of {', '.join(FORMATS)}")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, process, logger, message,
    and the exception's traceback when there is one."""

    def __init__(self, process: str):
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
               "level": record.levelname.lower(), "process": self.process, "logger": record.name,
               "message": record.getMessage()}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


class _Handler(logging.StreamHandler):
    """Marks the handler ``configure`` installed, so a second call replaces it."""


def configure(config: LogConfig, process: str) -> None:
    """Send this process's records at ``config.level`` and above to stderr, formatted as
    ``config.format``, tagged with ``process`` (controller, router, prefill-0, ...).
    Idempotent: a later call replaces the handler an earlier one installed."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(handler)
    handler = _Handler(sys.stderr)
    if config.format == "json":
        handler.setFormatter(JsonFormatter(process))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {process} %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(config.level.upper())
