"""benchmarks/locustfile.py runs headless against a real proxy and its users' answers count."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

from tests.proxy.conftest import StandIns

ROOT = Path(__file__).resolve().parents[2]


def test_the_locustfile_runs_headless_against_the_proxy(stand_ins: StandIns, tmp_path):
    env = dict(os.environ, KROUTE_LOAD_STORE="customers", KROUTE_LOAD_CUSTOMERS="500")
    done = subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(ROOT / "benchmarks" / "locustfile.py"),
         "--headless", "-u", "5", "-r", "5", "-t", "4s", "--host", stand_ins.proxy.url,
         "--csv", str(tmp_path / "load"), "--only-summary"],
        check=False, capture_output=True, text=True, env=env, timeout=90, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    with (tmp_path / "load_stats.csv").open() as stats:
        rows = {row["Name"]: row for row in csv.DictReader(stats)}
    for name in ("lookup", "miss", "lookup (tight lag budget)", "Aggregated"):
        assert int(rows[name]["Request Count"]) > 0, rows
    assert int(rows["Aggregated"]["Failure Count"]) == 0, rows
