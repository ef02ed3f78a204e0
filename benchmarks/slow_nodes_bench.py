"""Slow nodes and read-your-writes (issue 19's benchmark), measured side by side in one run.

The cluster of `benchmarks/system_bench.py` (its harness, imported: one Tansu broker, one
redis-server, three Spark materializer nodes, 12 partitions with one standby each) with two
proxies in front, identical but for hedging: `plain` (the default: no hedging, per-try timeout
unset, so the 2 s upstream timeout) and `hedged` (`KROUTE_HEDGE_AFTER_MS`, 50 ms by default).
Both get the same steady lookup load at the same time while a writer updates keys at 20/s:

1. steady state   no fault: hedges sent / requests on the hedged proxy, from its /metrics
                  (goal: < 5%).
2. SIGSTOP        the node active for the most partitions is stopped for 10 s: per proxy,
                  p50/p99/max latency of requests sent inside the window, failed requests,
                  requests that waited out the 2 s timeout (goal with hedging: p99 < 50 ms and
                  no request slower than the hedge delay plus one node round trip).
3. read-your-writes  writers produce a unique value to one of their own keys, take partition
                  and offset from librdkafka's delivery report, and read the key at once
                  through the proxy with `x-kroute-min-offset: <offset>`: latency from the
                  acknowledgement to a successful read (p50/p99), failures, and whether every
                  read returned the value written. For comparison, every other write is read
                  without the header.

Results: `benchmarks/results/slow_nodes.json` and the `slow_nodes` section of RESULTS.md.

Usage: .venv/bin/python -m benchmarks.slow_nodes_bench [--rate 200] [--hedge-after-ms 50]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.loadgen import Outcome, failures, latency_figures, percentile
from benchmarks.proxy_bench import metric_sum
from benchmarks.results_file import git_revision, machine_notes, write_json, write_section
from benchmarks.system.harness import (
    CUSTOMERS,
    PARTITIONS,
    TOPIC,
    UPSTREAM_TIMEOUT_MS,
    Bench,
    SteadyWriter,
    key_path,
    key_samples,
    most_active,
    partition_of,
    say,
    start_bench,
    steady_load,
)
from benchmarks.system.survive import timeline, window_figures
from kroute.cluster_harness import keyed_producer
from kroute.embedded import EmbeddedServices
from kroute.proxies import ProxyHandle, start_proxy

STOP_S = 10.0


class OtherTests(threading.Thread):
    """Counts, every 5 s, processes not started by this run whose command line runs pytest:
    another engineer's tests sharing the machine."""

    def __init__(self) -> None:
        super().__init__(name="other-tests", daemon=True)
        self.samples: list[int] = []
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(5):
            count = 0
            for proc in Path("/proc").iterdir():
                if not proc.name.isdigit():
                    continue
                try:
                    cmdline = (proc / "cmdline").read_bytes()
                except OSError:
                    continue
                if b"pytest" in cmdline:
                    count += 1
            self.samples.append(count)

    def stop(self) -> dict[str, int]:
        self._done.set()
        self.join(10)
        return {
            "samples": len(self.samples),
            "samples_with_pytest_running": sum(c > 0 for c in self.samples),
        }


def counters(proxy: ProxyHandle) -> dict[str, float]:
    text = proxy.admin("/metrics").text
    names = ("hedges_sent", "hedges_won", "hedges_cancelled", "retry_budget_exhausted")
    found = {name: metric_sum(text, f"kroute_proxy_{name}_total") for name in names}
    found["responses"] = metric_sum(text, "kroute_proxy_responses_total")
    found["outlier_ejections"] = metric_sum(text, "kroute_proxy_outlier_ejections_total")
    return found


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    return {name: round(after[name] - before[name]) for name in after}


