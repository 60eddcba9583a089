"""Structured logs: every line names the process and, inside a request, its request id.

`request_id.set(...)` in a request's task tags every line logged from it (asyncio copies the context
into the tasks it starts). `--log-format json` writes one JSON object per line.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import sys
from typing import Literal

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")

LogFormat = Literal["text", "json"]


class _RequestIdFilter(logging.Filter):
    def __init__(self, process: str):
        super().__init__()
        self.process = process

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        record.process_name = self.process
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname,
            "process": getattr(record, "process_name", ""),
            "logger": record.name,
            "request_id": getattr(record, "request_id", "-"),
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(line)


def setup_logging(log_format: LogFormat = "text", level: str | None = None) -> None:
    process = os.environ.get("PDSERVE_PROCESS", "pdserve")
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RequestIdFilter(process))
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(
            "%(asctime)s %(levelname)s %(process_name)s %(name)s [%(request_id)s]: %(message)s"
        ))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level or os.environ.get("PDSERVE_LOG_LEVEL", "INFO"))
