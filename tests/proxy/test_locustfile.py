"""benchmarks/locustfile.py runs headless against a real proxy, and against any keyed HTTP
service described by its settings (path template, keys, headers); its users' answers count."""

from __future__ import annotations

import csv
import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.proxy.conftest import StandIns

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "load-test-token"


def run_locust(host: str, tmp_path: Path, seconds: int = 4, **settings: str) -> dict[str, dict]:
    """Run the locustfile headless; its stats rows by name (exit code checked)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KROUTE_")}
    env.update({f"KROUTE_LOAD_{name.upper()}": value for name, value in settings.items()})
    done = subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(ROOT / "benchmarks" / "locustfile.py"),
         "--headless", "-u", "5", "-r", "5", "-t", f"{seconds}s", "--host", host,
         "--csv", str(tmp_path / "load"), "--only-summary"],
        check=False, capture_output=True, text=True, env=env, timeout=90, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    with (tmp_path / "load_stats.csv").open() as stats:
        return {row["Name"]: row for row in csv.DictReader(stats)}


def test_the_locustfile_runs_headless_against_the_proxy(stand_ins: StandIns, tmp_path):
    rows = run_locust(stand_ins.proxy.url, tmp_path, store="customers", customers="500")
    for name in ("lookup", "miss", "lookup (tight lag budget)", "Aggregated"):
        assert int(rows[name]["Request Count"]) > 0, rows
    assert int(rows["Aggregated"]["Failure Count"]) == 0, rows


@contextmanager
def card_service(written: set[str], token: str) -> Iterator[tuple[str, list[str]]]:
    """A service that is not kroute: GET /v1/cards/<id> with a bearer token; 404 for a card
    it does not hold, 401 without the token. Yields its URL and the paths it was asked."""
    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            card = self.path.removeprefix("/v1/cards/")
            if self.headers.get("authorization") != f"Bearer {token}":
                status = 401
            else:
                status = 200 if card in written else 404
            self.send_response(status)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *_args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", asked
    finally:
        server.shutdown()
        server.server_close()


def test_the_locustfile_can_be_aimed_at_any_service_and_a_404_is_no_failure(tmp_path):
    written = {f"card-{n}" for n in range(1, 11)}  # the first 10 of 40: the rest not yet
    with card_service(written, TOKEN) as (url, asked):
        rows = run_locust(
            url, tmp_path, path="/v1/cards/{key}", key_template="card-{n}",
            key_distribution="uniform", customers="40",
            headers=json.dumps({"authorization": f"Bearer {TOKEN}"}),
        )  # fmt: skip
    lookups = [p for p in asked if not p.startswith("/v1/cards/nobody-")]
    assert lookups, asked[:5]
    assert all(p.startswith("/v1/cards/card-") for p in lookups), asked[:5]
    assert {p.removeprefix("/v1/cards/") for p in lookups} - written, "some keys not written"
    assert int(rows["Aggregated"]["Request Count"]) > 0
    assert int(rows["Aggregated"]["Failure Count"]) == 0, rows  # 404s and no 401


def test_an_invalid_setting_stops_the_load_test_naming_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KROUTE_")}
    env["KROUTE_LOAD_PATH"] = "/v1/cards/{id}"
    done = subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(ROOT / "benchmarks" / "locustfile.py"),
         "--headless", "-u", "1", "-t", "1s", "--host", "http://127.0.0.1:9"],
        check=False, capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode != 0
    assert "KROUTE_LOAD_PATH='/v1/cards/{id}'" in done.stderr
