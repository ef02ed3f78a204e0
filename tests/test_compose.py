"""compose/ without a Docker engine: the file's references, images, variables, ports and commands.

There is no Docker on this machine, so this checks what a `docker compose up` would trip on:
the file against the Compose Specification's JSON schema (check-jsonschema's vendored copy),
every ${VARIABLE} is in .env.example (and every one there is used and documented), images are
pinned, depends_on and volumes name things that exist, published ports are distinct and reach
the ports the services listen on, each kroute service's command is a module of this project,
and its KROUTE_* environment is accepted by that component's own settings class. And what would
start but not work: every long-running service has a healthcheck whose command its image ships
and whose URL is a health endpoint the service answers; start-up waits on health; the broker
keeps its log on its volume; each materializer is capped to its share of the Spark worker.
"""

from __future__ import annotations

import contextlib
import http.server
import importlib.util
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from common.settings import EnvSettings
from kroute.demo import DemoSettings
from materializer.settings import NodeSettings
from proxy.settings import ProxySettings

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose"
# Innermost first: a default may itself be a ${...} (a deprecated name as the fallback).
VARIABLE = re.compile(r"\$\{([A-Z0-9_]+)(?::?[-?]([^${}]*))?\}")
USED = re.compile(r"\$\{([A-Z0-9_]+)")
# Old names still read through a nested default: used in the file, but not in .env.example.
DEPRECATED = {"KROUTE_PARTITIONS": "KROUTE_TOPIC_PARTITIONS"}
SETTINGS: dict[str, type[EnvSettings]] = {
    "materializer": NodeSettings,
    "proxy": ProxySettings,
    "kroute.demo": DemoSettings,
}


def env_example() -> dict[str, str]:
    pairs = {}
    for line in (COMPOSE / ".env.example").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, value = line.partition("=")
            pairs[name] = value
    return pairs


def interpolated(text: str, values: dict[str, str]) -> str:
    """As compose does with .env: a set variable's value, else its default."""

    def one(match: re.Match[str]) -> str:
        return values.get(match.group(1), match.group(2) or "")

    while VARIABLE.search(text):
        text = VARIABLE.sub(one, text)
    return text


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    text = (COMPOSE / "docker-compose.yml").read_text()
    return dict(yaml.safe_load(interpolated(text, env_example())))


def test_every_variable_is_in_env_example_used_and_documented():
    text = (COMPOSE / "docker-compose.yml").read_text()
    used = set(USED.findall(text))
    listed = set(env_example())
    assert used == listed | set(DEPRECATED)
    assert set(DEPRECATED.values()) <= listed
    readme = (ROOT / "README.md").read_text()
    compose_section = readme[readme.index("## Deploying with compose") :]
    assert [name for name in sorted(listed) if f"`{name}`" not in compose_section] == []


def test_images_are_pinned_and_kroute_services_build_from_the_project(compose):
    for name, service in compose["services"].items():
        image = service["image"]
        assert ":" in image, (name, image)
        assert not image.endswith(":latest"), (name, image)
        if "build" in service:
            context = (COMPOSE / service["build"]["context"]).resolve()
            assert context == ROOT
            assert (context / service["build"]["dockerfile"]).is_file()


def test_the_dockerfile_copies_what_exists():
    for line in (COMPOSE / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), source


def test_references_name_existing_services_and_volumes(compose):
    services, volumes = compose["services"], compose["volumes"]
    for name, service in services.items():
        depends = service.get("depends_on", [])
        for dependency in depends if isinstance(depends, list) else list(depends):
            assert dependency in services, (name, dependency)
        for mount in service.get("volumes", []):
            source = mount.split(":", 1)[0]
            assert source in volumes, (name, mount)


def test_published_ports_are_distinct_and_reach_the_listening_ports(compose):
    published: list[str] = []
    for name, service in compose["services"].items():
        env = service.get("environment", {})
        listening = {env.get("KROUTE_PORT"), env.get("KROUTE_ADMIN_PORT")} - {None}
        for mapping in service.get("ports", []):
            host, container = mapping.split(":")
            published.append(host)
            if name != "locust":
                assert container in listening, (name, mapping)
    assert len(published) == len(set(published))


def test_kroute_commands_are_project_modules_with_valid_settings(compose):
    checked = set()
    for name, service in compose["services"].items():
        command = service.get("command", [])
        if command[:2] == ["python", "-m"]:
            module = command[2]
            assert importlib.util.find_spec(module) is not None, (name, module)
            env = {k: str(v) for k, v in service["environment"].items()}
            settings_class = SETTINGS[module]
            assert sorted(set(env) - set(settings_class.variables())) == [], name
            settings_class.from_env(env)  # the values are valid, not just the names
            checked.add(module)
        elif command[:1] == ["locust"]:
            assert (ROOT / command[command.index("-f") + 1]).is_file()
    assert checked == set(SETTINGS)


# -- the Compose Specification ------------------------------------------------------------------


@pytest.mark.parametrize("form", ["as written", "interpolated from .env.example"])
def test_the_file_is_valid_under_the_compose_specification_schema(form, tmp_path):
    path = COMPOSE / "docker-compose.yml"
    if form != "as written":
        path = tmp_path / "docker-compose.yml"
        path.write_text(interpolated((COMPOSE / "docker-compose.yml").read_text(), env_example()))
    done = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
         str(path)],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


