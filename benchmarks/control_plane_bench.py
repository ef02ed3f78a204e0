"""The control plane at scale (issue 22): one real proxy in front of a simulated cluster.

Per size N nodes / P partitions (one standby per partition unless `--standbys 2`):
- writer processes write the Redis contract for N simulated nodes at kroute nodes' rates into
  a real redis-server: every 250 ms each node rewrites `hosting:<id>`, replaces `lag:<id>` and
  confirms its compact report in one MULTI/EXEC (delete, HSET every hosted partition's report,
  PEXPIRE, then SET report:<id> only when its body changed, with a new version, else PEXPIRE
  it, and SET report_at:<id> always), as kroute nodes do (`write_node_report`), and heartbeats
  (`node:<id>`, `nodes`, `store:<name>`, `stores`, `alive:<id>` with a 2 s TTL). Every
  partition takes 100 records a second and every replica keeps up (lag 0, caught up as of
  the end-offset read its report is stamped with, as kroute's writers stamp them), so every
  lag report differs from the last, as under steady writes, while the compact body (lags and
  ages relative to the report) stays the same: only the probe node's changes (`--ages-move`:
  ages move, as for a writer stamping reports with their own time);
- one real proxy (`python -m proxy`) reads it and serves wrk's keyed GETs (random keys over
  every partition) forwarded to three nginx backends answering a fixed small JSON;
- propagation: the writer of the node active for partition 0 reports a lag of 1,000 for it
  (then 0 again, every 1.5 s), and a poller asks the proxy for a key of partition 0 under
  `x-kroute-max-lag: 10` every 5 ms: the delay from the report's EXEC to the first answer from
  the node the new report asks for (the standby, then the active again).
Measured per size: wrk's p50/p99/max and throughput; the share of requests the proxy's C path
served (the rest took the Python path: a choice missing from the cache, or a 503), and how many
partitions' cached choices the table's swaps made it forget or let it keep and renew (a report
that changes no choice must cost the request path nothing); the proxy's longest event-loop stall (its
watcher's loop-lag probe, 10 ms timers) and the longest stretch its table work held the loop;
proxy CPU (all of it and the table's share); the proxy's Redis traffic (bytes on its sockets
to Redis, from `ss`, and the commands its watcher sent); Redis CPU with and without the proxy;
propagation p50/p99; and, for comparison, what one full re-read (the watcher before issue 22:
every key of every node, every second and on every event) reads and costs.
The same paced load (`--steady-rate`) then runs through the proxy, straight to a backend, and
through a proxy of a small cluster (SMALL_TABLE, its own writers) started after the size's proxy
stopped, the size's writers still running: the size's p99 beside the small table's says what
the table costs the request path apart from what the machine's other work does to every
latency at that size.

Results: benchmarks/results/control_plane.json and the `control_plane` section of RESULTS.md.

Smoke run:  .venv/bin/python -m benchmarks.control_plane_bench --sizes 20/240,100/2000 --seconds 5
Full sweep: .venv/bin/python -m benchmarks.control_plane_bench --seconds 30 --writers 4
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from typing import Any

import httpx
import redis

from benchmarks.loadgen import SteadyLoad, cycle_requests, failures_by_status, latency_figures
from benchmarks.placement import pin_tree
from benchmarks.proxy_bench import _nginx_conf, cpu_seconds
from benchmarks.results_file import git_revision, machine_notes, write_json, write_section
from benchmarks.wrk import KEYED_SCRIPT, parse_wrk
from common.contract import (
    BODY_REWRITE_MS,
    Assignment,
    Hosting,
    Keys,
    NodeInfo,
    StoreInfo,
    as_text,
    decode_assignment,
    decode_hosting,
    decode_node,
    decode_report,
    decode_store,
    encode,
)
from kroute.embedded import EmbeddedServices, RedisHandle, free_port, port_open
from kroute.proxies import ProxyHandle, start_proxy
from kroute.static_cluster import round_robin
from partitioner import KeyPartitioner
from proxy.routing import build_snapshot

DEFAULT_SIZES = "20/240,100/2000,300/6000,1000/20000"
STATS_LINE_S = 2.0  # the watcher's stats line period: a line covers the 2 s before it
STORE = "s"
REPORT_MS = 250
ALIVE_TTL_MS = 2_000
RECORDS_PER_S = 100  # per partition: end offsets grow, every report differs
# The table of the proxy whose paced p99 each size's is set beside, under that size's writers.
SMALL_TABLE = (20, 240)
PROBE_PARTITION = 0
PROBE_LAG = 1_000
PROBE_EVERY_S = 1.5
KEYS = 100_000
BODY = '{"store":"s","value":{"plan":"gold"}}'


# -- the simulated cluster (writer processes) --------------------------------------------------


@dataclass
class WriterPlan:
    redis_url: str
    cluster: str
    nodes: list[str]  # every node of the cluster
    mine: list[str]  # the ones this writer reports for
    partitions: int
    standbys: int
    urls: list[str]
    # Real nodes: "caught up at" is the time of the last end-offset read the position reached,
    # so its age moves between reports and the compact body changes on nearly every report.
    # Off: every replica caught up 5 ms before each report (the body stays the same).
    ages_move: bool = False


def _report_json(current: int, end: int, caught_up_at: int, at: int) -> bytes:
    # The contract's encoding (sorted keys, no spaces), formatted directly: json.dumps of
    # 240,000 reports a second would need more cores than the proxy under test.
    return (
        f'{{"caught_up_at_ms":{caught_up_at},"current_offset":{current},"end_offset":{end},'
        f'"newest_record_ms":{at},"updated_at_ms":{at},"v":1}}'
    ).encode()


def _node_report_json(node_id: str, hosted: dict[str, list[int]], version: int, lags: str) -> bytes:
    """`report:<id>` (the contract's compact encoding), formatted directly like _report_json;
    `lags` is its "lag" list, aligned with the active then the standby partitions."""
    active = ",".join(map(str, hosted["active"]))
    standby = ",".join(map(str, hosted["standby"]))
    return (
        f'{{"v":1,"node_id":"{node_id}","generation":1,"stores":{{"{STORE}":'
        f'{{"active":[{active}],"standby":[{standby}],"lag":[{lags}]}}}},"version":{version}}}'
    ).encode()


@dataclass
class _Body:
    """A simulated node's last `report:<id>` body, as `write_node_report` keeps it."""

    lags: str
    version: int
    written_at: int


def _queue_compact(
    pipe: Any,
    keys: Keys,
    node_id: str,
    hosted: dict[str, list[int]],
    at: int,
    lags: str,
    bodies: dict[str, _Body],
) -> None:
    """`report:<id>` only when its body changed (or every BODY_REWRITE_MS), `report_at:<id>`
    always: what `write_node_report` queues."""
    last = bodies.get(node_id)
    report_key, expire_ms = keys.report(node_id), ALIVE_TTL_MS * 10
    if last is None or last.lags != lags:
        version = at if last is None else max(at, last.version + 1)
        last = bodies[node_id] = _Body(lags, version, at)
        pipe.set(report_key, _node_report_json(node_id, hosted, version, lags), px=expire_ms)
    elif at - last.written_at >= BODY_REWRITE_MS:
        last.written_at = at
        pipe.set(report_key, _node_report_json(node_id, hosted, last.version, lags), px=expire_ms)
    else:
        pipe.pexpire(report_key, expire_ms)
    pipe.set(keys.report_at(node_id), f"{last.version} {at}", px=expire_ms)


def _caught_up_ago(plan: WriterPlan, at: int) -> int:
    """How long before the report's time every replica was caught up: 0, as kroute's writers
    stamp a report as of the end-offset read its lag is measured against (a caught-up replica
    reached that read); with `ages_move`, the time since the last end-offset read on a 200 ms
    cycle, as a writer that stamps each report with its own time has it."""
    return at % 200 if plan.ages_move else 0


def _lags(count: int, probe_index: int | None, probe_entry: str, ago: int = 0) -> str:
    """Every replica caught up `ago` ms before the report (lag 0; the newest record's age
    null, as kroute's writers leave it), the probe partition's entry as given."""
    entries = [f"[0,{ago},null]"] * count
    if probe_index is not None:
        entries[probe_index] = probe_entry
    return ",".join(entries)


def run_writer(
    plan: WriterPlan, stop: Any, probe_lag: Synchronized[int], written: Any, started: Any
) -> None:
    """Report for `plan.mine` every REPORT_MS, spread evenly over the period."""
    client = redis.Redis.from_url(plan.redis_url, client_name="bench-writer")
    keys = Keys(plan.cluster)
    placed = round_robin(plan.partitions, plan.nodes, plan.standbys)
    assignment = Assignment(1, plan.nodes[0], 0, {STORE: placed})
    hosted = {
        n: assignment.for_node(n).get(STORE, {"active": [], "standby": []}) for n in plan.mine
    }
    fields = {n: [f"{STORE}/{p}" for ps in hosted[n].values() for p in ps] for n in plan.mine}
    probe_index = {
        n: ([*hosted[n]["active"], *hosted[n]["standby"]].index(PROBE_PARTITION))
        if PROBE_PARTITION in hosted[n]["active"]
        else None
        for n in plan.mine
    }
    urls = dict(zip(plan.nodes, plan.urls, strict=True))
    probe_node = placed[PROBE_PARTITION].active
    last_probe = 0
    bodies: dict[str, _Body] = {}
    groups = 10
    slices = [plan.mine[i::groups] for i in range(groups)]
    epoch = origin = time.time()
    started.set()
    while not stop.is_set():
        for index, group in enumerate(slices):
            due = epoch + index * REPORT_MS / 1000 / groups
            time.sleep(max(0.0, due - time.time()))
            at = int(time.time() * 1000)
            end = int((time.time() - origin) * RECORDS_PER_S) + 1_000
            lag_now = probe_lag.value
            pipe = client.pipeline(transaction=True)
            for node_id in group:
                _heartbeat(pipe, keys, node_id, urls[node_id], at, plan.partitions)
                hosting = Hosting(
                    node_id, 1, {STORE: {r: tuple(ps) for r, ps in hosted[node_id].items()}}, at
                )
                pipe.set(keys.hosting(node_id), encode(hosting))
                pipe.delete(keys.lag(node_id))
                ago = _caught_up_ago(plan, at)
                reports = {f: _report_json(end, end, at - ago, at) for f in fields[node_id]}
                if node_id == probe_node:
                    reports[f"{STORE}/{PROBE_PARTITION}"] = _report_json(
                        end - lag_now, end, at - ago if lag_now == 0 else int(origin * 1000), at
                    )
                if reports:
                    pipe.hset(keys.lag(node_id), mapping=reports)  # type: ignore[arg-type]
                    pipe.pexpire(keys.lag(node_id), ALIVE_TTL_MS * 10)
                caught_up_ago = ago if lag_now == 0 else at - int(origin * 1000)
                lags = _lags(
                    len(fields[node_id]),
                    probe_index[node_id],
                    f"[{lag_now},{caught_up_ago},null]",
                    ago,
                )
                _queue_compact(pipe, keys, node_id, hosted[node_id], at, lags, bodies)
            pipe.execute()
            if probe_node in group and lag_now != last_probe:
                written.put((lag_now, time.time()))
                last_probe = lag_now
        epoch += REPORT_MS / 1000
    client.close()


def _heartbeat(pipe: Any, keys: Keys, node_id: str, url: str, at: int, partitions: int) -> None:
    pipe.set(keys.node(node_id), encode(NodeInfo(node_id, url, at)))
    pipe.sadd(keys.nodes, node_id)
    pipe.set(keys.store(STORE), encode(StoreInfo(STORE, "t", partitions)))
    pipe.sadd(keys.stores, STORE)
    pipe.set(keys.alive(node_id), b"1", px=ALIVE_TTL_MS)


@dataclass
class Writers:
    processes: list[Any]
    stop: Any
    probe_lag: Synchronized[int]
    written: Any

    def close(self) -> None:
        self.stop.set()
        for process in self.processes:
            process.join(5)
            if process.is_alive():
                process.kill()


def start_writers(
    redis_url: str,
    cluster: str,
    size: tuple[int, int],
    standbys: int,
    count: int,
    urls: list[str],
    ages_move: bool = False,
) -> Writers:
    nodes_n, partitions = size
    nodes = [f"node-{i:04d}" for i in range(nodes_n)]
    context = multiprocessing.get_context("spawn")
    stop, written = context.Event(), context.Queue()
    probe_lag: Synchronized[int] = context.Value("i", 0)
    node_urls = [urls[i % len(urls)] for i in range(nodes_n)]
    processes = []
    for index in range(count):
        plan = WriterPlan(
            redis_url,
            cluster,
            nodes,
            nodes[index::count],
            partitions,
            standbys,
            node_urls,
            ages_move,
        )
        started = context.Event()
        process = context.Process(
            target=run_writer, args=(plan, stop, probe_lag, written, started), daemon=True
        )
        process.start()
        started.wait(30)
        processes.append(process)
    client = redis.Redis.from_url(redis_url)
    placed = round_robin(partitions, nodes, standbys)
    client.set(Keys(cluster).assignment, encode(Assignment(1, nodes[0], 0, {STORE: placed})))
    client.close()
    return Writers(processes, stop, probe_lag, written)


# -- measuring ---------------------------------------------------------------------------------


def redis_totals(client: redis.Redis) -> dict[str, float]:
    info = client.info("all")
    return {
        "cpu_s": float(info["used_cpu_user"]) + float(info["used_cpu_sys"]),
        "commands": float(info["total_commands_processed"]),
        "net_out": float(info["total_net_output_bytes"]),
        "net_in": float(info["total_net_input_bytes"]),
    }


def proxy_socket_bytes(pid: int, redis_port: int) -> tuple[int, int]:
    """Bytes the proxy's sockets to Redis received and sent so far (kernel counters)."""
    output = subprocess.run(
        ["ss", "-tinpH", "state", "established", "dst", f"127.0.0.1:{redis_port}"],
        capture_output=True, text=True, check=True, timeout=10,
    ).stdout  # fmt: skip
    received = sent = 0
    for entry in re.split(r"\n(?=\S)", output):
        if f"pid={pid}," not in entry:
            continue
        got = re.search(r"bytes_received:(\d+)", entry)
        out = re.search(r"bytes_acked:(\d+)", entry)
        received += int(got.group(1)) if got else 0
        sent += int(out.group(1)) if out else 0
    return received, sent


def watcher_lines(log_path: Path, since: float, until: float) -> list[dict[str, Any]]:
    """The proxy watcher's "control plane" debug lines logged inside [since, until]."""
    lines = []
    for raw in log_path.read_text(errors="replace").splitlines():
        if '"control plane"' not in raw:
            continue
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        stamp = line.get("timestamp", "")
        when = time.mktime(time.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S")) - time.timezone
        if since <= when <= until:
            lines.append(line)
    return lines


def hot_path_requests(proxy: ProxyHandle) -> float:
    """Keyed requests the proxy's C path forwarded so far (its Prometheus counter)."""
    text = proxy.admin("/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kroute_proxy_hot_path_requests")
    )


def run_wrk(url: str, seconds: int, connections: int, cpus: str | None) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(KEYED_SCRIPT % (f"/stores/{STORE}/keys/customer-", KEYS - 1))
    try:
        output = subprocess.run(
            [*(["taskset", "-c", cpus] if cpus else []), "wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", "-s", script.name,
             "--timeout", "10s", url],
            capture_output=True, text=True, timeout=seconds + 60, check=True,
        ).stdout  # fmt: skip
    finally:
        Path(script.name).unlink()
    figures = parse_wrk(output)
    latency = re.search(r"Latency\s+\S+\s+\S+\s+(\S+)", output)
    figures["max_ms"] = _wrk_ms(latency.group(1)) if latency else None
    return figures


def _wrk_ms(text: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text).groups()  # type: ignore[union-attr]
    return round(float(number) * {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60_000.0}[unit], 3)


def probe_key(partitions: int) -> str:
    partitioner = KeyPartitioner("string", "murmur2", partitions)
    return next(
        f"probe-{i}"
        for i in range(1_000_000)
        if partitioner.partition_of(f"probe-{i}") == PROBE_PARTITION
    )


@dataclass
class Propagation:
    delays_ms: list[float] = field(default_factory=list)
    written_at: list[float] = field(default_factory=list)  # each delay's report, wall time
    missed: int = 0

    def since(self, start: float) -> Propagation:
        """The delays of reports written from `start` on."""
        kept = [(d, w) for d, w in zip(self.delays_ms, self.written_at, strict=True) if w >= start]
        return Propagation([d for d, _ in kept], [w for _, w in kept])


def measure_propagation(
    proxy: ProxyHandle,
    writers: Writers,
    nodes: list[str],
    partitions: int,
    stop: threading.Event,
    result: Propagation,
) -> None:
    """Flip partition 0's active between lag 0 and PROBE_LAG; time each flip into routing
    (into `result`, until `stop`)."""
    placed = round_robin(partitions, nodes, 1)[PROBE_PARTITION]
    active, standby = placed.active, placed.standbys[0]
    path = f"/stores/{STORE}/keys/{probe_key(partitions)}"
    lag = 0
    with httpx.Client(timeout=5, trust_env=False) as client:
        while not stop.wait(PROBE_EVERY_S):
            lag = PROBE_LAG if lag == 0 else 0
            expected = standby if lag else active
            while not writers.written.empty():  # a flip that was missed: its late record
                writers.written.get_nowait()
            writers.probe_lag.value = lag
            try:
                value, written_at = writers.written.get(timeout=5)
            except Exception:  # noqa: BLE001 - queue.Empty: the writer fell behind
                result.missed += 1
                continue
            deadline = written_at + 5
            while time.time() < deadline:
                answer = client.get(proxy.url + path, headers={"x-kroute-max-lag": "10"})
                if answer.headers.get("x-kroute-node") == expected and value == lag:
                    result.delays_ms.append(round((time.time() - written_at) * 1000, 1))
                    result.written_at.append(written_at)
                    break
                time.sleep(0.005)
            else:
                result.missed += 1


def propagation_figures(propagation: Propagation) -> dict[str, Any]:
    delays = sorted(propagation.delays_ms)
    return {
        "samples": len(delays),
        "missed": propagation.missed,
        "p50": percentile(delays, 0.5),
        "p99": percentile(delays, 0.99),
        "max": delays[-1] if delays else None,
    }


def full_read(client: redis.Redis, keys: Keys) -> dict[str, float]:
    """What one refresh of the watcher before issue 22 read, and its decode + build cost."""
    started = time.perf_counter()
    node_ids = sorted(as_text(n) for n in client.smembers(keys.nodes))
    pipe = client.pipeline(transaction=False)
    for node_id in node_ids:
        pipe.get(keys.node(node_id))
        pipe.exists(keys.alive(node_id))
        pipe.get(keys.hosting(node_id))
        pipe.hgetall(keys.lag(node_id))
    results = pipe.execute()
    raw_assignment, raw_store = client.get(keys.assignment), client.get(keys.store(STORE))
    read_s = time.perf_counter() - started
    started = time.perf_counter()
    nodes, hostings, reports = {}, {}, {}
    size = len(raw_assignment or b"") + len(raw_store or b"")
    for index, node_id in enumerate(node_ids):
        raw_node, _alive, raw_hosting, raw_lag = results[index * 4 : index * 4 + 4]
        size += len(raw_node or b"") + len(raw_hosting or b"")
        nodes[node_id] = decode_node(raw_node)
        hostings[node_id] = decode_hosting(raw_hosting)
        for name, value in raw_lag.items():
            size += len(name) + len(value)
            store, _, partition = as_text(name).rpartition("/")
            reports[(node_id, store, int(partition))] = decode_report(value)
    build_snapshot(
        stores={STORE: decode_store(raw_store or b"")},
        assignment=decode_assignment(raw_assignment or b""),
        hostings=hostings,
        reports=reports,
        nodes=nodes,
        alive=frozenset(node_ids),
        built_at_ms=0,
    )
    return {
        "bytes": size,
        "commands": 4 + 4 * len(node_ids),
        "read_ms": round(read_s * 1000, 1),
        "decode_and_build_ms": round((time.perf_counter() - started) * 1000, 1),
    }


# -- one size ------------------------------------------------------------------------------------


def measure_size(
    services: EmbeddedServices,
    redis_url: str,
    redis_port: int,
    backends: list[str],
    size: tuple[int, int],
    args: argparse.Namespace,
) -> dict[str, Any]:
    nodes_n, partitions = size
    cluster = f"cp-{nodes_n}-{partitions}"
    client = redis.Redis.from_url(redis_url, client_name="bench-main")
    say(f"{nodes_n} nodes / {partitions} partitions: starting {args.writers} writers")
    writers = start_writers(
        redis_url, cluster, size, args.standbys, args.writers, backends, args.ages_move
    )
    try:
        time.sleep(2)
        baseline_read = full_read(client, Keys(cluster))
        before = redis_totals(client)
        time.sleep(args.quiet_seconds)
        after = redis_totals(client)
        writers_only = {k: (after[k] - before[k]) / args.quiet_seconds for k in after}
        proxy = start_bench_proxy(services, redis_url, cluster, args)
        try:
            # Propagation is probed through both windows (flat out, then the same load), for
            # a flip every 1.5 s: more samples than one window gives.
            stop = threading.Event()
            propagation = Propagation()
            nodes = [f"node-{i:04d}" for i in range(size[0])]
            prober = threading.Thread(
                target=measure_propagation,
                args=(proxy, writers, nodes, size[1], stop, propagation),
                daemon=True,
            )
            prober.start()
            try:
                figures = measure_window(proxy, client, redis_port, args)
                steady_from = time.time()
                figures["steady"] = measure_steady(proxy, args)
            finally:
                stop.set()
                prober.join(15)
            figures["steady"]["direct"] = measure_direct(backends[0], args)
            figures["propagation_ms"] = propagation_figures(propagation)
            # Under the same moderate load alone (wrk's window drives the proxy flat out).
            figures["steady"]["propagation_ms"] = propagation_figures(
                propagation.since(steady_from)
            )
        finally:
            proxy.process.stop()
            proxy.close()
        figures["steady"]["small_table"] = measure_small_table(services, redis_url, backends, args)
    finally:
        writers.close()
        client.close()
    figures["full_reread"] = baseline_read
    figures["load_average_1m"] = round(os.getloadavg()[0], 1)  # other work on the machine
    figures["redis_writers_only"] = {
        "cpu_percent": round(writers_only["cpu_s"] * 100, 1),
        "commands_per_s": round(writers_only["commands"]),
    }
    figures["redis_cpu_percent_for_the_proxy"] = max(
        0.0,
        round(figures["redis"]["cpu_percent"] - figures["redis_writers_only"]["cpu_percent"], 1),
    )  # the difference of two noisy figures: 0 means below what this can tell
    per_proxy = figures["proxy_redis"]["received_bytes_per_s"]
    figures["full_reread_bytes_per_s"] = baseline_read["bytes"]  # at least once a second
    figures["traffic_below_full_reread_x"] = (
        round(baseline_read["bytes"] / per_proxy, 1) if per_proxy else None
    )
    return figures


def start_bench_proxy(
    services: EmbeddedServices, redis_url: str, cluster: str, args: argparse.Namespace
) -> ProxyHandle:
    """A proxy of `cluster` (see `debug_proxy`), after its warm-up."""
    proxy = debug_proxy(services, redis_url, cluster, args.request_path_cpus)
    time.sleep(args.warmup_seconds)
    return proxy


def debug_proxy(
    services: EmbeddedServices,
    redis_url: str,
    cluster: str,
    cpus: str | None,
    name: str = "proxy",
    **settings: str,
) -> ProxyHandle:
    """A proxy of `cluster` with debug logs (its watcher's stats lines, every 2 s); more
    KROUTE_* `settings` as start_proxy takes them."""
    return start_proxy(
        services, redis_url, name=f"{name}-{cluster}", cluster=cluster, max_lag="1000",
        max_lag_ms="60000", log_level="debug", timeout_s=120, cpus=cpus, **settings,
    )  # fmt: skip


def measure_small_table(
    services: EmbeddedServices, redis_url: str, backends: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    """The same paced load through a proxy of a SMALL_TABLE cluster (its own writers), while
    this size's writers and Redis keep the machine as busy as before: this size's p99 beside
    this one is what its table costs the request path, apart from what the rest of the machine
    does to every latency here (the two cores are shared; the p99 straight to a backend grows
    with the size too). The size's own proxy is stopped first: its watcher would run beside."""
    nodes_n, partitions = SMALL_TABLE
    cluster = f"cp-small-{nodes_n}-{partitions}"
    writers = start_writers(redis_url, cluster, SMALL_TABLE, args.standbys, 1, backends)
    try:
        time.sleep(2)
        proxy = start_bench_proxy(services, redis_url, cluster, args)
        try:
            figures = measure_steady(proxy, args)
        finally:
            proxy.process.stop()
            proxy.close()
    finally:
        writers.close()
    return {"size": f"{nodes_n}/{partitions}", **figures}


def measure_window(
    proxy: ProxyHandle,
    client: redis.Redis,
    redis_port: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    pid = proxy.process.pid
    started = time.time()
    cpu_before, redis_before = cpu_seconds(pid), redis_totals(client)
    bytes_before = proxy_socket_bytes(pid, redis_port)
    hot_before = hot_path_requests(proxy)
    load = run_wrk(proxy.url, args.seconds, args.connections, args.request_path_cpus)
    hot = hot_path_requests(proxy) - hot_before
    elapsed = time.time() - started
    cpu_used = cpu_seconds(pid) - cpu_before
    redis_after = redis_totals(client)
    received, sent = (
        b - a for a, b in zip(bytes_before, proxy_socket_bytes(pid, redis_port), strict=True)
    )
    time.sleep(2.5)  # the watcher's last line for the window
    lines = watcher_lines(proxy.process.log_path, started, time.time())
    first, last = (lines[0], lines[-1]) if lines else ({}, {})

    def delta(name: str) -> float:
        return float(last.get(name, 0)) - float(first.get(name, 0))

    span = max(len(lines) - 1, 1) * 2.0
    return {
        "load": load,
        "c_path_share": round(hot / load["requests"], 3) if load.get("requests") else None,
        "choices_forgotten_per_s": round(delta("changed_partitions") / span),
        "choices_kept_per_s": round(delta("renewed_partitions") / span),
        # Confirmations that moved a node's report clock in place: nothing renewed for them.
        "clocks_moved_in_place_per_s": round(delta("clocks_moved_in_place") / span),
        "loop_stall_max_ms": round(max((line["max_loop_lag_ms"] for line in lines), default=0), 2),
        "loop_stall_busy_max_ms": max_of(lines, "max_loop_lag_busy_ms"),
        "table_hold_max_ms": round(max((line["max_hold_ms"] for line in lines), default=0), 2),
        "snapshot_swap_max_ms": round(max((line["max_swap_ms"] for line in lines), default=0), 2),
        "proxy_cpu_percent": round(cpu_used / elapsed * 100, 1),
        "proxy_table_cpu_percent": round(delta("hold_s") / span * 100, 2),
        "proxy_redis": {
            "received_bytes_per_s": round(received / elapsed),
            "sent_bytes_per_s": round(sent / elapsed),
            "commands_per_s": round(delta("commands") / span, 1),
            "node_reads_per_s": round(delta("node_reads") / span, 1),
        },
        "redis": {
            "cpu_percent": round((redis_after["cpu_s"] - redis_before["cpu_s"]) / elapsed * 100, 1),
            "commands_per_s": round((redis_after["commands"] - redis_before["commands"]) / elapsed),
        },
    }


def measure_steady(proxy: ProxyHandle, args: argparse.Namespace) -> dict[str, Any]:
    """The same offered load at every size (`--steady-rate` requests/s, paced, latency timed
    from when each request was due): what "p99 under the same load" and "no stall" mean. wrk's
    window drives the proxy flat out, where a size's p99 mostly says how much CPU the simulated
    nodes' writers (on the same two cores) left it. The load runs in its own process."""
    pid = proxy.process.pid
    started = time.time()
    cpu_before = cpu_seconds(pid)
    load = steady_load_in_child(proxy.url, args)
    elapsed = time.time() - started
    cpu_used = cpu_seconds(pid) - cpu_before
    time.sleep(2.5)  # the watcher's last line for the window
    lines = watcher_lines(proxy.process.log_path, started + STATS_LINE_S, time.time())
    return {
        **load,
        "loop_stall_max_ms": max_of(lines, "max_loop_lag_ms"),
        # Of the longest stalls, at most this much was the proxy's own CPU time.
        "loop_stall_busy_max_ms": max_of(lines, "max_loop_lag_busy_ms"),
        "table_hold_max_ms": max_of(lines, "max_hold_ms"),
        "collector_pause_max_ms": max_of(lines, "max_gc_ms"),
        "proxy_cpu_percent": round(cpu_used / elapsed * 100, 1),
    }


def measure_direct(backend: str, args: argparse.Namespace) -> dict[str, Any]:
    """The same paced load straight to one backend, the simulated nodes' writers still
    running: what this machine's load alone does to the latencies at this size. The proxy's
    own share is the difference (its p99 beside this one)."""
    return steady_load_in_child(backend, args)


def steady_load_in_child(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """`steady_load` run in a process of its own (spawned: no state of this one)."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(
            steady_load,
            (url, args.steady_rate, args.seconds, args.steady_connections, args.request_path_cpus),
        )


def steady_load(
    url: str,
    rate: int,
    seconds: float,
    connections: int,
    cpus: str | None,
    keep_latencies: bool = False,
) -> dict[str, Any]:
    """Keyed GETs over every partition at `rate`/s for `seconds` (run in a child process);
    with `keep_latencies`, every answered request's latency too (ms, under "latencies_ms")."""
    if cpus:
        os.sched_setaffinity(0, cpu_list(cpus))
    host_port = url.removeprefix("http://").rstrip("/")
    host, _, port = host_port.rpartition(":")
    rng = random.Random(22)
    paths = [f"/stores/{STORE}/keys/customer-{rng.randrange(KEYS)}" for _ in range(5_000)]
    load = SteadyLoad(
        host, int(port), cycle_requests(paths), rate=rate, connections=connections, timeout_s=10
    ).start()
    time.sleep(seconds)
    outcomes = load.stop()
    latencies = [o.latency_ms for o in outcomes if o.status == 200]
    figures = {
        "rate": rate,
        "requests": len(outcomes),
        **latency_figures(latencies),
        "failed": failures_by_status(outcomes),
    }
    return {**figures, "latencies_ms": latencies} if keep_latencies else figures


def _direct_cell(direct: dict[str, Any] | None) -> str:
    return "" if direct is None else f"{direct['p50_ms']} / {direct['p99_ms']}"


def _small_table_cell(steady: dict[str, Any]) -> str:
    small = steady.get("small_table")
    if small is None or not small.get("p99_ms") or steady.get("p99_ms") is None:
        return ""
    ratio = steady["p99_ms"] / small["p99_ms"]
    return f"{small['p50_ms']} / {small['p99_ms']} ({ratio:.2f}x)"


def _propagation_cell(prop: dict[str, Any] | None) -> str:
    return "" if prop is None else f"{prop['p50']} / {prop['p99']} ({prop['samples']})"


def max_of(lines: list[dict[str, Any]], name: str) -> float:
    return round(max((float(line.get(name, 0)) for line in lines), default=0.0), 2)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, int(q * len(values)))]


def say(message: str) -> None:
    print(f"[control-plane] {message}", file=sys.stderr, flush=True)


# -- report --------------------------------------------------------------------------------------


def markdown(data: dict[str, Any]) -> str:
    rows = []
    for name, f in data["sizes"].items():
        load, prop, traffic = f["load"], f["propagation_ms"], f["proxy_redis"]
        rows.append(
            f"| {name} | {load['rps']:,} | {load['p50_ms']} | {load['p99_ms']} | {load['max_ms']} "
            f"| {load['non_2xx']:,} | {f.get('c_path_share')} | {f.get('choices_forgotten_per_s'):,} "
            f"| {f.get('choices_kept_per_s'):,} | {f['loop_stall_max_ms']} | {f['table_hold_max_ms']} | {f['proxy_cpu_percent']} "
            f"| {f['proxy_table_cpu_percent']} | {traffic['commands_per_s']:,} "
            f"| {traffic['received_bytes_per_s']:,} | {f['full_reread']['bytes']:,} "
            f"| {f['redis']['cpu_percent']} ({f['redis_cpu_percent_for_the_proxy']}) "
            f"| {prop['p50']} / {prop['p99']} ({prop['samples']}) "
            f"| {f['full_reread']['decode_and_build_ms']} |"
        )
    return "\n".join(
        [
            "## Control plane at scale (issue 22)"
            + (
                ", replicas' ages moving (a writer stamping reports with their own time)"
                if data.get("ages_move")
                else ""
            ),
            "",
            f"`{data['command']}` at {data['revision']}{'+changes' if data.get('dirty') else ''}; "
            f"{data['machine']}; the machine's "
            "1-minute load average after each size: "
            + ", ".join(f"{f['load_average_1m']}" for f in data["sizes"].values())
            + " (above the core count, every figure here is stretched by other work). "
            + placement_sentence(data),
            "",
            "| nodes/partitions | req/s | p50 ms | p99 ms | max ms | non-2xx | C path share "
            "| choices forgotten/s | choices kept/s | loop stall max ms "
            "| table hold max ms | proxy CPU % | table CPU % | proxy Redis cmd/s "
            "| proxy Redis B/s in | one full re-read B | Redis CPU % (proxy's) "
            "| propagation p50/p99 ms (samples) | old refresh on the loop ms |",
            "|---|" + "---:|" * 18,
            *rows,
            "",
            *steady_markdown(data),
            data["projection"],
        ]
    )


def placement_sentence(data: dict[str, Any]) -> str:
    cpus = data.get("request_path_cpus")
    if not cpus:
        return "Nothing was pinned: the proxy shared both cores with Redis and the writers."
    return (
        f"The request path (the proxy, the three nginx backends, wrk and the paced load) ran on "
        f"CPU {cpus} alone, Redis and the simulated nodes' writers on the other: the sizes then "
        "differ on the request path's core only by the proxy's table work, as a deployment "
        "gives the routing tier cores of its own."
    )


def steady_markdown(data: dict[str, Any]) -> list[str]:
    """The same-load window's table (absent from runs before it existed)."""
    steady = {name: f["steady"] for name, f in data["sizes"].items() if "steady" in f}
    if not steady:
        return []
    rate = next(iter(steady.values()))["rate"]
    rows = [
        f"| {name} | {f['p50_ms']} | {f['p99_ms']} | {f['max_ms']} | {f['requests']:,} "
        f"| {sum(f['failed'].values()):,} | {_direct_cell(f.get('direct'))} "
        f"| {f['loop_stall_max_ms']} "
        f"| {f['loop_stall_busy_max_ms']} | {f['table_hold_max_ms']} | {f['proxy_cpu_percent']} "
        f"| {_propagation_cell(f.get('propagation_ms'))} | {_small_table_cell(f)} |"
        for name, f in steady.items()
    ]
    return [
        f"The same load at every size: {rate:,} keyed GETs a second, paced, each timed from when "
        "it was due (so a stall shows in every request it delays), from a separate process; "
        'after the wrk window. "Straight to a backend" is the same load sent to one backend '
        "instead, with the simulated nodes' writers and the proxy's table work still running: "
        "what the rest of the machine does to latency at that size; the proxy's own share of "
        'the p99 is the difference. A stall\'s "proxy CPU at most" is the CPU time the proxy '
        "process used while its loop was late: the rest of the stall it was waiting for a core. "
        '"Small table, same background" is the same load through a proxy of a '
        f"{SMALL_TABLE[0]}/{SMALL_TABLE[1]} cluster (nodes/partitions), measured at each size "
        "after that size's proxy stopped, with that size's writers and Redis still running: "
        "the size's p99 over it (the ratio) is what the size's table costs the request path, "
        "apart from what the machine's other work does to every latency at that size.",
        "",
        "| nodes/partitions | p50 ms | p99 ms | max ms | requests | failed "
        "| straight to a backend p50 / p99 ms "
        "| loop stall max ms | of it proxy CPU at most ms | table hold max ms | proxy CPU % "
        "| propagation p50/p99 ms (samples) "
        "| small table, same background: p50 / p99 ms (p99 ratio) |",
        "|---|" + "---:|" * 12,
        *rows,
        "",
    ]


def projection(sizes: dict[str, Any]) -> str:
    """What 100 proxies would ask of Redis, from the largest size measured."""
    name, f = list(sizes.items())[-1]
    per_proxy_cpu = f["redis_cpu_percent_for_the_proxy"]
    writers_cpu = f["redis_writers_only"]["cpu_percent"]
    traffic = f["proxy_redis"]["received_bytes_per_s"]
    commands = f["proxy_redis"]["commands_per_s"]
    return (
        f"Projection for 100 proxies at {name}: each proxy's Redis load is what it reads "
        f"(the sweep and the head reads), independent of the others, so 100 proxies ask "
        f"about {commands * 100:,.0f} commands/s and {traffic * 100 / 1e6:,.1f} MB/s of "
        f"replies, and Redis CPU would be about {writers_cpu}% (the nodes' writes) + 100 x "
        f"{per_proxy_cpu}% (one proxy's reads) = {writers_cpu + 100 * per_proxy_cpu:,.0f}% of "
        "a core, measured on this machine. A single Redis core saturates near 100%: beyond "
        "that, read replicas (proxies can already read one) divide the proxies' share."
    )


def cpu_list(text: str) -> set[int]:
    return {int(cpu) for cpu in text.split(",")}


def keep_the_cluster_off(request_path_cpus: str) -> None:
    """This process, and so what it starts unless told otherwise (Redis, the writers), off
    the request path's CPUs. The proxy, the backends and the load are placed on them: a
    deployment gives the routing tier, and its clients, cores apart from the nodes and Redis.
    Then the sizes differ on the request path's cores only by the proxy's table work."""
    mine = cpu_list(request_path_cpus)
    rest = os.sched_getaffinity(0) - mine
    if not rest or not mine <= os.sched_getaffinity(0):
        raise SystemExit(
            f"--request-path-cpus {request_path_cpus}: needs CPUs of this machine and one left over"
        )
    os.sched_setaffinity(0, rest)


def start_backends(
    services: EmbeddedServices, workdir: Path, request_path_cpus: str | None
) -> list[str]:
    """Three nginx servers answering BODY to everything (one process, pinned to the request
    path's CPUs when given): the URLs of the simulated nodes."""
    ports = [free_port() for _ in range(3)]
    servers = "\n".join(
        f"server {{ listen 127.0.0.1:{port}; location / {{ default_type application/json; "
        f"return 200 '{BODY}'; }} }}"
        for port in ports
    )
    nginx_dir = workdir / "backends"  # its temp folders (one is named proxy) kept apart
    nginx_dir.mkdir()
    (nginx_dir / "nginx.conf").write_text(_nginx_conf(nginx_dir, servers))
    nginx = services.start_process(
        "backends", ["nginx", "-p", str(nginx_dir), "-c", str(nginx_dir / "nginx.conf")]
    )
    services.await_ready(nginx, lambda: port_open(ports[0], 0.2), 10)
    if request_path_cpus:
        pin_tree(nginx.pid, cpu_list(request_path_cpus))
    return [f"http://127.0.0.1:{port}" for port in ports]


def add_request_path_cpus(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--request-path-cpus",
        help="CPUs the proxy, the backends and the load run on (a taskset -c list); Redis and "
        "the simulated nodes' writers run on the others (default: nothing pinned)",
    )


@contextmanager
def cluster_services(
    prefix: str, request_path_cpus: str | None
) -> Iterator[tuple[EmbeddedServices, RedisHandle, list[str]]]:
    """Redis and the backends of a run, in a work folder kept only when the run fails (for
    its logs); with `request_path_cpus`, this process and what it starts (Redis, the writers)
    off those CPUs, and the backends on them."""
    if request_path_cpus:
        keep_the_cluster_off(request_path_cpus)
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    with EmbeddedServices(workdir) as services:
        redis_server = services.start_redis()
        yield services, redis_server, start_backends(services, workdir, request_path_cpus)
    shutil.rmtree(workdir, ignore_errors=True)


def parse_sizes(text: str) -> list[tuple[int, int]]:
    sizes = []
    for item in text.split(","):
        nodes, _, partitions = item.partition("/")
        sizes.append((int(nodes), int(partitions)))
    return sizes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes(DEFAULT_SIZES))
    parser.add_argument("--seconds", type=int, default=30, help="load per size")
    parser.add_argument("--warmup-seconds", type=float, default=5)
    parser.add_argument("--quiet-seconds", type=float, default=3, help="writers alone")
    parser.add_argument("--connections", type=int, default=50)
    parser.add_argument(
        "--steady-rate", type=int, default=2_000, help="requests/s of the same-load window"
    )
    parser.add_argument("--steady-connections", type=int, default=16)
    parser.add_argument("--standbys", type=int, default=1, choices=(1, 2))
    parser.add_argument("--writers", type=int, default=2, help="writer processes")
    parser.add_argument(
        "--ages-move",
        action="store_true",
        help="replicas' caught-up ages move between reports, as they do for a writer that "
        "stamps each report with its own time instead of its end-offset read's",
    )
    add_request_path_cpus(parser)
    args = parser.parse_args()
    sizes: dict[str, Any] = {}
    with cluster_services("kroute-control-plane-", args.request_path_cpus) as (
        services,
        redis_server,
        backends,
    ):
        for size in args.sizes:
            name = f"{size[0]}/{size[1]}"
            sizes[name] = measure_size(
                services, redis_server.url, redis_server.port, backends, size, args
            )
            say(f"{name}: {json.dumps(sizes[name])}")
    command = "python -m benchmarks.control_plane_bench " + " ".join(sys.argv[1:])
    data = {
        "command": command.strip(),
        "revision": git_revision(),
        "machine": machine_notes(),
        "standbys": args.standbys,
        "request_path_cpus": args.request_path_cpus,
        "ages_move": args.ages_move,
        "sizes": sizes,
        "projection": projection(sizes),
    }
    # Moving ages are a second scenario beside the steady one: kept in their own results.
    name = "control_plane_ages_move" if args.ages_move else "control_plane"
    write_json(name, data)
    write_section(name, markdown(data))
    print(markdown(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
