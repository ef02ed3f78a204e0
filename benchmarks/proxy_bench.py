"""The proxy against HAProxy and nginx, in one run, in front of the same trivial backends.

Three backends (one nginx process, `master_process off`, one worker, answering a fixed JSON on
three ports) stand for three nodes. wrk (1 thread, varying keys) drives in turn:

  direct   wrk straight to one backend (the floor: no proxy at all)
  haproxy  HAProxy, one thread, round robin, keep-alive to the backends (http-reuse always)
  nginx    nginx, one worker, round robin, upstream keepalive
  kroute   the kroute proxy: key -> murmur2 partition -> replica choice under a lag budget
           -> forward over its pool, with metrics, provenance headers and limits all on
  kroute-python  the same proxy with KROUTE_HOT_PATH=false: every request through the Python
           path (what the C path in proxy/_hotpath.c saves)

The backends are registered in Redis as a static cluster (12 partitions, one standby each),
with lag reports refreshed every second so the lag budget is really checked. Systems are
measured in rounds, interleaved, so drift on this noisy 2-core machine hits all of them alike.
CPU per request is the proxy process's user+system time from /proc over the requests wrk
counted; resident memory (VmRSS) is read after each round, so growth across rounds would show a
leak. The share of that spent computing partitions is the in-process cost of
KeyPartitioner.partition_of over the same key distribution, divided by kroute's CPU/request.

Usage: .venv/bin/python -m benchmarks.proxy_bench [--seconds 8] [--rounds 3] [--connections 50]
Needs wrk, haproxy and nginx (apt-get install wrk haproxy nginx-light).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import redis

from benchmarks.results_file import git_revision, machine_notes, write_json, write_section
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


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def nginx_backends_conf(workdir: Path, ports: list[int]) -> str:
    servers = "\n".join(
        f"server {{ listen 127.0.0.1:{port}; location / {{ default_type application/json; "
        f"return 200 '{BODY}'; }} }}"
        for port in ports
    )
    return _nginx_conf(workdir, servers)


def nginx_proxy_conf(workdir: Path, port: int, backends: list[int]) -> str:
    upstream = "\n".join(f"  server 127.0.0.1:{p};" for p in backends)
    return _nginx_conf(
        workdir,
        f"upstream nodes {{\n{upstream}\n  keepalive 64;\n}}\n"
        f"server {{ listen 127.0.0.1:{port}; location / {{ proxy_pass http://nodes; "
        'proxy_http_version 1.1; proxy_set_header Connection ""; } }',
    )


def _nginx_conf(workdir: Path, servers: str) -> str:
    return f"""
daemon off;
master_process off;
worker_processes 1;
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


