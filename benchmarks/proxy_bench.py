"""The proxy against HAProxy and nginx, in one run, in front of the same trivial backends, for
small, 16 KiB and 1 MiB answers.

Three backends (one nginx process, `master_process off`, one worker, on three ports) stand for
three nodes. Each answers by path: /stores/bench16k/keys/<any key> and /stores/bench1m/keys/<any
key> are a static file of exactly 16,384 and 1,048,576 bytes (sendfile, Content-Length,
keep-alive); any other path is a fixed 52-byte JSON (the "small" answer). wrk (1 thread, random
keys out of 100,000 under the size's store, --timeout 10 s) drives in turn:

  direct   wrk straight to one backend (the floor: no proxy at all)
  haproxy  HAProxy, one thread, round robin, keep-alive to the backends (http-reuse always)
  nginx    nginx, one worker, round robin, upstream keepalive (default proxy buffering)
  kroute   the kroute proxy: key -> murmur2 partition -> replica choice under a lag budget
           -> forward over its pool, with metrics, provenance headers and limits all on
  kroute-python  the same proxy with KROUTE_HOT_PATH=false: every request through the Python
           path (what the C path in proxy/_hotpath.c saves)
  haproxy-2t  HAProxy with two threads (nbthread 2)
  nginx-2w    nginx with two worker processes (listen ... reuseport)
  kroute-2w   kroute with two workers (KROUTE_WORKERS=2: two processes on the port with
           SO_REUSEPORT under one parent, whose admin port sums their metrics)
"kroute" is one worker (KROUTE_WORKERS=1). Issue #20's goal: kroute-2w reaches at least 1.7x
kroute's throughput and at least haproxy-2t's, for small answers.

Two workers need two cores of their own, and a load generator and backends that are not the
bottleneck: on a machine with 4 or more cores give the proxies two cores (--proxy-cpus 0,1:
every proxy is started under taskset on them, one-worker ones included) and wrk and the
backends the rest (--load-cpus 2-7; the backends' nginx gets --backend-workers processes). CPU
is counted over each proxy's whole process tree (kroute-2w: the parent and both workers; nginx:
master and workers). Without --proxy-cpus nothing is pinned (fine for smoke runs, but on a small
machine the two-worker rows then compete with wrk and the backends for the same cores).

The backends are registered in Redis as a static cluster with three stores, bench, bench16k and
bench1m (12 partitions, one standby each, the same three nodes), with lag reports refreshed every
second so the lag budget is really checked; kroute routes each key to its partition's node,
HAProxy and nginx round-robin any path. Before measuring, one GET per system and size checks the
answer is a 200 of exactly the size. Systems are measured in rounds, interleaved (every size and
system in each round), so drift on this noisy 2-core machine hits all of them alike.

Per system and size: requests/s, wrk's transfer rate, p50/p99, wrk's non-2xx and socket errors
(timeouts included; any of them makes the run invalid and is printed as a warning), CPU per
request and per MiB of answer bodies (the proxy process's user+system time from /proc over the
requests wrk counted; MiB = 2xx requests x body size), and resident memory (VmRSS, read after
each round, so growth across rounds would show a leak); medians across rounds. kroute's own
counters (keyed 200s, C-path requests, streamed answers, upstream failures) are read around each
of its runs. The share spent computing partitions is the in-process cost of
KeyPartitioner.partition_of over the same key distribution, divided by kroute's CPU/request for
small answers.

Writes benchmarks/results/proxy.json (top-level `systems`/`ratios` are the small answers' figures
as before, `by_size` has every size) and the "proxy" section of benchmarks/RESULTS.md: a table per
size and issue #17's goals judged from the numbers: small answers' kroute/HAProxy throughput no
more than 5% below the previous run's (read from proxy.json before it is overwritten; once
recorded as `previous_small_kroute_vs_haproxy_rps` that baseline is carried forward, so reruns
compare with the figure from before issue #17, not with each other), and for 16 KiB and 1 MiB
answers kroute at >= 0.8x HAProxy's throughput with a p99 no worse than HAProxy's.

Usage: .venv/bin/python -m benchmarks.proxy_bench [--seconds 8] [--rounds 3] [--connections 50]
       [--sizes small,16k,1m] [--proxy-cpus 0,1 --load-cpus 2-7] [--backend-workers 2]
Needs wrk, haproxy and nginx (apt-get install wrk haproxy nginx-light).
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import shutil
import statistics
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import redis

from benchmarks.results_file import (
    RESULTS_JSON_DIR,
    git_revision,
    machine_notes,
    write_json,
    write_section,
)
from benchmarks.wrk import run_wrk
from common.contract import Keys, StoreInfo
from kroute.embedded import EmbeddedServices, ManagedProcess, free_port, port_open
from kroute.proxies import start_proxy
from kroute.static_cluster import StaticCluster
from partitioner import KeyPartitioner
from proxy.routing import PARTITION_CACHE

PARTITIONS = 12
KEYS = 100_000
PATH_PREFIX = "/stores/bench/keys/customer-"
TICKS = os.sysconf("SC_CLK_TCK")
BODY = '{"store":"bench","value":{"plan":"gold","visits":7}}'
MIB = 1 << 20
WRK_TIMEOUT_S = 10  # wrk's default of 2 s is tight for 1 MiB answers on 50 connections
# size name -> (store, answer body bytes); "small" is the fixed JSON every other path gets
SIZES: dict[str, tuple[str, int]] = {
    "small": ("bench", len(BODY.encode())),
    "16k": ("bench16k", 16_384),
    "1m": ("bench1m", 1_048_576),
}
SIZE_TITLES = {"small": f"small answers ({len(BODY.encode())} B JSON)", "16k": "16 KiB answers",
               "1m": "1 MiB answers"}  # fmt: skip
GOAL_RPS, GOAL_P99, GOAL_SMALL_DROP = 0.8, 1.0, 0.05
GOAL_WORKERS_SCALING, GOAL_WORKERS_VS_HAPROXY = 1.7, 1.0  # issue #20, small answers
KROUTE_COUNTERS = {  # name in the JSON -> metric line prefix (summed over labels)
    "keyed_200s": 'kroute_proxy_responses_total{kind="keyed",status="200"}',
    "hot_path": "kroute_proxy_hot_path_requests_total",
    "streamed": "kroute_proxy_streamed_answers_total",
    "cut_short": "kroute_proxy_answers_cut_short_total",
    "upstream_failures": "kroute_proxy_upstream_failures_total",
}


def path_prefix(size: str) -> str:
    return f"/stores/{SIZES[size][0]}/keys/customer-"


def process_tree(pid: int) -> list[int]:
    """The process and its live descendants (a proxy's workers, nginx's master and workers)."""
    found, pending = [], [pid]
    while pending:
        current = pending.pop()
        found.append(current)
        try:
            tasks = list(Path(f"/proc/{current}/task").iterdir())
        except FileNotFoundError:
            continue
        for task in tasks:
            try:
                pending += [int(child) for child in (task / "children").read_text().split()]
            except FileNotFoundError:
                continue
    return found


def rss_mb(pid: int) -> float:
    """Resident memory of the whole process tree."""
    total_kb = 0
    for member in process_tree(pid):
        for line in _read(f"/proc/{member}/status").splitlines():
            if line.startswith("VmRSS:"):
                total_kb += int(line.split()[1])
    return round(total_kb / 1024, 1)


def cpu_seconds(pid: int) -> float:
    """User+system time of the whole process tree (every thread of every process in it)."""
    total = 0
    for member in process_tree(pid):
        stat = _read(f"/proc/{member}/stat")
        if stat:
            fields = stat.rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / TICKS


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except (FileNotFoundError, ProcessLookupError):
        return ""  # the process exited meanwhile


def write_bodies(directory: Path) -> None:
    """One file per large size, of exactly its number of bytes."""
    directory.mkdir(parents=True, exist_ok=True)
    for size, (_, length) in SIZES.items():
        if size != "small":
            (directory / f"{size}.body").write_bytes((b"0123456789abcdef" * length)[:length])


def nginx_backends_conf(
    workdir: Path, ports: list[int], bodies: Path | None = None, workers: int = 1
) -> str:
    """Fixed small JSON on any path; with `bodies` (see write_bodies), /stores/<store>/keys/<any
    key> of the large sizes' stores is that size's file (static: Content-Length, sendfile)."""
    files = (
        "".join(
            f"location /stores/{store}/keys/ {{ root {bodies}; "
            f"default_type application/octet-stream; rewrite ^ /{size}.body break; }} "
            for size, (store, _) in SIZES.items()
            if size != "small"
        )
        if bodies
        else ""
    )
    servers = "\n".join(
        f"server {{ listen 127.0.0.1:{port}; sendfile on; tcp_nopush on; "
        f"location / {{ default_type application/json; return 200 '{BODY}'; }} {files}}}"
        for port in ports
    )
    return _nginx_conf(workdir, servers, workers)


def nginx_proxy_conf(workdir: Path, port: int, backends: list[int], workers: int = 1) -> str:
    """nginx as the proxy; with several workers each has its own listening socket
    (reuseport), as kroute's workers do."""
    upstream = "\n".join(f"  server 127.0.0.1:{p};" for p in backends)
    reuseport = " reuseport" if workers > 1 else ""
    return _nginx_conf(
        workdir,
        f"upstream nodes {{\n{upstream}\n  keepalive 64;\n}}\n"
        f"server {{ listen 127.0.0.1:{port}{reuseport}; location / {{ proxy_pass http://nodes; "
        'proxy_http_version 1.1; proxy_set_header Connection ""; } }',
        workers,
    )


