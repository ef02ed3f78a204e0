"""Run wrk (Debian's package) with varying keys and read its figures."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

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
) -> dict[str, float]:
    """GETs of path_prefix + a random key number, one wrk thread; rps, p50/p99 ms, non-2xx."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(KEYED_SCRIPT % (path_prefix, keys - 1))
    try:
        completed = subprocess.run(
            ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", "-s", script.name, url],
            capture_output=True, text=True, timeout=seconds + 30, check=True,
        )  # fmt: skip
    finally:
        Path(script.name).unlink()
    return parse_wrk(completed.stdout)


def parse_wrk(output: str) -> dict[str, float]:
    def ms(text: str) -> float:
        number, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", text).groups()  # type: ignore[union-attr]
        return float(number) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]

    percentiles = dict(re.findall(r"^\s+(50|75|90|99)%\s+(\S+)", output, flags=re.MULTILINE))
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", output).group(1))  # type: ignore[union-attr]
    requests = int(re.search(r"(\d+) requests in", output).group(1))  # type: ignore[union-attr]
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
    socket_errors = re.search(r"Socket errors: (.*)", output)
    return {
        "rps": round(rps),
        "requests": requests,
        "p50_ms": round(ms(percentiles["50"]), 3),
        "p99_ms": round(ms(percentiles["99"]), 3),
        "non_2xx": int(errors.group(1)) if errors else 0,
        "socket_errors": socket_errors.group(1).strip() if socket_errors else "",
    }