def haproxy_conf(port: int, backends: list[int]) -> str:
    servers = "\n".join(f"  server n{i} 127.0.0.1:{p}" for i, p in enumerate(backends))
    return f"""
global
  nbthread 1
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


def start_server(
    services: EmbeddedServices, name: str, command: list[str], port: int
) -> ManagedProcess:
    process = services.start_process(name, command)
    services.await_ready(process, lambda: port_open(port, 0.2), 10)
    return process


def measure(url: str, pid: int | None, seconds: int, connections: int) -> dict[str, Any]:
    before = cpu_seconds(pid) if pid else 0.0
    figures: dict[str, Any] = run_wrk(
        url, seconds, connections=connections, path_prefix=PATH_PREFIX, keys=KEYS
    )
    if pid:
        used = cpu_seconds(pid) - before
        figures["cpu_us_per_req"] = round(used * 1e6 / max(figures["requests"], 1), 2)
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
    keys = ("rps", "p50_ms", "p99_ms", "cpu_us_per_req", "rss_mb")
    summary = {
        key: round(statistics.median(r[key] for r in rounds), 3) for key in keys if key in rounds[0]
    }
    summary["non_2xx"] = sum(r["non_2xx"] for r in rounds)
    summary["rounds"] = rounds
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=int, default=8, choices=range(1, 61), metavar="1-60")
    parser.add_argument("--rounds", type=int, default=3, choices=range(1, 11), metavar="1-10")
    parser.add_argument("--connections", type=int, default=50)
    args = parser.parse_args()
    for tool in ("wrk", "haproxy", "nginx"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            parser.error(f"{tool} is not installed: apt-get install wrk haproxy nginx-light")
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    haproxy = shutil.which("haproxy") or "/usr/sbin/haproxy"

    workdir = Path(tempfile.mkdtemp(prefix="kroute-proxy-bench-"))
    results: dict[str, list[dict[str, Any]]] = {}
    with EmbeddedServices(workdir) as services:
        redis_server = services.start_redis()
        backend_ports = [free_port() for _ in range(3)]
        backends_dir = workdir / "backends"
        backends_dir.mkdir()
        (backends_dir / "nginx.conf").write_text(nginx_backends_conf(backends_dir, backend_ports))
        start_server(
            services,
            "backends",
            [nginx, "-p", str(backends_dir), "-c", str(backends_dir / "nginx.conf")],
            backend_ports[0],
        )

        haproxy_port = free_port()
        (workdir / "haproxy.cfg").write_text(haproxy_conf(haproxy_port, backend_ports))
        haproxy_process = start_server(
            services, "haproxy", [haproxy, "-db", "-f", str(workdir / "haproxy.cfg")], haproxy_port
        )

        nginx_port = free_port()
        nginx_dir = workdir / "nginx-proxy"
        nginx_dir.mkdir()
        (nginx_dir / "nginx.conf").write_text(
            nginx_proxy_conf(nginx_dir, nginx_port, backend_ports)
        )
        nginx_process = start_server(
            services,
            "nginx-proxy",
            [nginx, "-p", str(nginx_dir), "-c", str(nginx_dir / "nginx.conf")],
            nginx_port,
        )

        client = redis.Redis.from_url(redis_server.url)
        cluster = StaticCluster(
            Keys("bench"),
            {f"node-{i}": f"http://127.0.0.1:{p}" for i, p in enumerate(backend_ports)},
        ).add_store(StoreInfo("bench", "bench", PARTITIONS))
        cluster.publish(client)
        stop = threading.Event()
        refresher = threading.Thread(
            target=keep_reports_fresh, args=(cluster, client, stop), daemon=True
        )
        refresher.start()
        kroute, kroute_python = (
            start_proxy(
                services,
                redis_server.url,
                name=name,
                cluster="bench",
                max_lag="1000",
                max_lag_ms="60000",
                log_level="warning",
                hot_path=hot_path,
            )
            for name, hot_path in (("kroute", "true"), ("kroute-python", "false"))
        )

        systems = {
            "direct": (f"http://127.0.0.1:{backend_ports[0]}", None),
            "haproxy": (f"http://127.0.0.1:{haproxy_port}", haproxy_process.pid),
            "nginx": (f"http://127.0.0.1:{nginx_port}", nginx_process.pid),
            "kroute": (kroute.url, kroute.process.pid),
            "kroute-python": (kroute_python.url, kroute_python.process.pid),
        }
        for url, _ in systems.values():  # warm up connections and caches
            run_wrk(url, 1, connections=args.connections, path_prefix=PATH_PREFIX, keys=KEYS)
        for round_number in range(args.rounds):
            for name, (url, pid) in systems.items():
                figures = measure(url, pid, args.seconds, args.connections)
                results.setdefault(name, []).append(figures)
                print(f"round {round_number + 1} {name:8s} {figures}", flush=True)
        stop.set()
        kroute_metrics = kroute.admin("/metrics").text
        kroute.close()
        kroute_python.close()
    step_ns = partition_step_ns()
    summary = {name: summarize(rounds) for name, rounds in results.items()}
    return report(summary, step_ns, args, kroute_metrics)


def report(
    summary: dict[str, dict[str, Any]], step_ns: float, args: argparse.Namespace, metrics: str
) -> int:
    haproxy, kroute = summary["haproxy"], summary["kroute"]
    ratios = {
        "kroute_vs_haproxy_rps": round(kroute["rps"] / haproxy["rps"], 3),
        "kroute_vs_nginx_rps": round(kroute["rps"] / summary["nginx"]["rps"], 3),
        "kroute_vs_haproxy_p99": round(kroute["p99_ms"] / haproxy["p99_ms"], 3),
        "kroute_vs_haproxy_cpu": round(kroute["cpu_us_per_req"] / haproxy["cpu_us_per_req"], 3),
        "kroute_vs_python_path_rps": round(kroute["rps"] / summary["kroute-python"]["rps"], 3),
    }
    share = step_ns / 1000 / kroute["cpu_us_per_req"]
    command = (
        f".venv/bin/python -m benchmarks.proxy_bench --seconds {args.seconds} "
        f"--rounds {args.rounds} --connections {args.connections}"
    )
    data = {
        "command": command,
        "revision": git_revision(),
        "machine": machine_notes(),
        "systems": summary,
        "ratios": ratios,
        "partition_step_ns": round(step_ns, 1),
        "partition_step_share_of_kroute_cpu": round(share, 4),
        "kroute_keyed_200s": metric_value(
            metrics, 'kroute_proxy_responses_total{kind="keyed",status="200"}'
        ),
        "kroute_hot_path_requests": metric_value(metrics, "kroute_proxy_hot_path_requests_total"),
    }
    hot_share = (data["kroute_hot_path_requests"] or 0) / max(data["kroute_keyed_200s"] or 1, 1)
    write_json("proxy", data)
    rows = "\n".join(
        f"| {name} | {s['rps']:,.0f} | {s['p50_ms']:.2f} | {s['p99_ms']:.2f} | "
        f"{s.get('cpu_us_per_req', '—')} | {s.get('rss_mb', '—')} | {s['non_2xx']} |"
        for name, s in summary.items()
    )
    markdown = f"""## Proxy: kroute vs HAProxy vs nginx (issue #5)

