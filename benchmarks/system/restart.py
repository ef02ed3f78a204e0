"""Claim 4, restart without restore: records re-read after a restart on the store, and
without it (store deleted)."""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

from benchmarks.system.harness import TOPIC, Bench, partition_of, say
from materializer.kafka_offsets import end_offsets


def restart(bench: Bench, records: int) -> dict[str, Any]:
    name = "c"
    results = {}
    for mode in ("on its store", "store deleted"):
        node = bench.nodes[name]
        before = {p["partition"]: p["current_offset"] for p in node.metadata()["partitions"]}
        say(f"  restart ({mode}): kill -9 node {name}, write {records:,} records to its partitions")
        node.process.signal(signal.SIGKILL)
        node.close()
        mine = [
            k for k in (f"restart-{i}" for i in range(records * 20)) if partition_of(k) in before
        ]
        for key in mine[:records]:
            bench.writer.write(key)
        bench.writer.flush()
        ends = high_watermarks(bench, set(before))
        started = time.monotonic()
        with bench.sampler.phase(f"restart/{mode}"):
            node = bench.start_node(name, wipe=mode == "store deleted")
            node.wait_ready(timeout_s=240)
            ready_s = time.monotonic() - started
            metadata = node.wait_caught_up(ends, timeout_s=300)
            caught_up_s = time.monotonic() - started
        missed = sum(ends[p] - before[p] for p in before)
        reread = int(metadata["ingest"]["records"])
        results[mode] = {
            "records_written_while_down": missed,
            "records_reread": reread,
            "reread_beyond_missed": reread - missed,
            "partition_records_total": sum(ends[p] for p in before),
            "ready_s": round(ready_s, 1),
            "caught_up_s": round(caught_up_s, 1),
            "partitions": sorted(before),
        }
        bench.wait_settled()
    return results


def high_watermarks(bench: Bench, partitions: set[int]) -> dict[int, int]:
    """The partitions' end offsets from the broker (Fetch high watermarks, see docs/broker-quirks.md)."""
    return asyncio.run(end_offsets(bench.bootstrap, TOPIC, sorted(partitions)))
