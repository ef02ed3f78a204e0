"""compose/ without a Docker engine: the file's references, images, variables, ports and commands.

There is no Docker on this machine, so this checks what a `docker compose up` would trip on:
every ${VARIABLE} is in .env.example (and every one there is used and documented), images are
pinned, depends_on and volumes name things that exist, published ports are distinct and reach
the ports the services listen on, each kroute service's command is a module of this project,
and its KROUTE_* environment is accepted by that component's own settings class.
"""

from __future__ import annotations

import importlib.util
import re
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
VARIABLE = re.compile(r"\$\{([A-Z0-9_]+)(?::?[-?]([^}]*))?\}")
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
    return VARIABLE.sub(lambda m: values[m.group(1)], text)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    text = (COMPOSE / "docker-compose.yml").read_text()
    return dict(yaml.safe_load(interpolated(text, env_example())))


def test_every_variable_is_in_env_example_used_and_documented():
    text = (COMPOSE / "docker-compose.yml").read_text()
    used = {m.group(1) for m in VARIABLE.finditer(text)}
    listed = set(env_example())
    assert used == listed
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
            fields = {f"KROUTE_{field.upper()}" for field in settings_class.model_fields}
            assert sorted(set(env) - fields) == [], name
            settings_class.from_env(env)  # the values are valid, not just the names
            checked.add(module)
        elif command[:1] == ["locust"]:
            assert (ROOT / command[command.index("-f") + 1]).is_file()
    assert checked == set(SETTINGS)
