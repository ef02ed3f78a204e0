"""The system benchmark's RESULTS.md section and plots, from its figures (the results JSON)."""

from __future__ import annotations

from typing import Any

from benchmarks.results_file import BENCHMARKS
from benchmarks.system.harness import GRACE_S
from benchmarks.system.survive import FAILOVER_WINDOW_S

PLOTS = BENCHMARKS / "results"


def plot(figures: dict[str, Any]) -> list[str]:
    """The plots of the claims that were run, named after the results file."""
    import matplotlib  # noqa: PLC0415 - optional until plots are drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    PLOTS.mkdir(exist_ok=True)
    names = []
    prefix = figures["name"]
    if "1_no_extra_hop" in figures:
        names.append(plot_hop(plt, figures["1_no_extra_hop"], f"{prefix}_hop.png"))
    if "kill-9" in figures.get("2_reads_survive_failures", {}):
        survive_figures = figures["2_reads_survive_failures"]
        names.append(plot_failover(plt, survive_figures, f"{prefix}_failover.png"))
    if "3_staleness" in figures:
        stale = figures["3_staleness"]["per_budget_ms"]
        names.append(plot_staleness(plt, stale, f"{prefix}_staleness.png"))
    plt.close("all")
    return names


def plot_hop(plt: Any, hop: dict[str, Any], name: str) -> str:
    layouts = [layout for layout in HOP_LAYOUTS if layout in hop]
    fig, grid = plt.subplots(len(layouts), 2, figsize=(10, 4 * len(layouts)), squeeze=False)
    systems = ("direct", "nginx", "kroute")
    for axes, layout in zip(grid, layouts, strict=True):
        for ax, metric, title in ((axes[0], "rps", "requests/s"), (axes[1], "p99_ms", "p99 (ms)")):
            for i, distribution in enumerate(("zipf", "uniform")):
                values = [hop[layout][distribution][s][metric] for s in systems]
                ax.bar([x + i * 0.38 for x in range(3)], values, width=0.38, label=distribution)
            ax.set_xticks([x + 0.19 for x in range(3)], systems)
            ax.set_title(f"{title}, {layout.replace('_', ' ')}")
            ax.legend()
    fig.suptitle("1. No extra hop: three nodes, direct vs nginx round robin vs kroute")
    fig.tight_layout()
    fig.savefig(PLOTS / name, dpi=90)
    return name


def plot_failover(plt: Any, survive_figures: dict[str, Any], name: str) -> str:
    fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for system, style in (("kroute", "-"), ("actives-only", "--")):
        line = survive_figures["kill-9"][system]["timeline"]
        axes[0].plot([b["t_s"] for b in line], [b["failed"] for b in line], style, label=system)
        axes[1].plot(
            [b["t_s"] for b in line], [b["p99_ms"] or 0 for b in line], style, label=system
        )
    axes[0].set_ylabel("failed / 0.5 s")
    axes[1].set_ylabel("p99 ms / 0.5 s")
    axes[1].set_yscale("log")
    axes[1].set_xlabel("seconds since kill -9")
    axes[0].legend()
    fig.suptitle("2. kill -9 of the node active for a third of the partitions")
    fig.tight_layout()
    fig.savefig(PLOTS / name, dpi=90)
    return name


def plot_staleness(plt: Any, stale: dict[str, Any], name: str) -> str:
    fig, ax = plt.subplots(figsize=(7, 4))
    budgets = [int(b) for b in stale]
    ax.plot(budgets, [stale[str(b)]["availability"] * 100 for b in budgets], "o-")
    ax.set_xscale("log")
    ax.set_xlabel("lag budget asked (x-kroute-max-lag-ms, ms)")
    ax.set_ylabel("answered (%); the rest: 503")
    ax.set_title("3. Availability vs budget while the only live replica falls behind")
    fig.tight_layout()
    fig.savefig(PLOTS / name, dpi=90)
    return name


def render(f: dict[str, Any], command: str, plots: list[str]) -> str:
    """The RESULTS.md section: the claims that were run (all, or those `--only` asked for)."""
    lines = [
        "## System benchmarks: the seeds' claims on one real cluster",
        "",
        f"`{command}` — {f['machine']}, revision {f['revision']}, {f['date']}. One Tansu broker,",
        "one redis-server, three materializer nodes (Spark local[1] each) with 12 partitions and one",
        f"standby each, a {GRACE_S} s grace period, and two proxies: kroute as configured by default",
        "and one with `KROUTE_STANDBY_READS=false` (actives only, the behaviour before KIP-535).",
        "Everything shares this machine's cores, wrk and the load generator included (claim 1 is",
        "also run with the cluster and the front on cores of their own). Figures as JSON:",
        f"[results/{f['name']}.json](results/{f['name']}.json).",
        "",
    ]
    if "1_no_extra_hop" in f:
        lines += render_hop_claim(f, plots)
    if "2_reads_survive_failures" in f:
        lines += render_survive(f["2_reads_survive_failures"], plots)
    if "3_staleness" in f:
        lines += render_staleness(f["3_staleness"], plots)
    if "4_restart_without_restore" in f:
        lines += render_restart(f["4_restart_without_restore"])
    if "5_freshness" in f:
        lines += render_freshness(f["5_freshness"])
    lines += render_resources(f["resources"])
    if "soak" in f:
        lines += render_soak(f["soak"])
    return "\n".join(lines)


