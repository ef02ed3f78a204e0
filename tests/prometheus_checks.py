"""Check a /metrics answer the way Prometheus reads it: its own parser, its own linter
(`promtool check metrics`, when installed: scripts/test puts it in .venv/bin), and the naming
conventions of https://prometheus.io/docs/practices/naming/ that neither enforces."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
# Units that are not base units (seconds, bytes): a name says _seconds, never _ms.
_NOT_BASE_UNITS = {"ms", "millis", "milliseconds", "us", "micros", "minutes", "hours", "days"}
_NOT_BASE_UNITS |= {"kb", "kilobytes", "mb", "megabytes", "kib", "mib", "percent"}
# Words that make a name a time, which must then be in seconds.
_TIME_WORDS = {"duration", "age", "time", "latency", "elapsed"}
# Labels whose values are unbounded (one series per key or request would grow without end).
_UNBOUNDED_LABELS = {"key", "keys", "offset", "url", "path", "request_id", "value", "reason_text"}
_SUFFIXES = ("_total", "_count", "_sum", "_bucket", "_created")


def families(text: str) -> dict[str, Metric]:
    """The families a Prometheus server would read (the parser raises on invalid text)."""
    return {family.name: family for family in text_string_to_metric_families(text)}


def sample_values(text: str, sample_name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Each sample of that name, keyed by its sorted labels."""
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == sample_name
    }


def convention_problems(text: str) -> list[str]:
    """Every way the exposition breaks the naming conventions (empty: none)."""
    problems: list[str] = []
    for name, family in families(text).items():
        problems += [f"{name}: {problem}" for problem in _family_problems(name, family)]
    return problems


def _family_problems(name: str, family: Metric) -> list[str]:
    problems = []
    words = set(name.split("_"))
    if not name.startswith("kroute_") or not _NAME.match(name):
        problems.append("not a snake_case name with the kroute_ prefix")
    if not family.documentation.strip():
        problems.append("no HELP text")
    if words & _NOT_BASE_UNITS:
        problems.append(f"unit {sorted(words & _NOT_BASE_UNITS)} is not a base unit")
    if words & _TIME_WORDS and not name.endswith("_seconds"):
        problems.append("a time that is not in _seconds")
    if family.type != "counter" and name.endswith(_SUFFIXES):
        problems.append(f"a {family.type} named like a counter or a histogram's series")
    for sample in family.samples:
        if family.type == "counter" and not sample.name.endswith(("_total", "_created")):
            problems.append(f"counter sample {sample.name} does not end in _total")
        if family.type == "counter" and (sample.value < 0 or math.isnan(sample.value)):
            problems.append(f"counter sample {sample.name} is {sample.value}")
        unbounded = set(sample.labels) & _UNBOUNDED_LABELS
        if unbounded:
            problems.append(f"label(s) {sorted(unbounded)} with unbounded values")
    return problems


def promtool() -> str | None:
    """promtool from .venv/bin (scripts/test) or PATH."""
    bundled = ROOT / ".venv" / "bin" / "promtool"
    return str(bundled) if bundled.exists() else shutil.which("promtool")


def promtool_problems(text: str) -> str:
    """What `promtool check metrics` says about the exposition ('' when nothing).

    Skips where promtool is not installed, except in CI, where scripts/test installs it."""
    binary = promtool()
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing in CI: scripts/test installs it")
        pytest.skip("promtool not installed (scripts/test installs it from Debian's prometheus)")
    result = subprocess.run(
        [binary, "check", "metrics"],
        input=text.encode(),
        capture_output=True,
        timeout=30,
        check=False,
    )
    said = (result.stdout + result.stderr).decode().strip()
    return said if result.returncode != 0 or said else ""


def assert_follows_conventions(text: str) -> None:
    assert convention_problems(text) == []
    assert promtool_problems(text) == ""
