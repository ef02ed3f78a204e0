"""The proxy's side of freshness bounds (common.freshness): read them from a request, pass the
effective ones on to the node, and read a node's refusal of them.

The node checks the bounds itself (materializer.read_bounds), so a proxy choosing from a
stale table never serves beyond them: it sends the budget it enforces, which is the configured
one tightened by the request's headers (a client's looser header must not loosen the node's
check), or the configured one alone when the request asks for none (on the C path too), and the
min offset as the client sent it. A node's 421 with `x-kroute-refused` is a
refusal of those bounds, not "not mine": the proxy asks the next replica without re-reading
its table, and when no replica is left answers 503 naming each refusal, the offset asked and
the furthest position any replica is known to have reached.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from common.freshness import (
    MAX_LAG_HEADER,
    MAX_LAG_MS_HEADER,
    MIN_OFFSET_HEADER,
    POSITION_HEADER,
    REFUSED_HEADER,
    BadFreshnessHeader,
    parse_min_offsets,
    parse_position_token,
)
from proxy.choice import LagBudget, Replica
from proxy.errors import BadRequest

MIN_OFFSET = MIN_OFFSET_HEADER.encode()
_BUDGET_NAMES = frozenset({MAX_LAG_HEADER.encode(), MAX_LAG_MS_HEADER.encode()})
_REFUSED_LINE = re.compile(
    rb"^" + REFUSED_HEADER.encode() + rb"[ \t]*:[ \t]*([^\r\n]*?)[ \t]*\r?$",
    re.IGNORECASE | re.MULTILINE,
)
_POSITION_LINE = re.compile(
    rb"^" + POSITION_HEADER.encode() + rb"[ \t]*:[ \t]*([^\r\n]*?)[ \t]*\r?$",
    re.IGNORECASE | re.MULTILINE,
)


def min_offset_of(raw: bytes | None, partition: int) -> int | None:
    """The offset the request's x-kroute-min-offset asks the key's partition to have applied
    (None: no bound); BadRequest, saying what is wrong, for a malformed value."""
    if raw is None:
        return None
    try:
        return parse_min_offsets(raw.decode("latin-1")).for_partition(partition)
    except BadFreshnessHeader as exc:
        raise BadRequest(str(exc), header=exc.header, value=exc.value) from None


def with_budget(headers: list[tuple[bytes, bytes]], budget: LagBudget) -> list[tuple[bytes, bytes]]:
    """The request's headers with its budget headers replaced by the budget the proxy applies."""
    kept = [(name, value) for name, value in headers if name not in _BUDGET_NAMES]
    return kept + _budget_headers(budget)


def _budget_headers(budget: LagBudget) -> list[tuple[bytes, bytes]]:
    limits = ((MAX_LAG_HEADER, budget.max_offsets), (MAX_LAG_MS_HEADER, budget.max_ms))
    return [(name.encode(), str(limit).encode()) for name, limit in limits if limit is not None]


def node_budget(configured: LagBudget, unknown_lag: str) -> LagBudget | None:
    """The budget every keyed read carries to its node when the request asks for none: the
    configured one, so a proxy choosing from a stale table still never serves beyond it.
    None when there is no budget, or when the proxy accepts unknown lag: a node refuses a read
    whose lag it does not know (materializer.read_bounds), which that policy chose to serve."""
    if configured.unlimited or unknown_lag != "reject":
        return None
    return configured


def node_budget_lines(budget: LagBudget | None) -> bytes:
    """The same headers as lines of a request head, for the C path (Hub.request_lines): placed
    where `with_budget` puts them, after the client's headers."""
    if budget is None:
        return b""
    return b"".join(name + b": " + value + b"\r\n" for name, value in _budget_headers(budget))


@dataclass(frozen=True, slots=True)
class NodeRefusal:
    """A node's 421 for bounds it cannot meet: why, and its position token (if it sent one)."""

    reason: str
    applied_offset: int | None

    @property
    def positional(self) -> bool:
        return self.reason.startswith("position ")


def refusal_of(lines: bytes) -> NodeRefusal | None:
    """The refusal in a node's answer head (its header lines); None when it is not one."""
    found = _REFUSED_LINE.search(lines)
    if found is None:
        return None
    position = _POSITION_LINE.search(lines)
    token = parse_position_token(position.group(1).decode("latin-1")) if position else None
    return NodeRefusal(found.group(1).decode("latin-1"), None if token is None else token[1])


def unmet(
    refusals: Sequence[NodeRefusal], min_offset: int | None, replicas: Iterable[Replica | None]
) -> tuple[str, str, dict[str, Any]]:
    """(error, detail, extra fields) of the 503 when every replica asked refused the bounds."""
    if min_offset is None or not any(r.positional for r in refusals):
        return (
            "beyond_budget",
            "every replica asked is beyond the lag budget by its own measure",
            {},
        )
    known = [r.applied_offset for r in refusals if r.applied_offset is not None]
    known += [r.position - 1 for r in replicas if r is not None and r.position is not None]
    best = max(known, default=None)
    return (
        "position_not_reached",
        f"no replica has applied offset {min_offset} of the partition yet"
        + ("" if best is None else f" (the furthest has applied up to {best})"),
        {"min_offset": min_offset, "best_applied_offset": best},
    )
