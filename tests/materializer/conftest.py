"""A local SparkSession shared by the materializer tests that run Spark in-process."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from common.java import find_java
from materializer.pipeline import create_spark_session
from materializer.settings import NodeSettings


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    settings = NodeSettings.from_env(
        {
            "KROUTE_BOOTSTRAP_SERVERS": "127.0.0.1:9",
            "KROUTE_TOPIC": "unused",
            "KROUTE_SPARK_MASTER": "local[2]",
            "KROUTE_DATA_DIR": str(tmp_path_factory.mktemp("spark")),
        }
    )
    session = create_spark_session(settings, find_java(os.environ).java_home)
    yield session
    session.stop()
