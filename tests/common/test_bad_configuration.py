"""Every KROUTE_* variable of every component, set to something invalid, stops start-up with
one clear error that names it (and never repeats a secret)."""

from __future__ import annotations

import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from pydantic.fields import FieldInfo

from common.settings import ENV_PREFIX, EnvSettings, SettingsError
from kroute.demo import DemoSettings
from kroute.settings import RunSettings
from materializer.settings import NodeSettings
from proxy.settings import ProxySettings

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = {
    "KROUTE_REDIS_URL": "redis://127.0.0.1:6379/0",
    "KROUTE_BOOTSTRAP_SERVERS": "127.0.0.1:9092",
    "KROUTE_TOPIC": "bookings",
}
SECRET = "hunter2-not-for-logs"

# Invalid values for settings whose type alone does not say what is wrong.
INVALID = {
    "host": "not a host!",
    "admin_host": "exa mple.com",
    "redis_url": f"http://:{SECRET}@127.0.0.1:6379",
    "redis_ca_file": "/nonexistent/ca.pem",
    "cluster": "my cluster",
    "routes": "not json",
    "allowed_networks": "10.0.0.0/33",
    "node_id": "a/b",
    "bootstrap_servers": "localhost",
    "topic": "bad topic",
    "store": "bad/store",
    "partitions": "first",
    "key_format": "long",
    "partitioner": "default",
    "spark_master": "spark:/host",
    "transform": "not a path",
    "merge": "module.function",
    "advertised_url": "ftp://node:8081",
    "broker_storage": "file:///tmp/tansu",
    "health_path": "health check",
    "retry_statuses": "200",
    "spark_conf": '{"spark.cores.max": 2}',
}
# Any value is valid: say why, so a new setting cannot slip through unchecked.
FREE = {
    "admin_token": "any string can be a token",
    "workdir": "a directory created at start",
    "data_dir": "a directory created at start",
    "spark_packages": "Maven coordinates, resolved by Spark",
    "spark_java_options": "JVM options, checked by the JVM when Spark starts it",
}
COMPONENTS = [ProxySettings, NodeSettings, RunSettings, DemoSettings]


def invalid_value(name: str, field: FieldInfo) -> str:
    if name in INVALID:
        return INVALID[name]
    annotation = field.annotation
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return "nonsense"
    if annotation is bool or bool in args:
        return "perhaps"
    if annotation in (int, float) or int in args or float in args:
        return "many"
    raise AssertionError(f"{name}: no invalid value known; add it to INVALID or FREE")


CASES = [
    pytest.param(cls, name, invalid_value(name, field), id=f"{cls.__name__}-{name}")
    for cls in COMPONENTS
    for name, field in cls.model_fields.items()
    if name not in FREE
]


@pytest.mark.parametrize(("cls", "name", "value"), CASES)
def test_each_invalid_variable_is_named_in_one_error(cls: type[EnvSettings], name, value):
    variable = ENV_PREFIX + name.upper()
    with pytest.raises(SettingsError) as raised:
        cls.from_env({**REQUIRED, variable: value})
    message = str(raised.value)
    assert message.startswith(f"invalid configuration: {variable}="), message
    assert message.count(ENV_PREFIX) == 1, message
    assert "\n" not in message
    assert SECRET not in message


def test_every_setting_is_either_checked_or_free_text():
    names = {name for cls in COMPONENTS for name in cls.model_fields}
    assert set(FREE) <= names
    assert set(INVALID) <= names


def test_the_defaults_and_good_values_are_accepted():
    for cls in COMPONENTS:
        cls.from_env(REQUIRED)
    NodeSettings.from_env(
        {
            **REQUIRED,
            "KROUTE_BOOTSTRAP_SERVERS": "kafka-1:9092, 10.0.0.7:9093,[::1]:9094",
            "KROUTE_ADVERTISED_URL": "http://materializer-a:8081",
            "KROUTE_SPARK_MASTER": "spark://spark-master:7077",
            "KROUTE_TRANSFORM": "kroute.demo:booking_counts",
            "KROUTE_REDIS_URL": "rediss://:pw@redis.internal:6380/1",
            "KROUTE_NODE_ID": "materializer-a.eu-west-1",
        }
    )
    ProxySettings.from_env({**REQUIRED, "KROUTE_HOST": "0.0.0.0", "KROUTE_ADMIN_HOST": "::"})


@pytest.mark.parametrize(
    ("module", "variable", "value"),
    [
        ("proxy", "KROUTE_UPSTREAM_TIMEOUT_MS", "soon"),
        ("proxy", "KROUTE_REDIS_URL", f"http://:{SECRET}@127.0.0.1:6379"),
        ("materializer", "KROUTE_TOPIC", "bad topic"),
        ("kroute.demo", "KROUTE_DEMO_RATE", "-1"),
        ("kroute", "KROUTE_PARTITIONS", "0"),
    ],
)
def test_a_component_started_with_a_bad_variable_exits_with_one_line_naming_it(
    module, variable, value
):
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    args = [sys.executable, "-m", module] + (["run"] if module == "kroute" else [])
    done = subprocess.run(
        args,
        check=False,
        env={**env, **REQUIRED, variable: value},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert variable in lines[0]
    assert SECRET not in done.stderr + done.stdout
