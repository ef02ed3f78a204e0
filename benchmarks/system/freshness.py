"""Claim 5, freshness: a new key every 50 ms; time from produce() until the proxy answers 200."""

from __future__ import annotations

import time
from typing import Any

import httpx

from benchmarks.loadgen import latency_figures
from benchmarks.system.harness import Bench, key_path


def freshness(bench: Bench, samples: int, interval_s: float = 0.05) -> dict[str, Any]:
    client = httpx.Client(timeout=5, trust_env=False)
    pending: dict[str, float] = {}
    latencies: list[float] = []
    sent = 0
    next_send = time.perf_counter()
    deadline = next_send + samples * interval_s + 30
    with bench.sampler.phase("freshness"):
        while (sent < samples or pending) and time.perf_counter() < deadline:
            if sent < samples and time.perf_counter() >= next_send:
                key = f"fresh-{sent}-{time.time_ns()}"
                pending[key] = time.perf_counter()
                bench.writer.write(key)
                sent += 1
                next_send += interval_s
            for key, began in list(pending.items()):
                if client.get(bench.kroute.url + key_path(key)).status_code == 200:
                    latencies.append((time.perf_counter() - began) * 1000)
                    del pending[key]
            time.sleep(0.005)
    client.close()
    return {
        "samples": len(latencies),
        "never_visible": len(pending),
        "produce_rate_per_s": round(1 / interval_s),
        **latency_figures(latencies),
    }
