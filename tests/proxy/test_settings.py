"""Proxy configuration: every bad variable is named in one clear error."""

from __future__ import annotations

import os

import pytest

from common.settings import SettingsError, redacted_url
from proxy.http import status_lines
from proxy.settings import ProxySettings

BASE = {"KROUTE_REDIS_URL": "redis://:s3cret@127.0.0.1:6379/0"}


def test_defaults_and_secrets():
    settings = ProxySettings.from_env(BASE)
    assert settings.port == 8080
    assert settings.admin_port == 8090
    assert [spec.path for spec in settings.route_specs()] == ["/stores/{store}/keys/{key}"]
    assert settings.networks() is None
    assert "s3cret" not in repr(settings)


def test_missing_redis_url_is_named():
    with pytest.raises(SettingsError, match="KROUTE_REDIS_URL is required"):
        ProxySettings.from_env({})


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("KROUTE_ROUTES", "not json", "not JSON"),
        ("KROUTE_ROUTES", "[]", "non-empty JSON list"),
        ("KROUTE_ROUTES", '[{"path": "/x/{key}"}]', "store"),
        ("KROUTE_ALLOWED_NETWORKS", "10.0.0.0/8,nonsense", "CIDR"),
        ("KROUTE_UNKNOWN_LAG", "maybe", "reject"),
        ("KROUTE_MAX_LAG", "-1", "greater than or equal to 0"),
        ("KROUTE_PORT", "70000", "less than or equal to 65535"),
        ("KROUTE_SPREAD", "perhaps", "bool"),
        ("KROUTE_HEALTH_PATH", "healthz", "must start with '/'"),
        ("KROUTE_HEALTH_PATH", "/health live", "contains ' ': spaces, control characters"),
        ("KROUTE_HEALTH_PATH", "/healthz\r\nx-injected: 1", r"contains '\\r'"),
        ("KROUTE_HEALTH_PATH", "/health\nz", r"contains '\\n'"),
        ("KROUTE_HEALTH_PATH", "/sant\u00e9", "non-ASCII"),
        ("KROUTE_RETRY_STATUSES", "200", "200 is not in 400-599"),
        ("KROUTE_RETRY_STATUSES", "421,302", "302 is not in 400-599"),
        ("KROUTE_RETRY_STATUSES", "404,600", "600 is not in 400-599"),
        ("KROUTE_RETRY_STATUSES", "404;503", "'404;503' is not an HTTP status code"),
        ("KROUTE_RETRY_STATUSES", "not-mine", "is not an HTTP status code"),
        ("KROUTE_RETRY_STATUSES", "-404", "is not an HTTP status code"),
        ("KROUTE_WORKERS", "0", "greater than or equal to 1"),
        ("KROUTE_WORKERS", "257", "less than or equal to 256"),
        ("KROUTE_WORKERS", "two", "valid integer"),
        ("KROUTE_TABLE_PROCESS_CPUS", "1;2", "not a CPU list"),
        ("KROUTE_TABLE_PROCESS_CPUS", "", "not a CPU list"),
        ("KROUTE_TABLE_PROCESS_CPUS", "0,-1", "not a CPU list"),
        ("KROUTE_TABLE_PROCESS_CPUS", "3-1", "must go up"),
        ("KROUTE_TABLE_PROCESS_CPUS", "0-", "not a CPU list"),
        ("KROUTE_TABLE_PROCESS_CPUS", "2147483647", "beyond any machine"),
        ("KROUTE_TABLE_PROCESS_CPUS", "0-4000000000", "beyond any machine"),
    ],
)
def test_each_bad_value_names_its_variable(variable, value, message):
    with pytest.raises(SettingsError, match=message) as raised:
        ProxySettings.from_env({**BASE, variable: value})
    assert variable in str(raised.value)


def test_health_path_and_retry_statuses_defaults_and_values():
    defaults = ProxySettings.from_env(BASE)
    assert defaults.health_path == "/health/live"
    assert defaults.retry_status_codes() == frozenset({421})
    settings = ProxySettings.from_env(
        {
            **BASE,
            "KROUTE_HEALTH_PATH": "/admin/healthz?full=1",
            "KROUTE_RETRY_STATUSES": " 404, 503,421 ,404",
        }
    )
    assert settings.health_path == "/admin/healthz?full=1"
    assert settings.retry_status_codes() == frozenset({404, 421, 503})
    # Empty: no status fails over (a service whose 421 means something else).
    none = ProxySettings.from_env({**BASE, "KROUTE_RETRY_STATUSES": ""})
    assert none.retry_status_codes() == frozenset()


def test_the_c_path_has_no_status_line_for_a_retry_status():
    """What makes the C path hand retry statuses to Python (proxy/_hotpath.c answer_fast)."""
    lines = status_lines(leave_out=frozenset({404, 503}))
    assert 404 not in lines
    assert 503 not in lines
    assert lines[200] == b"HTTP/1.1 200 OK\r\n"
    assert 421 in lines
    assert 421 not in status_lines(leave_out=frozenset({421}))


def test_allowed_networks_parse():
    settings = ProxySettings.from_env({**BASE, "KROUTE_ALLOWED_NETWORKS": "127.0.0.0/8, ::1/128"})
    assert [str(n) for n in settings.networks() or ()] == ["127.0.0.0/8", "::1/128"]


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:s3cret@10.0.0.1:6379/0", "redis://***@10.0.0.1:6379/0"),
        ("rediss://user:s3cret@redis.internal:6380", "rediss://***@redis.internal:6380"),
        ("redis://10.0.0.1:6379/0", "redis://10.0.0.1:6379/0"),
    ],
)
def test_redis_url_in_logs_keeps_the_address_and_hides_credentials(url, shown):
    assert redacted_url(ProxySettings.from_env({"KROUTE_REDIS_URL": url}).redis_url) == shown


def test_workers_default_to_the_cores_this_process_may_use():
    """One per core the proxy may run on (its affinity, which taskset or a cpuset narrows)."""
    assert ProxySettings.from_env(BASE).workers == len(os.sched_getaffinity(0))
    assert ProxySettings.from_env({**BASE, "KROUTE_WORKERS": "1"}).workers == 1
    assert ProxySettings.from_env({**BASE, "KROUTE_WORKERS": "4"}).workers == 4


def test_table_process_cpus_parse():
    assert ProxySettings.from_env(BASE).table_cpus() is None
    settings = ProxySettings.from_env({**BASE, "KROUTE_TABLE_PROCESS_CPUS": "0, 2-4,3"})
    assert settings.table_cpus() == frozenset({0, 2, 3, 4})