def render_hop_claim(f: dict[str, Any], plots: list[str]) -> list[str]:
    return [
        "### 1. No extra hop",
        "",
        f"wrk, {f['settings']['connections']} connections, {f['settings']['seconds']} s per "
        f"system, medians of {f['settings']['rounds']} interleaved rounds. `direct`: three wrk "
        "processes, each sending its node the keys it is active for (the floor). `nginx`: round "
        "robin over the nodes, which forward keys they do not own to the owner (one hop, counted "
        "by the nodes, sent with a pooled aiohttp client). `kroute`: the proxy. Nodes' CPU: their "
        "three process trees (Spark included) per round, the median of the rounds' totals; per "
        "request answered in the last column.",
        *render_hop(f["1_no_extra_hop"]),
        *(f"![no extra hop](results/{plot})" for plot in plots if plot.endswith("_hop.png")),
        "",
    ]


def render_survive(survive_f: dict[str, Any], plots: list[str]) -> list[str]:
    first = next(iter(survive_f.values()))
    lines = [
        "### 2. Reads survive failures",
        "",
        "Steady load on both proxies at once (uniform keys, "
        f"{first['rate_per_proxy']:g} requests/s each over "
        f"{first['connections_per_proxy']} keep-alive connections, writes at 20/s). "
        "Window: from the fault until the end of the run (the actives-only proxy's recovery "
        f"needs the {GRACE_S} s grace period to pass and the partitions to move).",
        "",
        f"Failures are counted from the fault to the end; latency in the first "
        f"{FAILOVER_WINDOW_S:g} s after the fault (p99 in the 5 s before it for comparison). "
        "Latency is timed from when each request was due on its connection's constant-rate "
        "schedule, so requests queued behind a hung one count their wait (no coordinated "
        "omission); 'hung for the timeout' counts requests that waited it out from their own send.",
        "",
        "| fault | proxy | requests | failed | p99 ms before | p50 ms | p99 ms | max ms | all reads succeed again after | hung for the timeout (max per connection) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for fault, entry in survive_f.items():
        for system in ("kroute", "actives-only"):
            w = entry[system]
            lines.append(
                f"| {fault} of node {entry['victim']} ({entry['victim_active_partitions']} "
                f"actives) | {system} | {w['requests']:,} | {w['failed']:,} | "
                f"{w['p99_ms_before']} | {w['p50_ms']} | "
                f"{w['p99_ms']} | {w['max_ms']} | {w['all_served_again_after_s']} s | "
                f"{w['hung_for_the_timeout']} ({w['hung_max_per_connection']}) |"
            )
    lines += [
        "",
        *(f"![failover](results/{plot})" for plot in plots if plot.endswith("_failover.png")),
        "",
    ]
    return lines


def render_staleness(stale: dict[str, Any], plots: list[str]) -> list[str]:
    lines = [
        "### 3. Staleness is bounded and visible",
        "",
        f"Node {stale['killed_node']} killed; node {stale['throttled_node']}'s Spark JVM stopped "
        f"(SIGSTOP) for {stale['throttled_for_s']} s, so it is the only live replica of "
        f"partitions {stale['partitions']} and falls behind while {stale['keys']} keys there are "
        "written 40 times a second. Reads of those keys cycle through the budgets. True "
        "staleness of an answer: how long before it arrived the oldest write to that key it "
        "does not show was made (taken before `produce()`, so it errs against kroute).",
        "",
        "| budget (x-kroute-max-lag-ms) | requests | answered | 503 | availability | answers beyond the budget | max true staleness ms |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for budget, row in stale["per_budget_ms"].items():
        lines.append(
            f"| {budget} | {row['requests']} | {row['answered']} | {row['refused_503']} | "
            f"{row['availability']:.0%} | **{row['beyond_budget']}** | "
            f"{row['max_true_staleness_ms']} |"
        )
    lines += [
        "",
        *(f"![staleness](results/{plot})" for plot in plots if plot.endswith("_staleness.png")),
        "",
    ]
    return lines


def render_restart(restart_f: dict[str, Any]) -> list[str]:
    lines = [
        "### 4. Restart without restore",
        "",
        "| restart | written to its partitions while down (N) | records re-read | beyond N | "
        "records in its partitions | ready after | caught up after |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, row in restart_f.items():
        lines.append(
            f"| {mode} | {row['records_written_while_down']:,} | {row['records_reread']:,} | "
            f"{row['reread_beyond_missed']:,} | {row['partition_records_total']:,} | "
            f"{row['ready_s']} s | {row['caught_up_s']} s |"
        )
    return [*lines, "", "Times are from starting the process (Spark's start-up included).", ""]


def render_freshness(fresh: dict[str, Any]) -> list[str]:
    return [
        "### 5. Freshness",
        "",
        f"A new key every {1000 // fresh['produce_rate_per_s']} ms; time from `produce()` until "
        f"a GET through the proxy answers 200: p50 **{fresh['p50_ms']} ms**, p99 "
        f"**{fresh['p99_ms']} ms**, max {fresh['max_ms']} ms over {fresh['samples']} keys "
        f"({fresh['never_visible']} never visible).",
        "",
    ]


def render_resources(resources: dict[str, Any]) -> list[str]:
    lines = [
        "### CPU and memory per phase",
        "",
        "| phase | " + " | ".join(RESOURCE_COMPONENTS) + " |",
        "|---|" + "---:|" * len(RESOURCE_COMPONENTS),
    ]
    for phase, per in resources.items():
        cells = [
            f"{per[c]['cores']:.2f} / {per[c]['rss_max_mb']:.0f}" if c in per else "-"
            for c in RESOURCE_COMPONENTS
        ]
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    lines.append("\nEach cell: CPU cores used on average / largest resident MB (process trees).")
    return lines


HOP_LAYOUTS = {
    "shared_cores": "Everything on every core (the proxy's CPU comes out of the nodes' share)",
    "isolated_cores": "The cluster (nodes, broker, redis-server) on CPU {cluster}, the front "
    "(wrk, nginx, the proxies) on CPU {front}: each tier on cores of its own, as in a deployment",
}


def render_hop(hop: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for layout, title in HOP_LAYOUTS.items():
        if layout not in hop:
            continue
        rows = hop[layout]
        cpus = {tier: ", ".join(map(str, ids)) for tier, ids in rows.get("cpus", {}).items()}
        lines += [
            "",
            f"**{title.format(cluster=cpus.get('cluster'), front=cpus.get('front'))}.**",
            "",
            "| keys | system | requests/s | p50 ms | p99 ms | needed a hop | non-2xx | CPU cores: nodes / front | nodes' CPU µs per request |",
            "|---|---|---:|---:|---:|---:|---:|---|---:|",
        ]  # fmt: skip
        for distribution in ("zipf", "uniform"):
            for system in ("direct", "nginx", "kroute"):
                lines.append(hop_row(distribution, system, rows[distribution][system]))
        lines.append(
            "\nShare of kroute's requests served by its C path: "
            + ", ".join(f"{d} {rows[d]['kroute']['c_path_share']:.0%}" for d in ("zipf", "uniform"))
            + " (the rest took the Python path)."
        )
        for distribution in ("zipf", "uniform"):
            r = rows[distribution]["ratios"]
            lines.append(
                f"\n{distribution}: kroute/nginx throughput **{r['kroute_vs_nginx_rps']}x**, p99 "
                f"**{r['kroute_vs_nginx_p99']}x**; kroute/direct throughput "
                f"**{r['kroute_vs_direct_rps']}x** (goal >= 1.5x, p99 below nginx, within 25% of "
                f"direct: {'met' if rows[distribution]['goal_met'] else 'not met'})."
            )
    return [*lines, ""]


def hop_row(distribution: str, system: str, row: dict[str, Any]) -> str:
    front = row["cpu_cores"].get("proxy" if system == "kroute" else "nginx", 0.0)
    front_text = "-" if system == "direct" else f"{front:.2f}"
    return (
        f"| {distribution} | {system} | {row['rps']:,} | {row['p50_ms']:.2f} | "
        f"{row['p99_ms']:.1f} | {row['hop_share']:.0%} | {row['non_2xx']} | "
        f"{row['nodes_cpu_cores']:.2f} / {front_text} | {row['nodes_cpu_us_per_request']} |"
    )


RESOURCE_COMPONENTS = (
    "proxy", "proxy-actives-only", "node-a", "node-b", "node-c", "nginx", "redis", "broker",
)  # fmt: skip


def render_soak(soak_f: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "### Long run",
        "",
        f"{soak_f['minutes']:g} minutes of {soak_f['rate']:g} lookups/s (Zipf keys) and 20 "
        f"writes/s, no faults: {soak_f['requests']:,} requests, {soak_f['failed']} failed; p99 "
        f"per minute (ms): {soak_f['p99_ms_per_minute']}.",
        "",
        "| process tree | first minute MB | last minute MB | per minute MB |",
        "|---|---:|---:|---|",
    ]
    for component, m in soak_f["memory"].items():
        lines.append(
            f"| {component} | {m['first_minute_mb']} | {m['last_minute_mb']} | "
            f"{m['per_minute_mb']} |"
        )
    return lines