def slow_node(
    bench: Bench,
    proxies: dict[str, ProxyHandle],
    rate: float,
    connections: int,
    steady_s: float,
    hedge_after_ms: int,
    warmup_s: float,
) -> dict[str, Any]:
    """Steady state (hedge overhead), then SIGSTOP of the busiest active for STOP_S seconds."""
    keys = key_samples("uniform", 5_000)
    victim, partitions = most_active(bench)
    writes = SteadyWriter(bench.writer, key_samples("uniform", 2_000), 20).start()
    loads = {
        name: steady_load(proxy, keys, rate, connections=connections, timeout_s=10)
        for name, proxy in proxies.items()
    }
    node = bench.nodes[victim]
    stopped = False
    try:
        say(f"  warm-up: {warmup_s:g} s of the same load (Spark's JIT, pools)")
        time.sleep(warmup_s)
        say(f"  steady state: {steady_s:g} s, no fault")
        before = {name: counters(p) for name, p in proxies.items()}
        steady_from = time.time()
        time.sleep(steady_s)
        steady_until = time.time()
        steady = {name: delta(counters(p), before[name]) for name, p in proxies.items()}
        say(f"  SIGSTOP node {victim} (active for {len(partitions)} of {PARTITIONS}) {STOP_S:g} s")
        before = {name: counters(p) for name, p in proxies.items()}
        fault_at = time.time()
        node.process.signal(signal.SIGSTOP)
        stopped = True
        time.sleep(STOP_S)
        node.process.signal(signal.SIGCONT)
        stopped = False
        time.sleep(8)
        until = time.time()
        during = {name: delta(counters(p), before[name]) for name, p in proxies.items()}
    finally:
        if stopped:
            node.process.signal(signal.SIGCONT)
        outcomes = {name: load.stop() for name, load in loads.items()}
        writes.stop()
    result: dict[str, Any] = {
        "victim": victim,
        "victim_active_partitions": len(partitions),
        "rate_per_proxy": rate,
        "connections_per_proxy": connections,
        "hedge_after_ms": hedge_after_ms,
        "steady_s": round(steady_until - steady_from, 1),
        "warmup_s": warmup_s,
        "steady_state": {},
        "sigstop": {},
    }
    stopped_latencies: dict[str, list[float]] = {}
    for name, got in outcomes.items():
        result["steady_state"][name] = steady_figures(got, steady_from, steady_until, steady[name])
        window = window_figures(got, fault_at, until)
        stopped_latencies[name] = sorted(
            (o.latency_ms for o in got if fault_at <= o.sent_at <= fault_at + STOP_S),
            reverse=True,
        )
        window["slowest_ms"] = [round(ms, 1) for ms in stopped_latencies[name][:10]]
        window["metrics"] = during[name]
        window["timeline"] = timeline(got, fault_at)
        result["sigstop"][name] = window
    judge(result, hedge_after_ms, stopped_latencies["hedged"])
    return result


def steady_figures(
    got: list[Outcome], since: float, until: float, metrics: dict[str, int]
) -> dict[str, Any]:
    inside = [o for o in got if since <= o.sent_at <= until]
    latencies = [o.latency_ms for o in inside]
    return {
        "requests": len(inside),
        "failed": len(failures(inside)),
        **latency_figures(latencies),
        "metrics": metrics,
        "hedge_share": round(metrics["hedges_sent"] / max(metrics["responses"], 1), 4),
    }


def judge(result: dict[str, Any], hedge_after_ms: int, latencies: list[float]) -> None:
    """The issue's goals, against what was measured. One node round trip: the hedged proxy's
    p99 at steady state (through the proxy, so it is generous to the proxy)."""
    hedged = result["sigstop"]["hedged"]
    round_trip = result["steady_state"]["hedged"]["p99_ms"] or 0.0
    strict = hedge_after_ms + (result["steady_state"]["hedged"]["p50_ms"] or 0.0)
    bound = hedge_after_ms + round_trip
    # README: the sweeper keeps deadlines every 1/4 of the hedge delay, so that much more.
    sweeper_bound = bound + hedge_after_ms / 4
    result["goals"] = {
        "round_trip_ms": round_trip,
        "bound_ms": round(bound, 1),
        "bound_with_sweeper_ms": round(sweeper_bound, 1),
        "hedged_over_bound": sum(ms > bound for ms in latencies),
        "strict_bound_ms": round(strict, 1),
        "hedged_over_strict_bound": sum(ms > strict for ms in latencies),
        "hedged_requests_in_window": len(latencies),
        "hedged_over_bound_with_sweeper": sum(ms > sweeper_bound for ms in latencies),
        "hedged_p99_under_50ms": hedged["p99_ms"] is not None and hedged["p99_ms"] < 50,
        "hedged_max_within_bound": bool(latencies) and latencies[0] <= bound,
        "steady_hedge_share_under_5pct": result["steady_state"]["hedged"]["hedge_share"] < 0.05,
    }


