"""Per-customer booking summary: how many bookings, and the latest one.

The railway example from the seeds: a `bookings` topic keyed by customer id, each value a JSON
booking. Configure a node with

    KROUTE_TRANSFORM=materializer.examples.bookings:booking_summary
    KROUTE_MERGE=materializer.examples.bookings:merge_summary

and `GET /stores/<store>/keys/<customer>` answers {"bookings": 12, "latest": {...booking...}}.
A tombstone (null value) deletes the customer's summary.
"""

from __future__ import annotations

import json

from pyspark.sql import DataFrame
from pyspark.sql import functions as F  # noqa: N812 - Spark's own convention


def booking_summary(records: DataFrame) -> DataFrame:
    """Per customer in this micro-batch: the bookings since the last tombstone, and the latest."""
    newest = F.max_by(F.struct("value", "offset", "timestamp"), "offset")
    last_delete = F.max(F.when(F.col("value").isNull(), F.col("offset")))
    per_key = records.groupBy("partition", "key").agg(
        newest.alias("newest"),
        last_delete.alias("last_delete"),
        F.collect_list(F.struct("offset", F.col("value").isNull().alias("deleted"))).alias(
            "events"
        ),
    )
    counted = per_key.withColumn(
        "bookings",
        F.size(
            F.filter(
                "events",
                lambda e: (
                    (~e["deleted"])
                    & (F.col("last_delete").isNull() | (e["offset"] > F.col("last_delete")))
                ),
            )
        ),
    )
    summary = F.when(F.col("newest.value").isNull(), F.lit(None)).otherwise(
        F.concat(
            F.lit('{"bookings":'),
            F.col("bookings").cast("string"),
            F.lit(',"latest":'),
            F.col("newest.value").cast("string"),
            # Marks a summary that starts after a delete, so merge does not add old counts.
            F.when(F.col("last_delete").isNotNull(), F.lit(',"reset":true')).otherwise(F.lit("")),
            F.lit("}"),
        ).cast("binary")
    )
    return counted.select(
        "partition",
        "key",
        summary.alias("value"),
        F.col("newest.offset").alias("offset"),
        F.col("newest.timestamp").alias("timestamp"),
    )


def merge_summary(previous: bytes | None, new: bytes | None) -> bytes | None:
    """Add this batch's count to the stored one; the latest booking is the newer one."""
    if new is None:
        return None
    batch = json.loads(new)
    total = batch["bookings"]
    if previous is not None and not batch.pop("reset", False):
        total += json.loads(previous)["bookings"]
    batch.pop("reset", None)
    return json.dumps(
        {"bookings": total, "latest": batch["latest"]}, separators=(",", ":")
    ).encode()