`{command}` — revision {data["revision"]}, {data["machine"]}.

Three trivial backends (one nginx process answering fixed JSON on three ports) behind each
proxy; wrk, 1 thread, {args.connections} connections, random keys out of {KEYS:,}; medians of
{args.rounds} interleaved rounds of {args.seconds} s. HAProxy: one thread, round robin. nginx:
one worker, round robin. kroute: every feature on (murmur2 routing, replica choice under a lag
budget of 1,000 offsets / 60 s, provenance headers, metrics, limits). CPU/request is the proxy
process's user+system time over the requests served.

| system | requests/s | p50 ms | p99 ms | CPU µs/request | RSS MB | non-2xx |
|---|---:|---:|---:|---:|---:|---:|
{rows}

Ratios: kroute/HAProxy throughput **{ratios["kroute_vs_haproxy_rps"]}**, p99
**{ratios["kroute_vs_haproxy_p99"]}**, CPU/request **{ratios["kroute_vs_haproxy_cpu"]}**;
kroute/nginx throughput **{ratios["kroute_vs_nginx_rps"]}**. The C path (proxy/_hotpath.c)
served {hot_share:.1%} of kroute's keyed 200s; kroute forwards
{ratios["kroute_vs_python_path_rps"]}x as many requests a second as the same proxy with it
switched off (kroute-python).

The partition step (KeyPartitioner.partition_of on these keys, in-process) costs
{step_ns:.0f} ns, {share:.1%} of kroute's CPU per request.
"""
    write_section("proxy", markdown)
    print(markdown)
    return 0


def metric_value(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return None


if __name__ == "__main__":
    sys.exit(main())