# 3. Read-your-writes --------------------------------------------------------------------------


class RywWriter(threading.Thread):
    """Writes unique values to its own keys; reads each back through the proxy at once, every
    other one with `x-kroute-min-offset` (the acknowledged offset), the rest without."""

    def __init__(self, number: int, bootstrap: str, proxy_url: str, until: float) -> None:
        super().__init__(name=f"ryw-{number}", daemon=True)
        self.number, self.proxy_url, self.until = number, proxy_url, until
        self.producer = keyed_producer(bootstrap, linger_ms=0)
        self.keys = [f"ryw-{number}-{i}" for i in range(10)]
        self.samples: list[dict[str, Any]] = []

    def produce(self, key: str, token: str) -> tuple[int, int, float]:
        acked: list[tuple[int, int, float]] = []

        def on_delivery(err: Any, msg: Any) -> None:
            if err is None:
                acked.append((msg.partition(), msg.offset(), time.perf_counter()))

        value = json.dumps({"customer": key, "token": token, "n": -1, "written_ms": 0})
        self.producer.produce(
            TOPIC, key=key.encode(), value=value.encode(), on_delivery=on_delivery
        )
        self.producer.flush(30)
        if not acked:
            raise RuntimeError(f"write of {key} was not acknowledged")
        return acked[0]

    def prime(self) -> None:
        for key in self.keys:
            self.produce(key, "prime")

    def run(self) -> None:
        client = httpx.Client(timeout=10, trust_env=False)
        count = 0
        while time.monotonic() < self.until:
            key = self.keys[count % len(self.keys)]
            token = f"{self.number}-{count}-{time.time_ns()}"
            with_header = count % 2 == 0
            count += 1
            part, offset, acked_at = self.produce(key, token)
            headers = {"x-kroute-min-offset": str(offset)} if with_header else {}
            sample: dict[str, Any] = {
                "with_header": with_header,
                "partition_matches": part == partition_of(key),
                "attempts": [],
            }
            deadline = acked_at + 5
            while True:
                response = client.get(self.proxy_url + key_path(key), headers=headers)
                got = None
                if response.status_code == 200:
                    got = response.json()["value"].get("token")
                sample["attempts"].append(response.status_code)
                if response.status_code != 200 and "refusal" not in sample:
                    sample["refusal"] = refusal_summary(response)
                if response.status_code == 200 and got == token:
                    sample["latency_ms"] = (time.perf_counter() - acked_at) * 1000
                    sample["position"] = response.headers.get("x-kroute-position")
                    break
                if response.status_code == 200:
                    sample.setdefault("stale_answers", 0)
                    sample["stale_answers"] += 1
                if time.perf_counter() > deadline:
                    break
                time.sleep(0.01)
            self.samples.append(sample)
        client.close()


