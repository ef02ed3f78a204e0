"""Every KROUTE_* variable some part of kroute reads, and the start-up report of the others.

A variable no component reads is almost always a typo (KROUTE_MAX_LAG_M for KROUTE_MAX_LAG_MS)
or a name from an older release, and ignoring it silently can drop a lag budget. Each entry
point calls `report_unknown_variables` once logging is set up: a warning per unknown name, with
the closest known name, and one per deprecated name still in use.

The list is data, not computed: the proxy and the materializer must not import each other's
settings (nor the run command's), yet each must know the others' names, since one environment
(a compose .env, a shell) often feeds several components. tests/common/test_bad_configuration.py
checks it against every settings class, so a new setting cannot be missing from it.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import structlog

from common.settings import ENV_PREFIX, EnvSettings

# The settings classes' variables (proxy/settings.py, materializer/settings.py,
# kroute/settings.py, kroute/demo.py, benchmarks/locustfile.py), deprecated names included.
SETTINGS_VARIABLES: frozenset[str] = frozenset(
    (
        "KROUTE_ACCEPTABLE_RECOVERY_LAG",
        "KROUTE_ACCESS_LOG",
        "KROUTE_ADMIN_HOST",
        "KROUTE_ADMIN_PORT",
        "KROUTE_ADMIN_TOKEN",
        "KROUTE_ADVERTISED_URL",
        "KROUTE_ALIVE_TTL_MS",
        "KROUTE_ALLOWED_NETWORKS",
        "KROUTE_BOOTSTRAP_SERVERS",
        "KROUTE_BROKER_STORAGE",
        "KROUTE_CLOSE_TIMEOUT_MS",
        "KROUTE_CLUSTER",
        "KROUTE_CONNECT_TIMEOUT_MS",
        "KROUTE_DATA_DIR",
        "KROUTE_DEMO_CUSTOMERS",
        "KROUTE_DEMO_PARTITIONS",
        "KROUTE_DEMO_RATE",
        "KROUTE_DEMO_SEED_BOOKINGS",
        "KROUTE_EJECT_CONSECUTIVE_5XX",
        "KROUTE_EJECT_MS",
        "KROUTE_FETCH_MAX_WAIT_MS",
        "KROUTE_GRACE_PERIOD_S",
        "KROUTE_HEALTH_PATH",
        "KROUTE_HEARTBEAT_MS",
        "KROUTE_HEDGE_AFTER_MS",
        "KROUTE_HOST",
        "KROUTE_HOSTED_PARTITIONS",
        "KROUTE_HOT_PATH",
        "KROUTE_IDLE_TIMEOUT_MS",
        "KROUTE_KEY_FORMAT",
        "KROUTE_LAG_INTERVAL_MS",
        "KROUTE_LAG_REPORT_STALE_MS",
        "KROUTE_LOAD_CUSTOMERS",
        "KROUTE_LOAD_HEADERS",
        "KROUTE_LOAD_KEY_DISTRIBUTION",
        "KROUTE_LOAD_KEY_TEMPLATE",
        "KROUTE_LOAD_PATH",
        "KROUTE_LOAD_STORE",
        "KROUTE_LOAD_TIGHT_BUDGET_MS",
        "KROUTE_LOG_LEVEL",
        "KROUTE_MAX_BODY_BYTES",
        "KROUTE_MAX_CONNECTIONS",
        "KROUTE_MAX_EJECTION_PERCENT",
        "KROUTE_MAX_HEADERS",
        "KROUTE_MAX_HEADER_BYTES",
        "KROUTE_MAX_LAG",
        "KROUTE_MAX_LAG_MS",
        "KROUTE_MAX_RECORDS_PER_PARTITION",
        "KROUTE_MAX_RESPONSE_BYTES",
        "KROUTE_MAX_VALUE_BYTES",
        "KROUTE_MERGE",
        "KROUTE_MIN_OFFSET_WAIT_MS",
        "KROUTE_MIN_RETRIES_PER_S",
        "KROUTE_NODE_ID",
        "KROUTE_PARTITIONER",
        "KROUTE_PARTITIONS",
        "KROUTE_PER_TRY_TIMEOUT_MS",
        "KROUTE_PORT",
        "KROUTE_PROBE_INTERVAL_MS",
        "KROUTE_PROXY_PORT",
        "KROUTE_REDIS_CA_FILE",
        "KROUTE_REDIS_TIMEOUT_MS",
        "KROUTE_REDIS_URL",
        "KROUTE_REFRESH_INTERVAL_MS",
        "KROUTE_REQUEST_TIMEOUT_MS",
        "KROUTE_RETRY_BUDGET_PERCENT",
        "KROUTE_RETRY_BURST",
        "KROUTE_RETRY_STATUSES",
        "KROUTE_ROLE",
        "KROUTE_ROUTES",
        "KROUTE_SEND_TIMEOUT_MS",
        "KROUTE_SHUTDOWN_TIMEOUT_S",
        "KROUTE_SOURCE",
        "KROUTE_SPARK_CONF",
        "KROUTE_SPARK_JAVA_OPTIONS",
        "KROUTE_SPARK_MASTER",
        "KROUTE_SPARK_PACKAGES",
        "KROUTE_SPREAD",
        "KROUTE_STALL_REPORT_MS",
        "KROUTE_STALL_TIMEOUT_MS",
        "KROUTE_STANDBYS",
        "KROUTE_STANDBY_READS",
        "KROUTE_STARTUP_TIMEOUT_S",
        "KROUTE_START_RETRY_MAX_S",
        "KROUTE_STORE",
        "KROUTE_TABLE_PROCESS",
        "KROUTE_TABLE_PROCESS_CPUS",
        "KROUTE_TASKS_PER_BATCH",
        "KROUTE_TOPIC",
        "KROUTE_TRANSFORM",
        "KROUTE_TRIGGER_INTERVAL_MS",
        "KROUTE_UNKNOWN_LAG",
        "KROUTE_UPSTREAM_IDLE_PER_NODE",
        "KROUTE_UPSTREAM_IDLE_TIMEOUT_MS",
        "KROUTE_UPSTREAM_TIMEOUT_MS",
        "KROUTE_WORKERS",
        "KROUTE_VALUE_FORMAT",
        "KROUTE_WORKDIR",
    )
)
# Read by something other than a settings class.
OTHER_VARIABLES: Mapping[str, str] = {
    "KROUTE_CLOCK_SKEW_MS": "common/clock.py (fault injection in tests)",
    "KROUTE_TOPIC_PARTITIONS": "compose/docker-compose.yml (partitions the topic is created with)",
    "KROUTE_TEST_ARTIFACTS": "the test suite (where screenshots are kept)",
    "KROUTE_SANITIZE": "scripts/test (run the ASan/UBSan tier)",
    "KROUTE_SANITIZE_SOURCE": "scripts/sanitize (the C file to build)",
    "KROUTE_MUTATION_WORKERS": "scripts/mutation (parallel mutants)",
    "KROUTE_MUTATION_REUSE": "scripts/mutation (keep the last run's mutants)",
    "KROUTE_MUTATION_FRESH": "scripts/mutation (internal: each mutant in a fresh interpreter)",
    "KROUTE_MUTMUT": "scripts/mutation (internal: mutmut's command, for the fresh interpreter)",
}
KNOWN_VARIABLES: frozenset[str] = SETTINGS_VARIABLES | frozenset(OTHER_VARIABLES)


@dataclass(frozen=True)
class UnknownVariable:
    variable: str
    closest: str | None  # the known name it most likely meant


# Old names still read, with a warning, by the components that used them.
DEPRECATED_VARIABLES: frozenset[str] = frozenset({"KROUTE_PARTITIONS"})


def unknown_variables(
    environ: Mapping[str, str], known: Iterable[str] = KNOWN_VARIABLES
) -> list[UnknownVariable]:
    """Each KROUTE_* name in the environment that nothing reads, with the closest known one."""
    names = sorted(set(known))
    # A deprecated name is known (it is still read) but never the name to suggest.
    suggested = [name for name in names if name not in DEPRECATED_VARIABLES]
    return [
        UnknownVariable(
            variable, next(iter(difflib.get_close_matches(variable, suggested, 1)), None)
        )
        for variable in sorted(environ)
        if variable.startswith(ENV_PREFIX) and variable not in names
    ]


def report_unknown_variables(
    settings: type[EnvSettings], environ: Mapping[str, str] | None = None
) -> list[UnknownVariable]:
    """Warn (in the JSON log) about unknown and deprecated KROUTE_* names; returns the unknown.

    `settings` is the calling component's class: its own names are known even before this
    list is updated."""
    environ = os.environ if environ is None else environ
    log = structlog.get_logger("kroute.settings")
    unknown = unknown_variables(environ, KNOWN_VARIABLES | set(settings.variables()))
    for entry in unknown:
        log.warning(
            "unknown variable: no kroute component reads it (a typo?)",
            variable=entry.variable,
            closest_known=entry.closest,
        )
    for old, new in settings.deprecated_in(environ):
        log.warning("deprecated variable: use the new name", variable=old, new_name=new)
    return unknown
