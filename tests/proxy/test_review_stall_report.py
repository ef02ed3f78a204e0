"""KROUTE_STALL_REPORT_MS is a diagnostic: turning it on must never stop the table watcher.

`faulthandler.dump_traceback_later(file=sys.stderr)` raises when stderr has no file descriptor
(a proxy started with stderr closed has `sys.stderr` None; an embedding or a test may replace
it). The probe runs in the watcher's task group, so that error ends `_poll` and `_listen` too,
and the proxy (which does not watch that task until it stops) routes on a table nobody
refreshes. Found in review: now the stacks are turned off (and that logged) instead."""

from __future__ import annotations

import asyncio
import io
import sys

import pytest

from tests.proxy.test_stall_report import watcher


async def probe_for_a_while(stall_report_ms: int | None) -> bool:
    """Whether the probe still runs after 100 ms (ten probes)."""
    probe = asyncio.create_task(watcher(stall_report_ms)._probe_loop())
    await asyncio.sleep(0.1)
    alive = not probe.done()
    probe.cancel()
    await asyncio.gather(probe, return_exceptions=True)
    return alive


@pytest.mark.parametrize("stderr", [io.StringIO(), None], ids=["no-fileno", "closed"])
def test_the_probe_keeps_running_when_stderr_cannot_take_the_stacks(monkeypatch, stderr) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(sys, "stderr", stderr)
    assert asyncio.run(probe_for_a_while(stall_report_ms=100))


def test_without_the_report_the_probe_does_not_need_stderr(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(sys, "stderr", None)
    assert asyncio.run(probe_for_a_while(stall_report_ms=None))