def _nginx_conf(workdir: Path, servers: str, workers: int = 1) -> str:
    # One worker: no master process (the measured pid is the worker). More: a master and its
    # workers, measured as one process tree.
    # Run as root, a master hands its workers to "nobody", who may not read this run's files.
    user = f"user {pwd.getpwuid(os.geteuid()).pw_name};" if workers > 1 and not os.geteuid() else ""
    return f"""
daemon off;
master_process {"off" if workers == 1 else "on"};
worker_processes {workers};
{user}
pid {workdir}/nginx.pid;
error_log {workdir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  keepalive_requests 1000000;
  client_body_temp_path {workdir}/body;
  proxy_temp_path {workdir}/proxy;
  fastcgi_temp_path {workdir}/fastcgi;
  uwsgi_temp_path {workdir}/uwsgi;
  scgi_temp_path {workdir}/scgi;
{servers}
}}
"""


def haproxy_conf(port: int, backends: list[int], threads: int = 1) -> str:
    servers = "\n".join(f"  server n{i} 127.0.0.1:{p}" for i, p in enumerate(backends))
    return f"""
global
  nbthread {threads}
  maxconn 8000
defaults
  mode http
  timeout connect 1s
  timeout client 30s
  timeout server 30s
  option http-keep-alive
  http-reuse always
frontend bench
  bind 127.0.0.1:{port}
  default_backend nodes
backend nodes
  balance roundrobin
{servers}
"""


