"""Run wrk (Debian's package) with varying keys and read its figures."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

KEYED_SCRIPT = """
math.randomseed(os.time())
request = function()
  return wrk.format("GET", "%s" .. math.random(0, %d))
end
"""


def run_wrk(
    url: str,
    seconds: int,
    *,
    connections: int = 8,
    path_prefix: str = "/stores/customers/keys/customer-",
    keys: int = 50_000,
    headers: tuple[str, ...] = (),
    timeout_s: int | None = None,
) -> dict[str, Any]:
    """GETs of path_prefix + a random key number, one wrk thread; rps, p50/p99 ms, non-2xx.
    `headers`: extra "name: value" lines on every request. `timeout_s`: wrk's --timeout (its
    default is 2 s); answers slower than that are counted in `timeouts`, not in the latencies."""
    timeout = ["--timeout", f"{timeout_s}s"] if timeout_s else []
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(KEYED_SCRIPT % (path_prefix, keys - 1))
    try:
        completed = subprocess.run(
            ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", "-s", script.name,
             *timeout, *(arg for header in headers for arg in ("-H", header)), url],
            capture_output=True, text=True, timeout=seconds + 30 + (timeout_s or 0), check=True,
        )  # fmt: skip
    finally:
        Path(script.name).unlink()
    return parse_wrk(completed.stdout)


def parse_wrk(output: str) -> dict[str, Any]:
    def ms(text: str) -> float:
        found = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
        number, unit = found.groups()  # type: ignore[union-attr]
        return float(number) * {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60_000.0}[unit]

    def size(number: str, unit: str) -> int:  # wrk's binary units: 1.50MB is 1.5 * 2**20
        return round(float(number) * 1024 ** "BKMGT".index(unit[0]))

    percentiles = dict(re.findall(r"^\s+(50|75|90|99)%\s+(\S+)", output, flags=re.MULTILINE))
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", output).group(1))  # type: ignore[union-attr]
    requests = int(re.search(r"(\d+) requests in", output).group(1))  # type: ignore[union-attr]
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
    socket_errors = re.search(r"Socket errors: (.*)", output)
    error_counts = {  # "connect 0, read 0, write 0, timeout 12"
        kind: int(count)
        for kind, count in re.findall(
            r"(\w+) (\d+)", socket_errors.group(1) if socket_errors else ""
        )
    }
    read = re.search(r"requests in \S+, ([\d.]+)(\w?B) read", output)
    transfer = re.search(r"Transfer/sec:\s+([\d.]+)(\w?B)", output)
    return {
        "rps": round(rps),
        "requests": requests,
        "p50_ms": round(ms(percentiles["50"]), 3),
        "p99_ms": round(ms(percentiles["99"]), 3),
        "non_2xx": int(errors.group(1)) if errors else 0,
        "socket_errors": socket_errors.group(1).strip() if socket_errors else "",
        "socket_error_count": sum(error_counts.values()),
        "timeouts": error_counts.get("timeout", 0),
        "bytes_read": size(*read.groups()) if read else 0,
        "transfer_bytes_per_s": size(*transfer.groups()) if transfer else 0,
    }


PATHS_SCRIPT = """
local paths = {}
for line in io.lines("%s") do paths[#paths + 1] = line end
math.randomseed(os.time())
local i = math.random(1, #paths)
request = function()
  i = i + 1
  if i > #paths then i = 1 end
  return wrk.format("GET", paths[i])
end
done = function(summary, latency, requests)
  local out = {}
  for q = 1, 999 do out[#out + 1] = string.format("%%d", latency:percentile(q / 10)) end
  out[#out + 1] = string.format("%%d", latency.max)
  io.write("QUANTILES_US " .. table.concat(out, " ") .. "\\n")
end
"""


def run_wrk_paths(url: str, paths_file: Path, seconds: int, connections: int) -> dict[str, Any]:
    """GETs of the file's paths in order (from a random start), one wrk thread.

    Besides parse_wrk's figures: `quantiles_us`, the latency at 0.1%, 0.2%, ... 99.9% and the
    maximum, so the runs of several wrk processes can be merged (merge_runs)."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(PATHS_SCRIPT % paths_file)
    try:
        completed = subprocess.run(
            ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", "-s", script.name, url],
            capture_output=True, text=True, timeout=seconds + 30, check=True,
        )  # fmt: skip
    finally:
        Path(script.name).unlink()
    result: dict[str, Any] = dict(parse_wrk(completed.stdout))
    line = re.search(r"^QUANTILES_US (.*)$", completed.stdout, flags=re.MULTILINE)
    result["quantiles_us"] = [int(v) for v in line.group(1).split()] if line else []
    return result


def merge_runs(runs: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """Runs of several wrk processes side by side as one: summed rate, merged percentiles."""
    weighted = sorted(
        (value, run["requests"] / len(run["quantiles_us"]))
        for run in runs
        for value in run["quantiles_us"]
    )
    total = sum(weight for _, weight in weighted)

    def percentile(q: float) -> float:
        running = 0.0
        for value, weight in weighted:
            running += weight
            if running >= q * total:
                return round(float(value) / 1000, 3)
        return round(float(weighted[-1][0]) / 1000, 3)

    requests = sum(run["requests"] for run in runs)
    return {
        "rps": round(requests / seconds),
        "requests": requests,
        "p50_ms": percentile(0.50),
        "p99_ms": percentile(0.99),
        "non_2xx": sum(run["non_2xx"] for run in runs),
        "socket_errors": "; ".join(run["socket_errors"] for run in runs if run["socket_errors"]),
    }
