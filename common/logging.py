"""Logging set-up, done once by each entry point: JSON lines on stderr, filtered by level.

kroute's own code logs through structlog; the libraries under it (uvicorn, httpx, aiokafka,
py4j, redis) log through the standard library. Both end in the same renderer, so every line a
component writes is one JSON object with `event`, `level`, `timestamp`, `component` and, for
library lines, `logger`. Spark's JVM logs through log4j2, configured by `spark_json_logging`;
anything else a process or its children print on stderr is wrapped by `json_stderr`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import MutableMapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog
from structlog.typing import Processor

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
# Libraries whose INFO lines are per request or per connection: at info they would drown the
# components' own lines (uvicorn's access log, httpx's "HTTP Request: ..."), so they say only
# warnings and errors unless the component logs at debug.
_CHATTY = ("uvicorn.access", "httpx", "httpcore", "aiokafka", "kafka", "py4j")


def configure_logging(level: str = "info", component: str = "kroute") -> None:
    def add_component(
        _logger: Any, _method: str, event: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        # A constant, not a contextvar: Spark and py4j call us from threads with no context.
        event.setdefault("component", component)
        return event

    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        add_component,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[
            *shared,
            structlog.processors.dict_tracebacks,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    _route_standard_logging(shared, _LEVELS[level])


def _route_standard_logging(shared: list[Processor], level: int) -> None:
    """Send every standard-library logger through structlog's renderer (JSON on stderr)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.dict_tracebacks,
                structlog.processors.JSONRenderer(),
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in _CHATTY:
        logging.getLogger(name).setLevel(level if level <= logging.DEBUG else logging.WARNING)
    # A library that installed a handler of its own before we ran would print past us.
    for logger in logging.Logger.manager.loggerDict.values():
        if isinstance(logger, logging.Logger):
            logger.handlers[:] = []
            logger.propagate = True
    logging.captureWarnings(True)  # warnings.warn(...) lines too


def json_stderr(component: str) -> None:
    """Make every line written to this process's stderr JSON, its children's included.

    Spark's JVM (its launcher's warnings, log4j lines before a configuration is read), its
    Python workers and librdkafka write to the stderr they inherit, in formats of their own.
    stderr becomes a pipe; a thread passes JSON lines on unchanged and wraps any other line
    as {"event": line, "logger": "stderr", ...}."""
    original = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)
    threading.Thread(
        target=_relay, args=(read_end, original, component), name="json-stderr", daemon=True
    ).start()


def _relay(read_end: int, out: int, component: str) -> None:
    with os.fdopen(read_end, "rb") as source:
        for raw in source:
            os.write(out, _as_json_line(raw, component))


def _as_json_line(raw: bytes, component: str) -> bytes:
    text = raw.decode(errors="replace").rstrip("\r\n")
    if text.startswith("{"):
        try:
            json.loads(text)
            return text.encode() + b"\n"
        except ValueError:
            pass
    upper = text.upper()
    level = "error" if "ERROR" in upper or "TRACEBACK" in upper else "info"
    level = "warning" if level == "info" and "WARN" in upper else level
    event = {
        "event": text,
        "logger": "stderr",
        "component": component,
        "level": level,
        "timestamp": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
    }
    return json.dumps(event).encode() + b"\n"


# Spark's JVM logs through log4j2; this configuration makes each event one JSON line with the
# keys kroute's own lines use (JsonTemplateLayout ships with Spark). Level: warnings and up.
_LOG4J2_JSON = """\
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = stderr
appender.stderr.type = Console
appender.stderr.name = stderr
appender.stderr.target = SYSTEM_ERR
appender.stderr.layout.type = JsonTemplateLayout
appender.stderr.layout.eventTemplate = {"event": {"$resolver": "message", "stringified": true}, \
"level": {"$resolver": "level", "field": "name"}, \
"timestamp": {"$resolver": "timestamp", "pattern": {"format": "yyyy-MM-dd'T'HH:mm:ss.SSSSSS'Z'", \
"timeZone": "UTC"}}, "logger": {"$resolver": "logger", "field": "name"}, \
"component": "COMPONENT", "exception": {"$resolver": "exception", "field": "stackTrace", \
"stackTrace": {"stringified": true}}}
logger.jetty.name = org.sparkproject.jetty
logger.jetty.level = error
"""


def spark_json_logging(directory: Path, component: str) -> Path:
    """Write the log4j2 configuration for Spark's JVM and point log4j at it (the JVM that
    pyspark starts inherits this environment); returns the file, named in the start-up log."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "log4j2-json.properties"
    path.write_text(_LOG4J2_JSON.replace("COMPONENT", component))
    os.environ["LOG4J_CONFIGURATION_FILE"] = str(path)
    return path
