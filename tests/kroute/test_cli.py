"""The `kroute` command, from the arguments a person types to what they see."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kroute.cli import main
from kroute.embedded import free_port
from materializer.settings import NodeSettings
from partitioner import partition
from proxy.settings import ProxySettings


def test_partition_prints_the_producers_partition(capsys):
    assert main(["partition", "customer-42", "--partitions", "12"]) == 0
    assert capsys.readouterr().out.strip() == str(partition(b"customer-42", 12))


def test_partition_with_key_format_and_algorithm(capsys):
    assert main(["partition", "42", "-n", "7", "-f", "int64", "-a", "crc32", "-v"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == str(partition((42).to_bytes(8, "big"), 7, "crc32"))
    assert lines[1] == "key bytes (hex): 000000000000002a"


def test_bad_key_is_a_usage_error_that_says_why(capsys):
    assert main(["partition", "forty-two", "-n", "7", "-f", "int32"]) == 2
    assert "invalid int32 key 'forty-two'" in capsys.readouterr().err


def test_zero_partitions_is_a_usage_error(capsys):
    assert main(["partition", "k", "-n", "0"]) == 2
    assert "num_partitions must be an integer >= 1" in capsys.readouterr().err


def test_bad_setting_stops_run_before_starting_anything(monkeypatch, capsys):
    monkeypatch.setenv("KROUTE_STARTUP_TIMEOUT_S", "soon")
    assert main(["run"]) == 2
    assert "KROUTE_STARTUP_TIMEOUT_S='soon'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("command", "settings"),
    [
        (["kroute", "node", "--help"], NodeSettings),
        (["kroute", "proxy", "--help"], ProxySettings),
        ([sys.executable, "-m", "materializer", "--help"], NodeSettings),
    ],
    ids=["kroute node", "kroute proxy", "python -m materializer"],
)
def test_help_lists_every_setting_with_its_default_and_meaning(command, settings):
    if command[0] == "kroute":
        command = [sys.executable, "-m", "kroute", *command[1:]]
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=60)
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())  # descriptions are wrapped
    for variable, default, meaning in settings.documentation():
        assert f"{variable} (default: {default})" in text
        assert " ".join(meaning.split()) in text, variable


def test_run_warns_about_a_typo_and_an_old_name_before_starting_anything(
    monkeypatch, capsys, tmp_path
):
    with socket.socket() as taken:  # the proxy's port is taken: run stops before any service
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setenv("KROUTE_PROXY_PORT", str(taken.getsockname()[1]))
        monkeypatch.setenv("KROUTE_WORKDIR", str(tmp_path))
        monkeypatch.setenv("KROUTE_DEMO_RAT", "50")
        monkeypatch.setenv("KROUTE_PARTITIONS", "6")
        assert main(["run"]) == 1
    out = capsys.readouterr().out
    assert "no kroute component reads KROUTE_DEMO_RAT (did you mean KROUTE_DEMO_RATE?)" in out
    assert "KROUTE_PARTITIONS is deprecated here; use KROUTE_DEMO_PARTITIONS" in out


def _descendants(pid: int) -> set[int]:
    """Every process below pid, found through /proc (to check that Ctrl-C stopped them all)."""
    found: set[int] = set()
    pending = [pid]
    while pending:
        parent = pending.pop()
        try:
            tasks = list(Path(f"/proc/{parent}/task").iterdir())
        except FileNotFoundError:
            continue
        for task in tasks:
            try:
                children = (task / "children").read_text().split()
            except FileNotFoundError:
                continue
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    pending.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _read_until(run: subprocess.Popen[str], marker: str, timeout_s: float, seen: list[str]) -> str:
    assert run.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = run.stdout.readline()
        seen.append(line)
        if marker in line or not line:
            break
    output = "".join(seen)
    assert marker in output, output
    return output


def test_run_refuses_a_taken_port_and_says_which_variable_to_set(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = {k: v for k, v in os.environ.items() if not k.startswith("KROUTE_")}
        env |= {"KROUTE_PROXY_PORT": str(taken.getsockname()[1]), "KROUTE_WORKDIR": "w"}
        done = subprocess.run(
            [sys.executable, "-m", "kroute", "run"],
            check=False,
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=60,
        )
    assert done.returncode == 1
    assert "is taken" in done.stderr
    assert "KROUTE_PROXY_PORT" in done.stderr
    assert not (tmp_path / "w" / "tansu.log").exists()  # nothing was started


@pytest.mark.integration
def test_run_serves_demo_lookups_survives_a_node_kill_and_ctrl_c_stops_everything(tmp_path):
    """The README's run command with --failover, as a person would use it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KROUTE_")}
    proxy_port, admin_port = free_port(), free_port()  # below the ephemeral range
    env |= {"KROUTE_PROXY_PORT": str(proxy_port), "KROUTE_ADMIN_PORT": str(admin_port)}
    with subprocess.Popen(
        [sys.executable, "-m", "kroute", "run", "--failover"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=tmp_path,
    ) as run:
        seen: list[str] = []
        output = _read_until(run, "Press Ctrl-C to stop.", 400, seen)
        for step in ("starting the Kafka broker", "starting 3 materializer nodes", "node c ready"):
            assert step in output
        lookups = re.findall(r"curl -si (\S+)", output)
        assert len(lookups) == 3
        for url in lookups:
            answer = httpx.get(url, timeout=10, trust_env=False)
            assert answer.status_code == 200, answer.text
            summary = answer.json()["value"]  # the node's envelope: key, partition, lag, value
            assert summary["bookings"] >= 1
            assert summary["latest"]["customer"] == url.rsplit("/", 1)[1]
            assert answer.headers["x-kroute-role"] in ("active", "standby")
        status_page = re.search(r"cluster status page\s+: (\S+)", output).group(1)
        assert "<html" in httpx.get(status_page, timeout=10, trust_env=False).text.lower()

        output = _read_until(run, "Still running on the survivors", 300, seen)
        summary = re.search(r"(\d+) lookups in \d+ s after the kill, (\d+) failed", output)
        assert summary is not None, output
        assert int(summary.group(1)) > 50
        assert int(summary.group(2)) == 0, output

        children = _descendants(run.pid)
        assert len(children) >= 6  # broker, redis, producer, nodes, proxy (and Spark JVMs)
        run.send_signal(signal.SIGINT)
        rest, _ = run.communicate(timeout=90)
    assert run.returncode == 0, rest
    assert "kroute: stopped." in rest
    assert (tmp_path / ".run" / "redis-server.log").is_file()
    # Grandchildren (Spark JVMs, Python workers) exit just after their parents: give them time.
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [pid for pid in children if _alive(pid)] == []
