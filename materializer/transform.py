"""What a micro-batch becomes before it reaches the store: decoding checks and the transform.

Every record first gets a `problem` column, computed in Spark (no Python per record): null when
the record can be materialized, else why not (null key, invalid UTF-8, invalid JSON). Problem
records are counted, logged with partition and offset, and skipped; they still advance the
partition's checkpoint, so one bad record never stops or stalls the pipeline.

The default transform is the KTable: every record as it is. The store applies a partition's
records in offset order, so the latest value per key wins and a null value deletes the key —
without a per-batch shuffle in Spark (a groupBy per micro-batch measured ~2x slower batches).

A custom transform is `module:function`, taking the batch's valid records (Spark's Kafka
schema) and returning a DataFrame with columns `partition`, `key`, `value` (binary; null
deletes), `offset` (the newest source offset behind the row) and `timestamp`. It must keep each
row in its record's partition under its record's key: the proxy routes by the key's partition.
Rows are merged with what the store holds by `merge` (module:function, default: replace), as
the bookings example does to keep running counts. See materializer/examples/bookings.py.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F  # noqa: N812 - Spark's own convention

from materializer.store import Merge, replace_value

VALUE_FORMATS = ("json", "string", "bytes")
CHANGE_COLUMNS = ("partition", "key", "value", "offset", "timestamp_ms")

SparkTransform = Callable[[DataFrame], DataFrame]


@dataclass(frozen=True)
class RecordRules:
    """What a record must be to be materialized; anything else is skipped, counted, logged."""

    value_format: str = "json"
    key_format: str = "string"
    max_value_bytes: int = 8 * 1024 * 1024


_CANONICAL_UUID = "^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"
_FIXED_KEY_BYTES = {"int32": 4, "int64": 8}


def problem_column(rules: RecordRules) -> Column:
    """Null when the record can be materialized, else a short reason.

    A key that the lookup side could never produce (not UTF-8 for string keys, not 8 bytes
    for int64, not the UUIDSerializer's lower-case text) would sit in the store unreachable,
    so it is a problem, not a row."""
    key, value = F.col("key"), F.col("value")
    problem = F.when(key.isNull(), F.lit("null key"))
    if rules.key_format in ("string", "uuid"):
        problem = problem.when(~F.is_valid_utf8(key), F.lit("key is not valid UTF-8"))
    if rules.key_format == "uuid":
        problem = problem.when(
            ~key.cast("string").rlike(_CANONICAL_UUID), F.lit("key is not a lower-case UUID")
        )
    if rules.key_format in _FIXED_KEY_BYTES:
        size = _FIXED_KEY_BYTES[rules.key_format]
        problem = problem.when(
            F.octet_length(key) != size,
            F.lit(f"key is not {size} bytes ({rules.key_format})"),
        )
    problem = problem.when(
        value.isNotNull() & (F.octet_length(value) > rules.max_value_bytes),
        F.concat(
            F.lit("value is "),
            F.octet_length(value).cast("string"),
            F.lit(f" bytes, over KROUTE_MAX_VALUE_BYTES={rules.max_value_bytes}"),
        ),
    )
    if rules.value_format in ("json", "string"):
        problem = problem.when(
            value.isNotNull() & ~F.is_valid_utf8(value), F.lit("value is not valid UTF-8")
        )
    if rules.value_format == "json":
        problem = problem.when(
            value.isNotNull() & F.try_parse_json(value.cast("string")).isNull(),
            F.lit("value is not valid JSON"),
        )
    return problem


def with_problems(records: DataFrame, rules: RecordRules) -> DataFrame:
    return records.withColumn("problem", problem_column(rules)).withColumn(
        "timestamp_ms", F.unix_millis("timestamp")
    )


def as_changes(rows: DataFrame) -> DataFrame:
    """The columns the sink reads, in its order (timestamp as epoch milliseconds)."""
    if "timestamp_ms" not in rows.columns:
        rows = rows.withColumn("timestamp_ms", F.unix_millis("timestamp"))
    return rows.select(*CHANGE_COLUMNS)


@dataclass(frozen=True)
class Transform:
    """How valid records become store changes; `function` None is the KTable."""

    name: str
    function: SparkTransform | None
    merge: Merge

    @property
    def is_ktable(self) -> bool:
        return self.function is None


KTABLE = Transform("ktable", None, replace_value)


def load_callable(spec: str) -> Callable[..., Any]:
    """`package.module:function` -> the function, with an error that says what is missing."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"{spec!r} is not of the form package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name!r} for {spec!r}: {exc}") from exc
    try:
        found = getattr(module, attribute)
    except AttributeError:
        raise ValueError(f"{module_name!r} has no {attribute!r} (from {spec!r})") from None
    if not callable(found):
        raise ValueError(f"{spec!r} is not callable")
    return found  # type: ignore[no-any-return]


def load_transform(function_spec: str | None, merge_spec: str | None) -> Transform:
    if not function_spec:
        if merge_spec:
            raise ValueError("a merge function needs a transform function too")
        return KTABLE
    merge = load_callable(merge_spec) if merge_spec else replace_value
    return Transform(function_spec, load_callable(function_spec), merge)
