"""Every KROUTE_* variable of every component, set to something invalid, stops start-up with
one clear error that names it (and never repeats a secret)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import structlog
from pydantic.fields import FieldInfo

from benchmarks.load_settings import LoadSettings
from common.known_settings import (
    KNOWN_VARIABLES,
    OTHER_VARIABLES,
    SETTINGS_VARIABLES,
    report_unknown_variables,
    unknown_variables,
)
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
    "table_process_cpus": "0;1",
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
    "load_path": "/stores/{store}/keys/{id}",
    "load_store": "bad/store",
    "load_headers": '{"x-tenant": 7}',
    "load_key_template": "card-{id}",
}
# Any value is valid: say why, so a new setting cannot slip through unchecked.
FREE = {
    "admin_token": "any string can be a token",
    "workdir": "a directory created at start",
    "data_dir": "a directory created at start",
    "spark_packages": "Maven coordinates, resolved by Spark",
    "spark_java_options": "JVM options, checked by the JVM when Spark starts it",
}
COMPONENTS = [ProxySettings, NodeSettings, RunSettings, DemoSettings, LoadSettings]


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
    variable = cls.variable(name)
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
        ("kroute", "KROUTE_DEMO_PARTITIONS", "0"),
        ("kroute", "KROUTE_PARTITIONS", "0"),  # the old name: still read, so still checked
        ("materializer", "KROUTE_PARTITIONS", "12"),  # a count or a partition? refused
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


# -- variables nothing reads --------------------------------------------------------------------


def test_the_registry_of_known_variables_is_exactly_what_the_settings_classes_read():
    read = set().union(*(cls.variables() for cls in [*COMPONENTS, LoadSettings]))
    assert sorted(SETTINGS_VARIABLES ^ read) == [], "update common/known_settings.py"
    assert not set(OTHER_VARIABLES) & read


# Names spelled like variables that are not read from the environment.
NOT_VARIABLES = {"KROUTE_COUNTERS": "a table of metric names in benchmarks/proxy_bench.py"}
SCANNED = ("common", "materializer", "proxy", "kroute", "benchmarks", "scripts", "compose", ".ci")


def test_every_variable_the_code_and_scripts_name_is_in_the_registry():
    """Variables read outside a settings class (scripts, the clock's fault injection, compose)
    must be listed by hand: a name mentioned anywhere but missing would be reported as unknown."""
    named: dict[str, str] = {}
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and path.suffix in ("", ".py", ".sh", ".yml", ".example", ".c"):
                if path.name == "known_settings.py":
                    continue  # its docstring's example typo
                text = path.read_text(errors="replace")
                for name in re.findall(r"\bKROUTE_[A-Z0-9_]*[A-Z0-9]\b", text):
                    named.setdefault(name, str(path.relative_to(ROOT)))
    missing = {n: p for n, p in named.items() if n not in KNOWN_VARIABLES | set(NOT_VARIABLES)}
    assert missing == {}, "add them to common/known_settings.py OTHER_VARIABLES"


def test_a_typo_is_reported_with_the_closest_known_name():
    environ = {"KROUTE_MAX_LAG_M": "1000", "KROUTE_TOPIC": "t", "KROUTE_HOSTED_PARTITON": "1"}
    found = {u.variable: u.closest for u in unknown_variables(environ)}
    assert found == {
        "KROUTE_MAX_LAG_M": "KROUTE_MAX_LAG_MS",
        "KROUTE_HOSTED_PARTITON": "KROUTE_HOSTED_PARTITIONS",
    }
    assert unknown_variables({name: "x" for name in KNOWN_VARIABLES}) == []
    # A deprecated name is still read, so never unknown, but never the one suggested either.
    (partition,) = unknown_variables({"KROUTE_PARTITION": "0-3"})
    assert partition.closest is not None
    assert partition.closest != "KROUTE_PARTITIONS"


def test_the_report_names_unknown_and_deprecated_variables():
    environ = {**REQUIRED, "KROUTE_MAX_LAGMS": "10", "KROUTE_PARTITIONS": "0-3"}
    with (
        structlog.testing.capture_logs() as lines
    ):  # as logged; JSON: tests/kroute/test_json_logs.py
        report_unknown_variables(NodeSettings, environ)
    by_variable = {line["variable"]: line for line in lines}
    assert by_variable["KROUTE_MAX_LAGMS"]["closest_known"] == "KROUTE_MAX_LAG_MS"
    assert by_variable["KROUTE_PARTITIONS"]["new_name"] == "KROUTE_HOSTED_PARTITIONS"
    assert {line["log_level"] for line in lines} == {"warning"}


@pytest.mark.parametrize(
    ("cls", "value", "expected"),
    [(NodeSettings, "0-3", "0-3"), (NodeSettings, "all", "all"), (RunSettings, "24", 24)],
)
def test_the_old_partitions_name_still_works_where_it_means_one_thing(cls, value, expected):
    settings = cls.from_env({**REQUIRED, "KROUTE_PARTITIONS": value})
    assert settings.partitions == expected
    renamed = cls.from_env(
        {**REQUIRED, "KROUTE_PARTITIONS": value, cls.variable("partitions"): "1"}
    )
    assert str(renamed.partitions) == "1", "the new name wins"


def test_a_bare_number_under_the_old_name_is_ambiguous_for_a_node():
    with pytest.raises(SettingsError, match="KROUTE_PARTITIONS='12' is ambiguous"):
        NodeSettings.from_env({**REQUIRED, "KROUTE_PARTITIONS": "12"})
