"""The README stays true: its configuration table and its commands match the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from common.settings import EnvSettings
from kroute.settings import RunSettings
from materializer.settings import NodeSettings
from proxy.settings import ProxySettings

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def section(heading: str) -> str:
    """The README text under a '### heading', up to the next heading."""
    after = README.split(f"### {heading}\n", 1)[1]
    return re.split(r"^#{2,3} ", after, maxsplit=1, flags=re.MULTILINE)[0]


@pytest.mark.parametrize(
    ("heading", "settings"),
    [("Run command", RunSettings), ("Materializer node", NodeSettings), ("Proxy", ProxySettings)],
)
def test_configuration_tables_list_every_variable_with_its_default_and_meaning(
    heading: str, settings: type[EnvSettings]
):
    rows = dict(re.findall(r"^\| `(KROUTE_\w+)` \| (.*) \|$", section(heading), flags=re.MULTILINE))
    documented = {name: (default, meaning) for name, default, meaning in settings.documentation()}
    assert set(rows) == set(documented)
    for name, (default, meaning) in documented.items():
        assert rows[name] == f"`{default}` | {meaning}"


def test_setup_commands_exist_and_are_executable():
    for command in re.findall(r"^\./(scripts/\w+)", README, flags=re.MULTILINE):
        path = ROOT / command
        assert path.is_file(), command
        assert path.stat().st_mode & 0o111, f"{command} is not executable"


def test_ci_runs_the_readme_test_command():
    assert "exec ./scripts/test" in (ROOT / ".ci" / "run").read_text()
