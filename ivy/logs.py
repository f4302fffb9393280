"""Ivy's log lines: text for people, or one JSON object per line for log pipelines
(``--log-format json``); both name the request being served when there is one.

The request id comes from `ivy.errors.request_id`, set by `ivy.middleware.RequestId`, so a
client quoting the id of a 5xx answer finds its log line.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from typing import Any

import orjson

from ivy.errors import request_id

__all__ = ["JsonFormatter", "RequestIdFilter", "log_config"]

_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s%(request_suffix)s"


class RequestIdFilter(logging.Filter):
    """Adds ``request_id`` (and, for text, `` [request id …]``) to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = request_id.get()
        record.request_id = rid
        record.request_suffix = f" [request {rid}]" if rid else ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message, the
    request id when there is one, and the traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = getattr(record, "request_id", "")
        if rid:
            entry["request_id"] = rid
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry).decode()


def log_config(fmt: str, level: str = "WARNING") -> dict[str, Any]:
    """`logging.config.dictConfig` settings for uvicorn's and Ivy's loggers."""
    formatter: dict[str, Any] = {"()": JsonFormatter} if fmt == "json" else {"format": _TEXT}
    handler = {
        "class": "logging.StreamHandler",
        "stream": "ext://sys.stderr",
        "formatter": "ivy",
        "filters": ["request_id"],
    }
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"request_id": {"()": RequestIdFilter}},
        "formatters": {"ivy": formatter},
        "handlers": {"stderr": handler},
        "loggers": {
            name: {"handlers": ["stderr"], "level": level, "propagate": False}
            for name in ("ivy", "uvicorn", "uvicorn.error", "uvicorn.access")
        },
    }