# -- health and start-up order ------------------------------------------------------------------

KROUTE_IMAGE = "kroute:local"
# What each image ships that a healthcheck may call (kroute's: Python, and pyspark's scripts).
SHIPPED = {
    "apache/kafka": {
        "/opt/kafka/bin/kafka-broker-api-versions.sh",
        "/opt/kafka/bin/kafka-topics.sh",
    },
    "redis": {"redis-cli", "redis-server"},
    KROUTE_IMAGE: {"python", "spark-class", "locust"},
}
ONE_SHOT = {"kafka-init"}  # runs to completion: waited on with service_completed_successfully
CLIENTS = {"demo-producer", "locust"}  # serve nothing another service waits on


def image_name(service: dict[str, Any]) -> str:
    image = str(service["image"])
    return image if image == KROUTE_IMAGE else image.rsplit(":", 1)[0]


def listening_urls(name: str, service: dict[str, Any]) -> set[str]:
    """http://127.0.0.1:<port>/ prefixes the service answers on, from its own settings."""
    env, command = service.get("environment", {}), service.get("command", [])
    ports = {str(env[v]) for v in ("KROUTE_PORT", "KROUTE_ADMIN_PORT") if v in env}
    if "org.apache.spark.deploy.master.Master" in command:
        ports.add("8080")  # the master's web UI (its JSON at /json/)
    if "org.apache.spark.deploy.worker.Worker" in command:
        ports.add("8081")
    return {f"http://127.0.0.1:{port}/" for port in ports}


def test_every_long_running_service_has_a_healthcheck_its_image_can_run(compose):
    for name, service in compose["services"].items():
        if name in ONE_SHOT | CLIENTS:
            continue
        check = service.get("healthcheck", {}).get("test")
        assert check, name
        assert check[0] == "CMD", name
        assert check[1] in SHIPPED[image_name(service)], (name, check[1])
        if check[1] == "python":
            compile(check[3], f"{name} healthcheck", "exec")  # valid Python
            url = check[4]
            assert any(url.startswith(p) for p in listening_urls(name, service)), (name, url)
            assert url.endswith(("/health/ready", "/json/")), (name, url)


def test_the_python_healthcheck_passes_only_on_a_good_answer(compose):
    """The kroute services' check, run for real against a server answering 200, then 503."""
    check = compose["services"]["proxy"]["healthcheck"]["test"]
    for status, expected in ((200, 0), (503, 1)):
        with answering(status) as url:
            done = subprocess.run(
                [sys.executable, *check[2:4], url], capture_output=True, check=False, timeout=30
            )
        assert done.returncode == expected, (status, done.stderr[-500:])


@contextlib.contextmanager
def answering(status: int) -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *_args: Any) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/health/ready"
    finally:
        server.shutdown()
        server.server_close()


def test_start_up_waits_on_health_not_on_creation(compose):
    services = compose["services"]
    for name, service in services.items():
        depends = service.get("depends_on", {})
        assert isinstance(depends, dict), f"{name}: depends_on without conditions"
        for dependency, rule in depends.items():
            expected = (
                "service_completed_successfully" if dependency in ONE_SHOT else "service_healthy"
            )
            assert rule.get("condition") == expected, (name, dependency, rule)
            if expected == "service_healthy":
                assert "healthcheck" in services[dependency], (name, dependency)
    needs = {
        "kafka-init": {"kafka"},
        "spark-worker": {"spark-master"},
        "materializer-a": {"kafka-init", "redis", "spark-worker"},
        "proxy": {"redis"},
        "demo-producer": {"kafka-init"},
        "locust": {"proxy"},
    }
    for name, dependencies in needs.items():
        assert dependencies <= set(services[name].get("depends_on", {})), name


def test_the_broker_keeps_its_log_on_its_volume(compose):
    kafka = compose["services"]["kafka"]
    log_dirs = kafka["environment"]["KAFKA_LOG_DIRS"].split(",")
    mounts = [m.split(":")[1] for m in kafka["volumes"] if m.split(":")[0] in compose["volumes"]]
    for log_dir in log_dirs:
        assert any(log_dir == m or log_dir.startswith(m + "/") for m in mounts), log_dir
    assert kafka["environment"].get("CLUSTER_ID"), "a recreated broker must match its volume"


def test_each_materializer_gets_its_share_of_the_spark_worker(compose):
    services = compose["services"]
    worker = services["spark-worker"]["environment"]
    cores, memory_g = int(worker["SPARK_WORKER_CORES"]), int(worker["SPARK_WORKER_MEMORY"][:-1])
    nodes = {n: s for n, s in services.items() if s.get("command", [])[-1:] == ["materializer"]}
    assert len(nodes) == 3
    used_cores = used_memory_g = 0
    for name, service in nodes.items():
        env = service["environment"]
        assert env["KROUTE_SPARK_MASTER"].startswith("spark://"), name
        conf = NodeSettings.from_env({k: str(v) for k, v in env.items()}).spark_conf
        # Unset, standalone mode gives the first application every core: the others wait.
        used_cores += int(conf["spark.cores.max"])
        used_memory_g += int(conf.get("spark.executor.memory", "1g")[:-1])
        # Executors call the driver back by its host name: the service's own.
        assert service["hostname"] == name, name
    assert used_cores <= cores
    assert used_memory_g <= memory_g
