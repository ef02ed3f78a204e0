"""Prometheus text exposition for the families that grow with the table, written directly.

prometheus_client makes a Sample and a labels dict for every series and sorts and escapes
every label on every scrape. At 20,000 partitions with a standby each, the per-replica lag
gauges alone are 160,000 lines: 3-4.5 s of CPU a scrape on a 2-core host, in a thread that
still takes the GIL from the event loop a millisecond at a time. Here a line is one f-string
and a label value that repeats (a node id, a store) is escaped once a scrape, about 10x less.

Lines are encoded in parts of `LINES_PER_PART` (`encoded`) and sent as such, and freed a part
at a time: one join, encode or free of 20 MB is a single C call that keeps the GIL, and so the
event loop, for tens of milliseconds.

The text is byte for byte what `prometheus_client.generate_latest` writes for the same
families (labels in name order, the same escapes and float formatting): checked against it
by tests/proxy/test_exposition.py, so a scraper cannot tell the two apart.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prometheus_client.utils import floatToGoString

_go_float: Callable[[float], str] = floatToGoString  # typed here: it has no annotations
# floatToGoString writes repr() for every finite value below a million (Go switches to an
# exponent sooner than Python only above that): the common case, without its call.
_PLAIN_BELOW = 1e6
LINES_PER_PART = 2_000  # about 200 KB: a join and an encode of well under a millisecond


def label_value(value: str) -> str:
    """A label value as the text format quotes it."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def sample_value(value: float) -> str:
    """A sample's value as generate_latest writes it (NaN, +Inf, 1e+06 as 1e+06)."""
    value = float(value)
    return repr(value) if -_PLAIN_BELOW < value < _PLAIN_BELOW else _go_float(value)


def header(name: str, documentation: str, kind: str) -> str:
    """A family's HELP and TYPE lines (`name` as exposed: a counter's ends in _total)."""
    escaped = documentation.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {name} {escaped}\n# TYPE {name} {kind}\n"


class LabelValues:
    """Label values escaped once per scrape: a node id recurs in every partition it hosts."""

    def __init__(self) -> None:
        self._escaped: dict[str, str] = {}

    def __call__(self, value: str) -> str:
        escaped = self._escaped.get(value)
        if escaped is None:
            escaped = self._escaped[value] = label_value(value)
        return escaped


def counter_lines(
    name: str, documentation: str, labels: Sequence[str], counts: Mapping[Any, float]
) -> list[str]:
    """A counter family (`name` without _total), a line per key of `counts` in key order: a
    key is a tuple of the `labels`' values, in that order (written in label-name order, as
    generate_latest writes them)."""
    exposed, escaped = f"{name}_total", LabelValues()
    order = sorted(range(len(labels)), key=labels.__getitem__)
    lines = [header(exposed, documentation, "counter")]
    for key in sorted(counts):
        pairs = ",".join(f'{labels[i]}="{escaped(key[i])}"' for i in order)
        lines.append(f"{exposed}{{{pairs}}} {sample_value(counts[key])}\n")
    return lines


def encoded(lines: list[str]) -> list[bytes]:
    """`lines` as UTF-8, in parts of at most LINES_PER_PART lines (in order). Empties `lines`
    as it goes (`release`)."""
    parts = []
    for start in range(0, len(lines), LINES_PER_PART):
        parts.append("".join(lines[start : start + LINES_PER_PART]).encode())
        _blank(lines, start)
    return parts


def release(strings: list[str]) -> None:
    """Free `strings` a part at a time: dropping a list of 200,000 strings at once frees them
    all in one C call, about 20 ms with the GIL (and the event loop) held."""
    for start in range(0, len(strings), LINES_PER_PART):
        _blank(strings, start)


def _blank(strings: list[str], start: int) -> None:
    end = min(start + LINES_PER_PART, len(strings))
    strings[start:end] = [""] * (end - start)  # the same length: no item moves