def pinned(command: list[str], cpus: str | None) -> list[str]:
    """The command run on those CPUs only (taskset), or as it is."""
    return ["taskset", "-c", cpus, *command] if cpus else command


def start_server(
    services: EmbeddedServices, name: str, command: list[str], port: int, cpus: str | None = None
) -> ManagedProcess:
    process = services.start_process(name, pinned(command, cpus))
    services.await_ready(process, lambda: port_open(port, 0.2), 10)
    return process


def warn(message: str) -> None:
    print(f"\n!!! WARNING: {message} !!!\n", file=sys.stderr, flush=True)


def check_answers(systems: dict[str, tuple[str, int | None]], sizes: list[str]) -> list[str]:
    """One GET per system and size: a 200 whose body and Content-Length are exactly the size."""
    problems = []
    with httpx.Client(timeout=10) as client:
        for size in sizes:
            expected = SIZES[size][1]
            for name, (url, _) in systems.items():
                try:
                    answer = client.get(f"{url}{path_prefix(size)}42")
                except httpx.HTTPError as error:
                    problems.append(f"{name} {size}: {error!r}")
                    continue
                length = answer.headers.get("content-length")
                if (
                    answer.status_code != 200
                    or len(answer.content) != expected
                    or (length != str(expected))
                ):
                    problems.append(
                        f"{name} {size}: status {answer.status_code}, {len(answer.content)} "
                        f"bytes, Content-Length {length} (expected 200, {expected} bytes)"
                    )
    for problem in problems:
        warn(f"wrong answer before measuring: {problem}")
    return problems


def measure(url: str, pid: int | None, seconds: int, connections: int, size: str) -> dict[str, Any]:
    before = cpu_seconds(pid) if pid else 0.0
    figures: dict[str, Any] = run_wrk(
        url,
        seconds,
        connections=connections,
        path_prefix=path_prefix(size),
        keys=KEYS,
        timeout_s=WRK_TIMEOUT_S,
    )
    used = cpu_seconds(pid) - before if pid else 0.0
    body_mib = (figures["requests"] - figures["non_2xx"]) * SIZES[size][1] / MIB
    figures["mib_per_s"] = round(figures["transfer_bytes_per_s"] / MIB, 2)  # wire, with heads
    if pid:
        figures["cpu_us_per_req"] = round(used * 1e6 / max(figures["requests"], 1), 2)
        figures["cpu_us_per_mib"] = round(used * 1e6 / max(body_mib, 1e-9), 1)
        figures["rss_mb"] = rss_mb(pid)
    return figures


def partition_step_ns(samples: int = 200_000) -> float:
    import random  # noqa: PLC0415

    partitioner = KeyPartitioner("string", "murmur2", PARTITIONS, cache_size=PARTITION_CACHE)
    keys = [f"customer-{random.randrange(KEYS)}" for _ in range(samples)]
    started = time.perf_counter_ns()
    for key in keys:
        partitioner.partition_of(key)
    return (time.perf_counter_ns() - started) / samples


def keep_reports_fresh(cluster: StaticCluster, client: redis.Redis, stop: threading.Event) -> None:
    while not stop.wait(1.0):
        cluster.publish(client)


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("rps", "mib_per_s", "p50_ms", "p99_ms", "cpu_us_per_req", "cpu_us_per_mib", "rss_mb")
    summary = {
        key: round(statistics.median(r[key] for r in rounds), 3) for key in keys if key in rounds[0]
    }
    summary["non_2xx"] = sum(r["non_2xx"] for r in rounds)
    summary["socket_errors"] = sum(r["socket_error_count"] for r in rounds)
    summary["timeouts"] = sum(r["timeouts"] for r in rounds)
    summary["rounds"] = rounds
    return summary


