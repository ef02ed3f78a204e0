"""A node's settings: required variables, partition lists, and clear errors."""

from __future__ import annotations

import pytest

from common.settings import SettingsError
from materializer.settings import NodeSettings

REQUIRED = {"KROUTE_BOOTSTRAP_SERVERS": "127.0.0.1:9092", "KROUTE_TOPIC": "bookings"}


def test_required_variables_are_named_when_missing():
    with pytest.raises(SettingsError) as caught:
        NodeSettings.from_env({})
    assert "KROUTE_BOOTSTRAP_SERVERS is required" in str(caught.value)
    assert "KROUTE_TOPIC is required" in str(caught.value)


def test_store_name_defaults_to_the_topic():
    assert NodeSettings.from_env(REQUIRED).store_name == "bookings"
    assert (
        NodeSettings.from_env({**REQUIRED, "KROUTE_STORE": "customers"}).store_name == "customers"
    )


@pytest.mark.parametrize(
    ("text", "count", "hosted"),
    [("all", 4, (0, 1, 2, 3)), ("0-2,5", 6, (0, 1, 2, 5)), ("3", 6, (3,)), ("1,1,0", 2, (0, 1))],
)
def test_partition_lists(text, count, hosted):
    settings = NodeSettings.from_env({**REQUIRED, "KROUTE_HOSTED_PARTITIONS": text})
    assert settings.hosted_partitions(count) == hosted


def test_partitions_beyond_the_topic_are_refused_with_the_count():
    settings = NodeSettings.from_env({**REQUIRED, "KROUTE_HOSTED_PARTITIONS": "0-7"})
    with pytest.raises(ValueError, match=r"names partitions \[6, 7\] but the topic has 6"):
        settings.hosted_partitions(6)


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("KROUTE_HOSTED_PARTITIONS", "first"),
        ("KROUTE_KEY_FORMAT", "long"),
        ("KROUTE_PARTITIONER", "default"),
        ("KROUTE_VALUE_FORMAT", "avro"),
        ("KROUTE_PORT", "70000"),
        ("KROUTE_MAX_RECORDS_PER_PARTITION", "0"),
        ("KROUTE_SOURCE", "kafka"),
    ],
)
def test_invalid_values_name_the_variable(variable, value):
    with pytest.raises(SettingsError, match=rf"{variable}={value!r}"):
        NodeSettings.from_env({**REQUIRED, variable: value})
