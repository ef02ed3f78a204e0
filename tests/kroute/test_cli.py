"""The `kroute` command, from the arguments a person types to what they see."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import redis
from confluent_kafka.admin import AdminClient

from kroute.cli import main
from partitioner import partition


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


@pytest.mark.integration
def test_run_starts_the_services_and_ctrl_c_stops_them(tmp_path):
    # As in the README: default settings, so the work directory is the relative ".run".
    env = {k: v for k, v in os.environ.items() if not k.startswith("KROUTE_")}
    with subprocess.Popen(
        [sys.executable, "-m", "kroute", "run"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=tmp_path,
    ) as run:
        assert run.stdout is not None
        seen: list[str] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = run.stdout.readline()
            seen.append(line)
            if "Press Ctrl-C to stop." in line or not line:
                break
        output = "".join(seen)
        assert "Press Ctrl-C to stop." in output, output

        bootstrap = re.search(r"Kafka bootstrap servers : (\S+)", output).group(1)
        redis_url = re.search(r"Redis\s+: (\S+)", output).group(1)
        assert AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=5).brokers
        client = redis.Redis.from_url(redis_url)
        assert client.ping()
        client.close()

        run.send_signal(signal.SIGINT)
        rest, _ = run.communicate(timeout=30)
    assert run.returncode == 0, rest
    assert "kroute: stopped." in rest
    assert (tmp_path / ".run" / "redis-server.log").is_file()
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(redis_url, socket_connect_timeout=1).ping()
