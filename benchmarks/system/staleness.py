"""Claim 3, staleness is bounded and visible: the only live replica falls behind while reads
ask for lag budgets."""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
from collections import Counter
from typing import Any

from benchmarks.loadgen import Outcome, Request, SteadyLoad
from benchmarks.system.harness import (
    Bench,
    SteadyWriter,
    Writer,
    key_path,
    key_samples,
    most_active,
    partition_of,
    say,
)
from kroute.cluster_harness import spark_jvm_pid

BUDGETS_MS = (250, 500, 1000, 2000, 4000, 8000, 16000)


def staleness(bench: Bench, seconds: float, rate: float) -> dict[str, Any]:
    dead, dead_actives = most_active(bench)
    standbys = bench.standbys()
    throttled = Counter(standbys[p] for p in dead_actives).most_common(1)[0][0]
    affected = [p for p in dead_actives if standbys[p] == throttled]
    keys = [k for k in key_samples("uniform", 20_000) if partition_of(k) in affected][:60]
    say(
        f"  staleness: kill -9 node {dead}; stop node {throttled}'s Spark, the only live "
        f"replica of partitions {affected}"
    )
    bench.nodes[dead].process.signal(signal.SIGKILL)
    time.sleep(4)  # past the heartbeat TTL
    jvm = spark_jvm_pid(bench.nodes[throttled])
    requests = (
        Request(key_path(k), (("x-kroute-max-lag-ms", str(b)),), str(b))
        for k, b in zip(itertools.cycle(keys), itertools.cycle(BUDGETS_MS), strict=False)
    )
    port = int(bench.kroute.url.rsplit(":", 1)[1])
    writes = SteadyWriter(bench.writer, keys, 40).start()
    with bench.sampler.phase("staleness"):
        os.kill(jvm, signal.SIGSTOP)
        throttled_at = time.time()
        load = SteadyLoad("127.0.0.1", port, requests, rate=rate, connections=8, keep_body=True)
        load.start()
        time.sleep(seconds)
        outcomes = load.stop()
        os.kill(jvm, signal.SIGCONT)
    writes.stop()
    result = judge_staleness(bench.writer, outcomes)
    result.update(
        {
            "throttled_node": throttled,
            "killed_node": dead,
            "partitions": affected,
            "throttled_for_s": round(time.time() - throttled_at, 1),
            "keys": len(keys),
        }
    )
    say(f"  restarting node {dead} ...")
    bench.start_node(dead).wait_ready(timeout_s=240)
    bench.wait_settled()
    return result


def judge_staleness(writer: Writer, outcomes: list[Outcome]) -> dict[str, Any]:
    """Per budget: availability, and answers older than the budget by the writes they miss."""
    per_budget: dict[str, dict[str, Any]] = {}
    for budget in BUDGETS_MS:
        mine = [o for o in outcomes if o.label == str(budget)]
        answered = [o for o in mine if o.status == 200]
        staleness_ms = [true_staleness_ms(writer, o) for o in answered]
        per_budget[str(budget)] = {
            "requests": len(mine),
            "answered": len(answered),
            "refused_503": sum(o.status == 503 for o in mine),
            "other": sum(o.status not in (200, 503) for o in mine),
            "availability": round(len(answered) / max(len(mine), 1), 3),
            "beyond_budget": sum(s > budget for s in staleness_ms),
            "max_true_staleness_ms": round(max(staleness_ms), 1) if staleness_ms else None,
        }
    return {
        "per_budget_ms": per_budget,
        "beyond_budget_total": sum(v["beyond_budget"] for v in per_budget.values()),
    }


def true_staleness_ms(writer: Writer, outcome: Outcome) -> float:
    """How long the oldest write to the key that the answer does not show had been written
    when the answer arrived (0 if it shows the latest). Measured from before produce(), so it
    errs against kroute."""
    body = json.loads(outcome.body)
    key = outcome.path.rsplit("/", 1)[1]
    oldest = writer.oldest_unseen_write(key, int(body["value"]["n"]))
    received = outcome.sent_at + outcome.latency_ms / 1000
    if oldest is None or oldest >= received:
        return 0.0
    return (received - oldest) * 1000
