"""Settings come from KROUTE_* variables; a bad one is named in the error."""

from __future__ import annotations

from pathlib import Path

import pytest

from kroute.settings import RunSettings, SettingsError


def test_defaults_without_any_variable():
    settings = RunSettings.from_env({})
    assert settings.workdir == Path(".run")
    assert settings.broker_storage == "memory://tansu/"
    assert settings.startup_timeout_s == 30.0


def test_values_are_parsed_from_their_variables():
    settings = RunSettings.from_env(
        {"KROUTE_WORKDIR": "/tmp/k", "KROUTE_STARTUP_TIMEOUT_S": "12.5", "UNRELATED": "x"}
    )
    assert settings.workdir == Path("/tmp/k")
    assert settings.startup_timeout_s == 12.5


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("KROUTE_STARTUP_TIMEOUT_S", "soon"),
        ("KROUTE_STARTUP_TIMEOUT_S", "0"),
        ("KROUTE_STARTUP_TIMEOUT_S", "9999"),
        ("KROUTE_BROKER_STORAGE", "file:///tmp/x"),
    ],
)
def test_invalid_value_names_the_variable_and_value(variable, value):
    with pytest.raises(SettingsError, match=rf"{variable}={value!r}"):
        RunSettings.from_env({variable: value})


def test_every_invalid_variable_is_reported_at_once():
    with pytest.raises(SettingsError) as caught:
        RunSettings.from_env({"KROUTE_STARTUP_TIMEOUT_S": "x", "KROUTE_BROKER_STORAGE": "y"})
    assert "KROUTE_STARTUP_TIMEOUT_S" in str(caught.value)
    assert "KROUTE_BROKER_STORAGE" in str(caught.value)


def test_settings_are_frozen():
    settings = RunSettings.from_env({})
    with pytest.raises(ValueError, match="frozen"):
        settings.workdir = Path("/elsewhere")  # type: ignore[misc]


def test_documentation_lists_every_variable():
    rows = RunSettings.documentation()
    assert [row[0] for row in rows] == [
        "KROUTE_WORKDIR",
        "KROUTE_BROKER_STORAGE",
        "KROUTE_STARTUP_TIMEOUT_S",
        "KROUTE_PROXY_PORT",
        "KROUTE_ADMIN_PORT",
        "KROUTE_DEMO_PARTITIONS",
        "KROUTE_DEMO_RATE",
    ]
    assert all(meaning for _, _, meaning in rows)
