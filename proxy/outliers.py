"""Outlier ejection on answers: a node whose answers are 5xx (or unusable) N times in a row is
ejected, like Envoy's `consecutive_5xx`, but never so many that more than a share of the live
nodes is out at once (Envoy's `max_ejection_percent`): a bad deploy that makes every node
answer 500 must not leave the proxy with nothing but last resorts.

"In a row" needs every answer, and the C path answers most of them without Python. So the C
path leaves 5xx to Python (they have no status line in the hub: see proxy.main) and counts
each answer it serves itself, all below 500, on the node's Tally (`answered`); the Python path
counts its own there too. A 5xx is then consecutive to the previous one exactly when
`answered` did not move in between: one integer per answer in C, no call into Python.

Retry statuses (KROUTE_RETRY_STATUSES) are neither: they are about one partition, and they
are left out before this module sees an answer. Refused, reset and timed-out connections eject
at once (proxy.health), with no cap: a dead node must go last whatever else is ejected. A try
that lost a hedged race counts like a 5xx: a node that stopped (SIGSTOP, a long GC pause)
answers nothing, so without this it would cost every request the hedge delay and a budget
token until the budget ran out; now it is ejected after that many lost races.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import structlog

from proxy._hotpath import Candidate
from proxy.health import Ejections
from proxy.metrics import ProxyMetrics

log = structlog.get_logger("kroute.proxy.outliers")


@dataclass(slots=True)
class _Streak:
    count: int
    answered: int  # the node's Tally.answered at its last 5xx


class Outliers:
    def __init__(
        self,
        ejections: Ejections,
        metrics: ProxyMetrics,
        *,
        consecutive_5xx: int,
        max_ejection_percent: int,
        live_nodes: Callable[[], int],
    ) -> None:
        self.ejections = ejections
        self.metrics = metrics
        self.consecutive_5xx = consecutive_5xx
        self.max_ejection_percent = max_ejection_percent
        self.live_nodes = live_nodes
        self._streaks: dict[str, _Streak] = {}

    def answered(self, candidate: Candidate, status: int) -> None:
        """An answer from the candidate's node (502 for one the proxy could not pass on)."""
        if status < 500:
            candidate.node_tally.answered += 1  # ends any streak, as the C path's answers do
        else:
            self.failed(candidate, f"answered {status}")

    def failed(self, candidate: Candidate, what: str) -> None:
        """A 5xx, or a gateway failure that does not eject by itself: an unusable answer, or
        a try that lost a hedged race (no answer within the hedge delay while a replica
        answered: a stopped or paused node loses every race and answers nothing between)."""
        node_id = candidate.target.node_id
        answered = candidate.node_tally.answered
        streak = self._streaks.get(node_id)
        if streak is None or streak.answered != answered:
            streak = self._streaks[node_id] = _Streak(0, answered)
        streak.count += 1
        if streak.count >= self.consecutive_5xx:
            self._eject(node_id, candidate.target.url, streak, what)

    def _eject(self, node_id: str, url: str, streak: _Streak, what: str) -> None:
        ejected = self.ejections.ejected
        if node_id in ejected:
            return
        if len(ejected) + 1 > self.cap():
            self.metrics.outlier_ejections_capped += 1
            if streak.count == self.consecutive_5xx:  # once per streak, not per answer
                log.warning(
                    "node not ejected: the ejection cap is reached",
                    node=node_id,
                    consecutive_5xx=streak.count,
                    ejected=sorted(ejected),
                    cap=self.cap(),
                )
            return
        del self._streaks[node_id]
        self.metrics.outlier_ejections += 1
        self.ejections.eject(
            node_id, url, f"{streak.count} consecutive 5xx or gateway failures (last: {what})"
        )

    def cap(self) -> int:
        """How many nodes may be ejected at once: the share of live ones, at least one."""
        return max(1, self.live_nodes() * self.max_ejection_percent // 100)
