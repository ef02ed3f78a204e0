"""KROUTE_STALL_REPORT_MS: a stalled event loop says what held it, while it is held.

The stacks come from faulthandler's watchdog thread, which needs no GIL: it prints them during
the stall, when the code holding the loop is still on the stack (a Python thread could only
look after the stall, when that code is gone)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis
from structlog.testing import capture_logs

from common.contract import Keys
from proxy.settings import ProxySettings
from proxy.watcher import TableWatcher


def watcher(stall_report_ms: int | None) -> TableWatcher:
    table = TableWatcher(
        aioredis.Redis(host="127.0.0.1", port=1),  # never used by the probe
        Keys("stall"),
        refresh_interval_ms=1000,
        networks=None,
    )
    table.stall_report_ms = stall_report_ms
    return table


def hold_the_loop_for_a_while() -> None:
    time.sleep(0.3)  # what a scrape rendered on the loop, or a big rebuild, would do


async def probe_through_a_stall(table: TableWatcher) -> None:
    probe = asyncio.create_task(table._probe_loop())
    await asyncio.sleep(0.05)
    asyncio.get_running_loop().call_soon(hold_the_loop_for_a_while)
    await asyncio.sleep(0.1)
    probe.cancel()
    with pytest.raises(asyncio.CancelledError):
        await probe


def test_a_stall_prints_the_stack_that_held_the_loop_and_logs_how_long(capfd) -> None:  # type: ignore[no-untyped-def]
    table = watcher(stall_report_ms=100)
    with capture_logs() as logs:
        asyncio.run(probe_through_a_stall(table))
    stacks = capfd.readouterr().err
    assert "hold_the_loop_for_a_while" in stacks
    stalls = [entry for entry in logs if entry["event"] == "event loop stalled"]
    assert len(stalls) == 1
    assert 250 <= stalls[0]["stall_ms"] < 1000
    assert stalls[0]["proxy_cpu_ms"] < stalls[0]["stall_ms"]  # slept: not on a core
    assert table.stats.max_loop_lag_ms >= 250
    assert table.stats.max_loop_lag_busy_ms < 100


def test_off_by_default_nothing_is_printed_or_logged(capfd) -> None:  # type: ignore[no-untyped-def]
    table = watcher(stall_report_ms=None)
    with capture_logs() as logs:
        asyncio.run(probe_through_a_stall(table))
    assert "hold_the_loop_for_a_while" not in capfd.readouterr().err
    assert not [entry for entry in logs if entry["event"] == "event loop stalled"]
    assert table.stats.max_loop_lag_ms >= 250  # still measured


def test_the_setting_refuses_a_threshold_below_the_probes_resolution() -> None:
    with pytest.raises(ValueError, match="stall_report_ms"):
        ProxySettings(redis_url="redis://127.0.0.1:6379/0", stall_report_ms=5)  # type: ignore[arg-type]
