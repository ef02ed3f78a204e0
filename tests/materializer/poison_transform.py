"""Transforms that fail, for tests: on one record (a bug the data sets off), or on every batch
while a flag file exists (a broken deploy). A node imports them as
`tests.materializer.poison_transform:<name>` with the repository on its PYTHONPATH."""

from __future__ import annotations

import os
from pathlib import Path

from pyspark.sql import DataFrame
from pyspark.sql import functions as F  # noqa: N812 - Spark's own convention
from pyspark.sql.types import BinaryType

POISON = b'{"poison": true}'
# Not KROUTE_*: nodes are started with our environment minus KROUTE_* plus their settings.
BROKEN_FLAG = "POISON_TRANSFORM_BROKEN_FLAG"


def _checked(value: bytes | None) -> bytes | None:
    if value == POISON:
        raise ValueError("poison record")
    return value


def fails_on_poison(records: DataFrame) -> DataFrame:
    """The KTable, through a Python UDF that raises on the poison value."""
    checked = F.udf(_checked, BinaryType(), useArrow=False)  # plain rows: no type inference
    return records.select(
        "partition", "key", checked("value").alias("value"), "offset", "timestamp"
    )


def broken_while_flagged(records: DataFrame) -> DataFrame:
    """fails_on_poison, but every batch fails (even an empty one) while the flag file exists."""
    flag = os.environ.get(BROKEN_FLAG)
    if flag and Path(flag).exists():
        raise RuntimeError("transform broken by a bad deploy")
    return fails_on_poison(records)