def size_ratios(summary: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    haproxy, kroute = summary["haproxy"], summary["kroute"]

    def ratio(a: float, b: float) -> float | None:
        return round(a / b, 3) if b else None

    return {
        "kroute_vs_haproxy_rps": ratio(kroute["rps"], haproxy["rps"]),
        "kroute_vs_nginx_rps": ratio(kroute["rps"], summary["nginx"]["rps"]),
        "kroute_vs_haproxy_p99": ratio(kroute["p99_ms"], haproxy["p99_ms"]),
        "kroute_vs_haproxy_cpu": ratio(kroute["cpu_us_per_req"], haproxy["cpu_us_per_req"]),
        "kroute_vs_python_path_rps": ratio(kroute["rps"], summary["kroute-python"]["rps"]),
        **workers_ratios(summary),
    }


def workers_ratios(summary: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Issue #20's comparisons: kroute with two workers against one, and against HAProxy with
    two threads and nginx with two workers."""
    two = summary["kroute-2w"]

    def ratio(other: str, key: str) -> float | None:
        base = summary[other][key]
        return round(two[key] / base, 3) if base else None

    return {
        "kroute_2w_vs_1w_rps": ratio("kroute", "rps"),
        "kroute_2w_vs_haproxy_2t_rps": ratio("haproxy-2t", "rps"),
        "kroute_2w_vs_nginx_2w_rps": ratio("nginx-2w", "rps"),
        "kroute_2w_vs_haproxy_2t_p99": ratio("haproxy-2t", "p99_ms"),
        "kroute_2w_vs_haproxy_2t_cpu": ratio("haproxy-2t", "cpu_us_per_req"),
    }


def judge_workers_goal(by_size: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Issue #20: for small answers, kroute-2w >= 1.7x kroute (one worker) and >= haproxy-2t."""
    if "small" not in by_size:
        return {"status": "not measured", "why": "small answers not run"}
    systems, ratios = by_size["small"]["systems"], by_size["small"]["ratios"]
    scaling, versus = ratios["kroute_2w_vs_1w_rps"], ratios["kroute_2w_vs_haproxy_2t_rps"]
    goal: dict[str, Any] = {"kroute_2w_vs_1w_rps": scaling, "kroute_2w_vs_haproxy_2t_rps": versus}
    met = (
        scaling is not None
        and versus is not None
        and scaling >= GOAL_WORKERS_SCALING
        and versus >= GOAL_WORKERS_VS_HAPROXY
    )
    goal["status"] = "met" if met else "not met"
    errors = [
        name
        for name in ("kroute", "kroute-2w", "haproxy-2t")
        if systems[name]["non_2xx"] or systems[name]["socket_errors"]
    ]
    if errors:
        goal.update(status="not judged", why="run invalid: errors from " + ", ".join(errors))
    return goal


def c_path_share_percent(counts: dict[str, float]) -> float:
    """The share of keyed 200s the C path served, as the report quotes it (in the JSON too)."""
    return round(counts.get("hot_path", 0) / max(counts.get("keyed_200s", 0), 1) * 100, 1)


def kroute_counters(proxy: Any) -> dict[str, float]:
    text = proxy.admin("/metrics").text
    return {name: metric_sum(text, prefix) for name, prefix in KROUTE_COUNTERS.items()}


def previous_baseline() -> dict[str, Any]:
    """The small answers' kroute/HAProxy throughput ratio the goal compares with: from the
    results file about to be overwritten (its carried-forward baseline if it has one)."""
    try:
        old = json.loads((RESULTS_JSON_DIR / "proxy.json").read_text())
    except (OSError, ValueError):
        return {"rps_ratio": None, "revision": None, "command": None}
    if old.get("previous_small_kroute_vs_haproxy_rps") is not None:
        return {
            "rps_ratio": old["previous_small_kroute_vs_haproxy_rps"],
            "revision": old.get("previous_small_revision"),
            "command": old.get("previous_small_command"),
        }
    return {
        "rps_ratio": old.get("ratios", {}).get("kroute_vs_haproxy_rps"),
        "revision": old.get("revision"),
        "command": old.get("command"),
    }


def parse_sizes(text: str) -> list[str]:
    sizes = list(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [size for size in sizes if size not in SIZES]
    if unknown or not sizes:
        raise argparse.ArgumentTypeError(
            f"sizes are a comma-separated subset of {','.join(SIZES)}, not {text!r}"
        )
    return [size for size in SIZES if size in sizes]  # always measured in the same order


def run_rounds(
    systems: dict[str, tuple[str, int | None]], kroute: Any, args: argparse.Namespace
) -> tuple[dict[str, dict[str, list[dict[str, Any]]]], dict[str, dict[str, float]]]:
    """A warm-up, then every size and system in each round: wrk's figures by size and system,
    and kroute's counters summed over its measured runs by size."""
    results: dict[str, dict[str, list[dict[str, Any]]]] = {size: {} for size in args.sizes}
    counters: dict[str, dict[str, float]] = {size: {} for size in args.sizes}
    for size in args.sizes:  # warm up connections and caches
        for url, _ in systems.values():
            run_wrk(
                url,
                1,
                connections=args.connections,
                path_prefix=path_prefix(size),
                keys=KEYS,
                timeout_s=WRK_TIMEOUT_S,
            )
    for round_number in range(args.rounds):
        for size in args.sizes:
            for name, (url, pid) in systems.items():
                before = kroute_counters(kroute) if name == "kroute" else {}
                figures = measure(url, pid, args.seconds, args.connections, size)
                if before:
                    for key, value in kroute_counters(kroute).items():
                        counters[size][key] = counters[size].get(key, 0) + value - before[key]
                results[size].setdefault(name, []).append(figures)
                shown = {k: v for k, v in figures.items() if k != "socket_errors"}
                print(f"round {round_number + 1} {size:5s} {name:13s} {shown}", flush=True)
                if figures["non_2xx"] or figures["socket_error_count"]:
                    warn(
                        f"{name} at {size}: {figures['non_2xx']} non-2xx answers, socket "
                        f"errors: {figures['socket_errors']} — this run is not valid"
                    )
    return results, counters


def _remove_unless_failed(
    workdir: Path, results: dict[str, dict[str, list[dict[str, Any]]]]
) -> None:
    """Keep the proxies' logs when any request failed: they say what those requests were."""
    failed = any(
        r["non_2xx"] or r.get("socket_error_count")
        for by_system in results.values()
        for rounds in by_system.values()
        for r in rounds
    )
    if failed:
        print(f"logs kept in {workdir} (the run had failed requests)", flush=True)
    else:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=int, default=8, choices=range(1, 61), metavar="1-60")
    parser.add_argument("--rounds", type=int, default=3, choices=range(1, 11), metavar="1-10")
    parser.add_argument("--connections", type=int, default=50)
    parser.add_argument(
        "--sizes",
        type=parse_sizes,
        default="small,16k,1m",
        metavar=",".join(SIZES),
        help=f"answer sizes to measure, comma-separated, out of {','.join(SIZES)} (default all)",
    )
    parser.add_argument(
        "--proxy-cpus",
        type=parse_cpus,
        default=None,
        metavar="0,1",
        help="CPUs every proxy runs on (taskset -c list; default: not pinned)",
    )
    parser.add_argument(
        "--load-cpus",
        type=parse_cpus,
        default=None,
        metavar="2-7",
        help="CPUs wrk and the backends run on (default: not pinned)",
    )
    parser.add_argument(
        "--backend-workers",
        type=int,
        default=1,
        choices=range(1, 65),
        metavar="1-64",
        help="nginx worker processes serving the three backends (default 1)",
    )
    args = parser.parse_args()
    if args.load_cpus:  # wrk is our child: it inherits this
        os.sched_setaffinity(0, cpu_set(args.load_cpus))
    for tool in ("wrk", "haproxy", "nginx"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            parser.error(f"{tool} is not installed: apt-get install wrk haproxy nginx-light")
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    haproxy = shutil.which("haproxy") or "/usr/sbin/haproxy"
    baseline = previous_baseline()  # before write_json replaces the file

    workdir = Path(tempfile.mkdtemp(prefix="kroute-proxy-bench-"))
    with EmbeddedServices(workdir) as services:
        redis_server = services.start_redis()
        backend_ports = [free_port() for _ in range(3)]
        backends_dir = workdir / "backends"
        write_bodies(backends_dir / "bodies")
        (backends_dir / "nginx.conf").write_text(
            nginx_backends_conf(
                backends_dir, backend_ports, backends_dir / "bodies", args.backend_workers
            )
        )
        start_server(
            services,
            "backends",
            [nginx, "-p", str(backends_dir), "-c", str(backends_dir / "nginx.conf")],
            backend_ports[0],
            args.load_cpus,
        )
        haproxies = {
            name: start_haproxy(services, haproxy, workdir, name, backend_ports, threads, args)
            for name, threads in (("haproxy", 1), ("haproxy-2t", 2))
        }
        nginxes = {
            name: start_nginx_proxy(services, nginx, workdir, name, backend_ports, workers, args)
            for name, workers in (("nginx", 1), ("nginx-2w", 2))
        }

        client = redis.Redis.from_url(redis_server.url)
        cluster = StaticCluster(
            Keys("bench"),
            {f"node-{i}": f"http://127.0.0.1:{p}" for i, p in enumerate(backend_ports)},
        )
        for store, _ in SIZES.values():
            cluster.add_store(StoreInfo(store, store, PARTITIONS))
        cluster.publish(client)
        stop = threading.Event()
        refresher = threading.Thread(
            target=keep_reports_fresh, args=(cluster, client, stop), daemon=True
        )
        refresher.start()
        kroute, kroute_python, kroute_2w = (
            start_proxy(
                services,
                redis_server.url,
                name=name,
                cluster="bench",
                max_lag="1000",
                max_lag_ms="60000",
                log_level="warning",
                hot_path=hot_path,
                workers=workers,
                cpus=args.proxy_cpus,
            )
            for name, hot_path, workers in (
                ("kroute", "true", 1),
                ("kroute-python", "false", 1),
                ("kroute-2w", "true", 2),
            )
        )

        systems = {
            "direct": (f"http://127.0.0.1:{backend_ports[0]}", None),
            **{name: (url, process.pid) for name, (url, process) in haproxies.items()},
            **{name: (url, process.pid) for name, (url, process) in nginxes.items()},
            "kroute": (kroute.url, kroute.process.pid),
            "kroute-python": (kroute_python.url, kroute_python.process.pid),
            "kroute-2w": (kroute_2w.url, kroute_2w.process.pid),
        }
        answer_problems = check_answers(systems, args.sizes)
        results, counters = run_rounds(systems, kroute, args)
        stop.set()
        kroute_metrics = kroute.admin("/metrics").text
        workers_metrics = kroute_2w.admin("/metrics").text
        for proxy in (kroute, kroute_python, kroute_2w):
            proxy.close()
    nginx_spills = _count_lines(
        workdir / "nginx-proxy" / "error.log", "buffered to a temporary file"
    )
    step_ns = partition_step_ns()
    summaries = {
        size: {name: summarize(rounds) for name, rounds in by_system.items()}
        for size, by_system in results.items()
    }
    _remove_unless_failed(workdir, results)
    extras = {
        "answer_problems": answer_problems,
        "nginx_temp_file_spills": nginx_spills,
        "counters": counters,
        "baseline": baseline,
        "workers_keyed_200s": metric_sum(
            workers_metrics, 'kroute_proxy_responses_total{kind="keyed",status="200"}'
        ),
    }
    return report(summaries, step_ns, args, kroute_metrics, extras)


def start_haproxy(
    services: EmbeddedServices,
    binary: str,
    workdir: Path,
    name: str,
    backends: list[int],
    threads: int,
    args: argparse.Namespace,
) -> tuple[str, ManagedProcess]:
    port = free_port()
    config = workdir / f"{name}.cfg"
    config.write_text(haproxy_conf(port, backends, threads))
    command = [binary, "-db", "-f", str(config)]
    return f"http://127.0.0.1:{port}", start_server(services, name, command, port, args.proxy_cpus)


def start_nginx_proxy(
    services: EmbeddedServices,
    binary: str,
    workdir: Path,
    name: str,
    backends: list[int],
    workers: int,
    args: argparse.Namespace,
) -> tuple[str, ManagedProcess]:
    port = free_port()
    directory = workdir / ("nginx-proxy" if workers == 1 else f"{name}-proxy")
    directory.mkdir()
    (directory / "nginx.conf").write_text(nginx_proxy_conf(directory, port, backends, workers))
    command = [binary, "-p", str(directory), "-c", str(directory / "nginx.conf")]
    return f"http://127.0.0.1:{port}", start_server(services, name, command, port, args.proxy_cpus)


def parse_cpus(text: str) -> str:
    """A taskset CPU list such as 0,1 or 2-7 (checked, returned as given)."""
    try:
        cpus = cpu_set(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a CPU list such as 0,1 or 2-7") from None
    unknown = cpus - os.sched_getaffinity(0)
    if not cpus or unknown:
        raise argparse.ArgumentTypeError(f"CPUs {sorted(unknown)} are not available here")
    return text


def cpu_set(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def _count_lines(path: Path, text: str) -> int:
    try:
        return sum(text in line for line in path.read_text(errors="replace").splitlines())
    except OSError:
        return 0


def judge_goals(
    by_size: dict[str, dict[str, Any]], baseline: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """Issue #17's performance goals, judged from the measured ratios: "met", "not met", "not
    measured" (size not run, or no previous figure) or "not judged" (errors make the run
    invalid for that comparison)."""
    goals: dict[str, dict[str, Any]] = {}
    for size in SIZES:
        if size not in by_size:
            goals[size] = {"status": "not measured", "why": "size not run"}
            continue
        systems, ratios = by_size[size]["systems"], by_size[size]["ratios"]
        errors = [
            f"{name}: {systems[name]['non_2xx']} non-2xx, {systems[name]['socket_errors']} "
            "socket errors"
            for name in ("kroute", "haproxy")
            if systems[name]["non_2xx"] or systems[name]["socket_errors"]
        ]
        rps = ratios["kroute_vs_haproxy_rps"]
        if size == "small":
            previous = baseline["rps_ratio"]
            goal: dict[str, Any] = {"kroute_vs_haproxy_rps": rps, "previous": previous}
            if previous is None or rps is None:
                goal.update(status="not measured", why="no previous kroute/HAProxy ratio")
            else:
                goal["change"] = round(rps / previous - 1, 4)
                met = rps >= previous * (1 - GOAL_SMALL_DROP)
                goal["status"] = "met" if met else "not met"
        else:
            p99 = ratios["kroute_vs_haproxy_p99"]
            goal = {"kroute_vs_haproxy_rps": rps, "kroute_vs_haproxy_p99": p99}
            met = rps is not None and p99 is not None and rps >= GOAL_RPS and p99 <= GOAL_P99
            goal["status"] = "met" if met else "not met"
        if errors:
            goal.update(status="not judged", why="run invalid: " + "; ".join(errors))
        goals[size] = goal
    return goals


def goals_paragraph(goals: dict[str, dict[str, Any]], baseline: dict[str, Any]) -> str:
    def verdict(goal: dict[str, Any]) -> str:
        why = f" ({goal['why']})" if goal.get("why") else ""
        return f"**{goal['status']}**{why}"

    small = goals["small"]
    if small.get("previous") is not None and small.get("kroute_vs_haproxy_rps") is not None:
        small_text = (
            f"kroute/HAProxy throughput {small['kroute_vs_haproxy_rps']} against "
            f"{small['previous']} before (revision {baseline['revision']}, "
            f"`{baseline['command']}`), {small['change']:+.1%}: {verdict(small)}"
        )
    else:
        small_text = verdict(small)
    parts = [
        f"small answers stay within {GOAL_SMALL_DROP:.0%} of the previous kroute/HAProxy "
        f"throughput ratio (no more than {GOAL_SMALL_DROP:.0%} below it) — {small_text}"
    ]
    for size in ("16k", "1m"):
        goal = goals[size]
        if "kroute_vs_haproxy_p99" in goal:
            measured = (
                f"throughput {goal['kroute_vs_haproxy_rps']}x, p99 "
                f"{goal['kroute_vs_haproxy_p99']}x HAProxy's: {verdict(goal)}"
            )
        else:
            measured = verdict(goal)
        parts.append(
            f"{SIZE_TITLES[size]} reach at least {GOAL_RPS}x HAProxy's throughput at no worse "
            f"p99 (p99 ratio <= {GOAL_P99}) — {measured}"
        )
    return "Issue #17's goals, judged from this run's medians: " + "; ".join(parts) + "."


def size_table(size: str, summary: dict[str, dict[str, Any]], ratios: dict[str, Any]) -> str:
    def cell(s: dict[str, Any], key: str, spec: str) -> str:
        return format(s[key], spec) if key in s else "—"

    rows = "\n".join(
        f"| {name} | {s['rps']:,.0f} | {s['mib_per_s']:,.1f} | {s['p50_ms']:.2f} | "
        f"{s['p99_ms']:.2f} | {cell(s, 'cpu_us_per_req', '.1f')} | "
        f"{cell(s, 'cpu_us_per_mib', ',.0f')} | {cell(s, 'rss_mb', '.1f')} | {s['non_2xx']} | "
        f"{s['socket_errors']} ({s['timeouts']} timeouts) |"
        for name, s in summary.items()
    )
    ratios_text = (
        f"kroute/HAProxy: throughput **{ratios['kroute_vs_haproxy_rps']}**, p99 "
        f"**{ratios['kroute_vs_haproxy_p99']}**, CPU/request "
        f"**{ratios['kroute_vs_haproxy_cpu']}**; kroute/nginx throughput "
        f"**{ratios['kroute_vs_nginx_rps']}**; kroute/kroute-python throughput "
        f"**{ratios['kroute_vs_python_path_rps']}**. Two workers: kroute-2w/kroute throughput "
        f"**{ratios['kroute_2w_vs_1w_rps']}**; kroute-2w/haproxy-2t throughput "
        f"**{ratios['kroute_2w_vs_haproxy_2t_rps']}**, p99 **{ratios['kroute_2w_vs_haproxy_2t_p99']}**"
        f", CPU/request **{ratios['kroute_2w_vs_haproxy_2t_cpu']}**; kroute-2w/nginx-2w throughput "
        f"**{ratios['kroute_2w_vs_nginx_2w_rps']}**."
    )
    columns = (
        "system | requests/s | MiB/s | p50 ms | p99 ms | CPU µs/request | CPU µs/MiB | RSS MB "
        "| non-2xx | socket errors"
    )
    return f"""### {SIZE_TITLES[size]}

| {columns} |
|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|
{rows}

{wrap(ratios_text)}
"""


def report(
    summaries: dict[str, dict[str, dict[str, Any]]],
    step_ns: float,
    args: argparse.Namespace,
    metrics: str,
    extras: dict[str, Any],
) -> int:
    baseline = extras["baseline"]
    by_size = {
        size: {
            "systems": summary,
            "ratios": size_ratios(summary),
            "kroute_counters": extras["counters"][size],
            "c_path_share_percent": c_path_share_percent(extras["counters"][size]),
        }
        for size, summary in summaries.items()
    }
    goals = judge_goals(by_size, baseline)
    workers_goal = judge_workers_goal(by_size)
    small_cpu = summaries["small"]["kroute"]["cpu_us_per_req"] if "small" in summaries else None
    share = step_ns / 1000 / small_cpu if small_cpu else None
    command = (
        f".venv/bin/python -m benchmarks.proxy_bench --seconds {args.seconds} "
        f"--rounds {args.rounds} --connections {args.connections} --sizes {','.join(args.sizes)}"
        f" --backend-workers {args.backend_workers}"
        + (f" --proxy-cpus {args.proxy_cpus}" if args.proxy_cpus else "")
        + (f" --load-cpus {args.load_cpus}" if args.load_cpus else "")
    )
    invalid = [
        f"{name} at {size}: {s['non_2xx']} non-2xx, {s['socket_errors']} socket errors "
        f"({s['timeouts']} timeouts)"
        for size, summary in summaries.items()
        for name, s in summary.items()
        if s["non_2xx"] or s["socket_errors"]
    ] + [f"wrong answer before measuring: {p}" for p in extras["answer_problems"]]
    data = {
        "command": command,
        "revision": git_revision(),
        "machine": machine_notes(),
        "sizes": {size: SIZES[size][1] for size in args.sizes},
        "wrk_timeout_s": WRK_TIMEOUT_S,
        # the small answers' figures where earlier runs kept them (absent if small was not run)
        **({k: by_size["small"][k] for k in ("systems", "ratios")} if "small" in by_size else {}),
        "by_size": by_size,
        "goals": goals,
        "workers_goal": workers_goal,
        "pinning": {"proxy_cpus": args.proxy_cpus, "load_cpus": args.load_cpus},
        "backend_workers": args.backend_workers,
        "kroute_2w_keyed_200s_one_scrape": extras["workers_keyed_200s"],
        "previous_small_kroute_vs_haproxy_rps": baseline["rps_ratio"],
        "previous_small_revision": baseline["revision"],
        "previous_small_command": baseline["command"],
        "valid": not invalid,
        "problems": invalid,
        "nginx_temp_file_spills": extras["nginx_temp_file_spills"],
        "partition_step_ns": round(step_ns, 1),
        "partition_step_share_of_kroute_cpu": round(share, 4) if share is not None else None,
        "kroute_keyed_200s": metric_value(
            metrics, 'kroute_proxy_responses_total{kind="keyed",status="200"}'
        ),
        "kroute_hot_path_requests": metric_value(metrics, "kroute_proxy_hot_path_requests_total"),
    }
    write_json("proxy", data)

    def hot_share(size: str) -> str:
        return f"{by_size[size]['c_path_share_percent']}%"

    tables = "\n".join(
        size_table(size, summaries[size], by_size[size]["ratios"]) for size in summaries
    )
    c_path = ", ".join(f"{size} {hot_share(size)}" for size in summaries)
    streamed = ", ".join(
        f"{size} {extras['counters'][size].get('streamed', 0):,.0f}" for size in summaries
    )
    validity = (
        "All answers were 2xx with no socket errors (timeouts included)."
        if not invalid
        else "**THIS RUN IS NOT VALID:** " + "; ".join(invalid) + "."
    )
    partition = (
        f"The partition step (KeyPartitioner.partition_of on these keys, in-process) costs "
        f"{step_ns:.0f} ns, {share:.1%} of kroute's CPU per small request."
        if share is not None
        else f"The partition step (KeyPartitioner.partition_of, in-process) costs {step_ns:.0f} ns."
    )
    setup = (
        "Three trivial backends (one nginx process on three ports: a fixed JSON, or a static "
        "file of 16,384 or 1,048,576 bytes by store) behind each proxy; wrk, 1 thread, "
        f"{args.connections} connections, --timeout {WRK_TIMEOUT_S} s, random keys out of "
        f"{KEYS:,} under the size's store; medians of {args.rounds} interleaved rounds of "
        f"{args.seconds} s per size and system. HAProxy: one thread (haproxy-2t: nbthread 2), "
        "round robin. nginx: one worker (nginx-2w: two, listen reuseport), round robin, default "
        "proxy buffering. kroute: one process (kroute-2w: KROUTE_WORKERS=2), every feature on "
        "(murmur2 routing, replica choice under a lag budget of 1,000 offsets / 60 s, "
        "provenance headers, metrics, limits). CPU is the user+system time of the proxy's "
        "process tree, per request and per MiB of answer bodies (2xx requests x body size); "
        f"MiB/s is wrk's transfer rate (heads included). {pinning(args)} {validity}"
    )
    kroute_notes = (
        f"Share of kroute's keyed 200s served by the C path (proxy/_hotpath.c): {c_path}; "
        f"answers streamed past kroute's buffer: {streamed}. nginx (proxy) logged "
        f"{extras['nginx_temp_file_spills']} answers buffered to a temporary file. {partition}"
    )
    markdown = f"""## Proxy: kroute vs HAProxy vs nginx (issues #5, #17, #20)

{wrap(f"`{command}` — revision {data['revision']}, {data['machine']}.")}

{wrap(setup)}

{wrap(goals_paragraph(goals, baseline))}

{wrap(workers_paragraph(workers_goal))}

{tables}
{wrap(kroute_notes)}
"""
    write_section("proxy", markdown)
    print(markdown)
    if invalid:
        warn("the run is not valid: " + "; ".join(invalid))
    return 0


def pinning(args: argparse.Namespace) -> str:
    if not args.proxy_cpus:
        return (
            "Nothing was pinned: proxies, wrk and the backends shared every core, so the "
            "two-worker and two-thread rows competed with the load for CPU."
        )
    return (
        f"Every proxy ran on CPUs {args.proxy_cpus} (taskset), wrk and the backends "
        f"({args.backend_workers} nginx worker(s)) on {args.load_cpus or 'any CPU'}."
    )


def workers_paragraph(goal: dict[str, Any]) -> str:
    why = f" ({goal['why']})" if goal.get("why") else ""
    measured = (
        f"kroute-2w/kroute throughput {goal['kroute_2w_vs_1w_rps']}, kroute-2w/haproxy-2t "
        f"{goal['kroute_2w_vs_haproxy_2t_rps']}"
        if "kroute_2w_vs_1w_rps" in goal
        else "not measured"
    )
    return (
        f"Issue #20's goal (small answers): two kroute workers reach at least "
        f"{GOAL_WORKERS_SCALING}x one worker's throughput and at least HAProxy's with two "
        f"threads — {measured}: **{goal['status']}**{why}."
    )


def wrap(text: str) -> str:
    return textwrap.fill(text, width=100, break_long_words=False, break_on_hyphens=False)


def metric_value(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return None


def metric_sum(text: str, prefix: str) -> float:
    """The sum of every sample whose line starts with `prefix` (a counter over its labels)."""
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)
    )


if __name__ == "__main__":
    sys.exit(main())