def refusal_summary(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {"status": response.status_code}
    if not isinstance(body, dict):
        return {"status": response.status_code}
    kept = ("error", "min_offset", "best_applied_offset", "tried")
    return {"status": response.status_code, **{k: body[k] for k in kept if k in body}}


def read_your_writes(
    bench: Bench, proxy: ProxyHandle, seconds: float, writers: int
) -> dict[str, Any]:
    say(f"  read-your-writes: {writers} writers for {seconds:g} s")
    threads = [RywWriter(i, bench.bootstrap, proxy.url, 0.0) for i in range(writers)]
    for thread in threads:
        thread.prime()
    time.sleep(3)  # the primed keys applied everywhere
    background = SteadyWriter(bench.writer, key_samples("uniform", 2_000), 20).start()
    until = time.monotonic() + seconds
    for thread in threads:
        thread.until = until
        thread.start()
    for thread in threads:
        thread.join(seconds + 60)
    background.stop()
    samples = [s for t in threads for s in t.samples]
    result: dict[str, Any] = {"writers": writers, "seconds": seconds}
    for label, with_header in (("with_min_offset", True), ("without_header", False)):
        mine = [s for s in samples if s["with_header"] == with_header]
        ok = [s for s in mine if "latency_ms" in s]
        first_ok = [s for s in ok if len(s["attempts"]) == 1]
        latencies = [s["latency_ms"] for s in ok]
        result[label] = {
            "writes": len(mine),
            "read_the_write": len(ok),
            "on_first_read": len(first_ok),
            "first_read_failed_by_status": count_statuses(
                s["attempts"][0] for s in mine if s["attempts"][0] != 200
            ),
            "first_read_returned_an_older_value": sum(
                s["attempts"][0] == 200 and len(s["attempts"]) > 1 for s in mine
            ),
            "never_read_within_5s": len(mine) - len(ok),
            "answers_with_an_older_value": sum(s.get("stale_answers", 0) for s in mine),
            "first_refusals": [s["refusal"] for s in mine if "refusal" in s][:5],
            "first_refusal_errors": count_statuses(
                s["refusal"].get("error", s["refusal"]["status"]) for s in mine if "refusal" in s
            ),
            "partition_mismatch": sum(not s["partition_matches"] for s in mine),
            "p50_ms": percentile(latencies, 0.5),
            "p99_ms": percentile(latencies, 0.99),
            "max_ms": round(max(latencies), 1) if latencies else None,
            "first_read_p50_ms": percentile([s["latency_ms"] for s in first_ok], 0.5),
            "first_read_p99_ms": percentile([s["latency_ms"] for s in first_ok], 0.99),
        }
    return result


def count_statuses(statuses: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for status in statuses:
        counts[str(status)] = counts.get(str(status), 0) + 1
    return counts


# Report ---------------------------------------------------------------------------------------


def render(f: dict[str, Any]) -> str:
    s, r = f["slow_node"], f["read_your_writes"]
    g = s["goals"]
    plain, hedged = s["sigstop"]["plain"], s["sigstop"]["hedged"]
    sp, sh = s["steady_state"]["plain"], s["steady_state"]["hedged"]

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}x" if a and b else "-"

    def yes(flag: bool) -> str:
        return "met" if flag else "**not met**"

    lines = [
        "## Slow nodes and read-your-writes (issue 19)",
        "",
        f"`{f['command']}` — {f['machine']}, revision {f['revision']}, {f['date']}. "
        f"Load average {f['load_average_before']} before, {f['load_average_after']} after "
        f"(1, 5, 15 min). Another engineer's tests (pytest) were running in "
        f"{f['other_tests']['samples_with_pytest_running']} of {f['other_tests']['samples']} "
        f"checks made every 5 s during the run. {f['note']}",
        "",
        f"The cluster of the system benchmark (three Spark nodes, {PARTITIONS} partitions, one "
        f"standby each, {CUSTOMERS:,} keys) with two proxies, identical but for hedging: "
        f"`plain` (no hedging) and `hedged` (`KROUTE_HEDGE_AFTER_MS={s['hedge_after_ms']}`); "
        "per-try timeout unset on both, so the 2 s upstream timeout. Both get "
        f"{s['rate_per_proxy']:g} lookups/s (uniform keys, {s['connections_per_proxy']} "
        "keep-alive connections each) at the same time, while 20 writes/s go on. Figures: "
        "[results/slow_nodes.json](results/slow_nodes.json).",
        "",
        "### Extra load from hedges at steady state",
        "",
        f"{s['steady_s']:g} s, no fault. Hedged proxy: **{sh['metrics']['hedges_sent']} hedges "
        f"/ {sh['metrics']['responses']:,} responses = {sh['hedge_share']:.2%}** "
        f"(goal < 5%: {yes(g['steady_hedge_share_under_5pct'])}); won "
        f"{sh['metrics']['hedges_won']}, cancelled {sh['metrics']['hedges_cancelled']}. "
        f"Latency p50/p99/max: plain {sp['p50_ms']} / {sp['p99_ms']} / {sp['max_ms']} ms, "
        f"hedged {sh['p50_ms']} / {sh['p99_ms']} / {sh['max_ms']} ms; failed "
        f"{sp['failed']} / {sh['failed']}.",
        "",
        "### SIGSTOP of an active for 10 s",
        "",
        f"Node {s['victim']} (active for {s['victim_active_partitions']} of {PARTITIONS} "
        "partitions) stopped for 10 s, then continued. Latency of requests sent inside the 10 s; "
        "failures from the stop until 8 s after the continue.",
        "",
        "| proxy | requests | failed | p99 ms before | p50 ms | p99 ms | max ms | waited out the 2 s timeout (max per connection) | hedges sent / won / cancelled | ejections on answers |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for name, w in (("plain", plain), ("hedged", hedged)):
        m = w["metrics"]
        lines.append(
            f"| {name} | {w['requests']:,} | {w['failed']} | {w['p99_ms_before']} | "
            f"{w['p50_ms']} | {w['p99_ms']} | {w['max_ms']} | {w['hung_for_the_timeout']} "
            f"({w['hung_max_per_connection']}) | {m['hedges_sent']} / {m['hedges_won']} / "
            f"{m['hedges_cancelled']} | {m['outlier_ejections']} |"
        )
    lines += [
        "",
        f"Hedged/plain in the window: p99 **{ratio(hedged['p99_ms'], plain['p99_ms'])}**, max "
        f"**{ratio(hedged['max_ms'], plain['max_ms'])}**. Ten slowest requests, hedged: "
        f"{hedged['slowest_ms']} ms; plain: {plain['slowest_ms']} ms.",
        "",
        f"Goals with hedging: p99 < 50 ms: {yes(g['hedged_p99_under_50ms'])} "
        f"({hedged['p99_ms']} ms). No request slower than the hedge delay plus one node round "
        f"trip ({s['hedge_after_ms']} + {g['round_trip_ms']} ms, the hedged proxy's steady p99 "
        f"taken as the round trip, = {g['bound_ms']} ms): {yes(g['hedged_max_within_bound'])} "
        f"(max {hedged['max_ms']} ms; {g['hedged_over_bound']} requests over it, "
        f"{g['hedged_over_bound_with_sweeper']} over {g['bound_with_sweeper_ms']} ms, the bound "
        "plus the sweeper's 1/4 delay granularity). With the steady p50 as the round trip "
        f"instead ({g['strict_bound_ms']} ms): {g['hedged_over_strict_bound']} of "
        f"{g['hedged_requests_in_window']:,} requests over it.",
        "",
        "### Read-your-writes",
        "",
        f"{r['writers']} writer threads for {r['seconds']:g} s, each writing unique values to "
        "10 keys of its own, one write at a time; partition and offset from librdkafka's "
        "delivery report; then a GET through the hedged proxy at once, every other write with "
        "`x-kroute-min-offset: <offset>` and the rest without it, repeated every 10 ms until "
        "it shows the value written (at most 5 s). Latency: from the delivery report to the "
        "answer showing the write.",
        "",
        "| read | writes | first read showed the write | first read: older value | first read: refused | never within 5 s | p50 ms | p99 ms | max ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for label, name in (
        ("with_min_offset", "with x-kroute-min-offset"),
        ("without_header", "without"),
    ):
        row = r[label]
        lines.append(
            f"| {name} | {row['writes']} | {row['on_first_read']} | "
            f"{row['first_read_returned_an_older_value']} | "
            f"{refused_text(row)} | {row['never_read_within_5s']} | "
            f"{row['p50_ms']} | {row['p99_ms']} | {row['max_ms']} |"
        )  # fmt: skip
    w = r["with_min_offset"]
    lines += [
        "",
        f"With the header, {w['on_first_read']} of {w['writes']} first reads returned the value "
        f"written; answers (any attempt) with an older value: "
        f"**{w['answers_with_an_older_value']}** (without the header: "
        f"{r['without_header']['answers_with_an_older_value']}). A refusal is the proxy's 503 "
        "when no replica reached the offset within the node's wait (`KROUTE_MIN_OFFSET_WAIT_MS`, "
        "default 500 ms): the client retried and got the write later. The partition in each "
        "delivery report matched kroute's partitioner "
        f"({w['partition_mismatch'] + r['without_header']['partition_mismatch']} mismatches).",
    ]
    return "\n".join(lines)


def refused_text(row: dict[str, Any]) -> str:
    statuses = row["first_read_failed_by_status"]
    if not statuses:
        return "0"
    reasons = ", ".join(f"{k}: {v}" for k, v in row["first_refusal_errors"].items())
    return f"{sum(statuses.values())} ({', '.join(statuses)}; {reasons})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=200, help="lookups/s per proxy")
    parser.add_argument("--connections", type=int, default=12)
    parser.add_argument("--hedge-after-ms", type=int, default=50)
    parser.add_argument("--steady-seconds", type=float, default=20)
    parser.add_argument("--warmup-seconds", type=float, default=40)
    parser.add_argument("--ryw-seconds", type=float, default=30)
    parser.add_argument("--ryw-writers", type=int, default=4)
    parser.add_argument("--note", default="", help="said in RESULTS.md, e.g. the machine's load")
    parser.add_argument("--max-minutes", type=float, default=12, help="stop everything after")
    args = parser.parse_args(argv)
    given = list(argv if argv is not None else sys.argv[1:])
    if "--note" in given:  # the note is said in RESULTS.md, not repeated in the command
        del given[given.index("--note") : given.index("--note") + 2]
    command = "python -m benchmarks.slow_nodes_bench " + " ".join(
        a for a in given if not a.startswith("--note=")
    )

    def out_of_time(*_: object) -> None:
        raise TimeoutError(f"the benchmark ran over --max-minutes {args.max_minutes:g}")

    signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(int(args.max_minutes * 60))
    workdir = Path(tempfile.mkdtemp(prefix="kroute-slow-nodes-bench-"))
    figures: dict[str, Any] = {
        "machine": machine_notes(),
        "revision": git_revision(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": command.strip(),
        "note": args.note,
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
        "settings": {
            "rate_per_proxy": args.rate,
            "connections": args.connections,
            "hedge_after_ms": args.hedge_after_ms,
            "upstream_timeout_ms": UPSTREAM_TIMEOUT_MS,
            "partitions": PARTITIONS,
            "customers": CUSTOMERS,
        },
    }
    other_tests = OtherTests()
    other_tests.start()
    try:
        with EmbeddedServices(workdir) as services:
            bench = start_bench(services, workdir)
            hedged = start_proxy(
                services,
                bench.redis_url,
                name="proxy-hedged",
                cluster="bench",
                hedge_after_ms=str(args.hedge_after_ms),
            )
            bench.sampler.watch("proxy-hedged", hedged.process.pid)
            bench.wait_settled()
            proxies = {"plain": bench.kroute, "hedged": hedged}
            say("1-2. steady state, then SIGSTOP ...")
            figures["slow_node"] = slow_node(
                bench,
                proxies,
                args.rate,
                args.connections,
                args.steady_seconds,
                args.hedge_after_ms,
                args.warmup_seconds,
            )
            bench.wait_settled()
            say("3. read-your-writes ...")
            figures["read_your_writes"] = read_your_writes(
                bench, hedged, args.ryw_seconds, args.ryw_writers
            )
            bench.sampler.stop()
    finally:
        signal.alarm(0)
        figures["other_tests"] = other_tests.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    figures["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    write_json("slow_nodes", figures)
    write_section("slow_nodes", render(figures))
    say(render(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
