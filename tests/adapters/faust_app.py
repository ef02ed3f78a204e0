"""A small Faust app written the way Faust's docs write them: one worker per process.

An agent counts the records of a keyed topic in a table with one standby replica; each worker's
web view answers a lookup by key through `app.table_route`, Faust's own forwarding to the
worker that owns the key's partition. The view's answer names the worker that computed it and
echoes the request's `x-request-id`, and `/counters/` says how many lookups this worker forwarded
to another one (Faust's forwarding drops the owner's headers, so the counters are the proof).

Configured from the environment (FAUST_APP_ID, FAUST_BROKER, FAUST_TOPIC, FAUST_PARTITIONS,
FAUST_WEB_PORT, FAUST_DATADIR); run with `python -m tests.adapters.faust_app`.
"""

from __future__ import annotations

import os
from typing import Any

import faust
from faust.web import Request, Response, View

APP_ID = os.environ.get("FAUST_APP_ID", "kroute-faust-test")
PORT = int(os.environ.get("FAUST_WEB_PORT", "6066"))
PARTITIONS = int(os.environ.get("FAUST_PARTITIONS", "6"))
WORKER = f"127.0.0.1:{PORT}"

app = faust.App(
    APP_ID,
    broker=f"kafka://{os.environ.get('FAUST_BROKER', '127.0.0.1:9092')}",
    store="memory://",
    datadir=os.environ.get("FAUST_DATADIR", f"/tmp/{APP_ID}-{PORT}"),
    web_host="127.0.0.1",
    web_port=PORT,
    canonical_url=f"http://{WORKER}",
    web_stats_enabled=True,  # serves /assignment/: this worker's actives and standbys
    table_standby_replicas=1,
    topic_partitions=PARTITIONS,
    # A killed worker leaves the group after this long; Faust's default (60 s) makes tests slow.
    broker_session_timeout=6.0,
    broker_heartbeat_interval=1.0,
    broker_commit_interval=0.5,
)

lookups = app.topic(
    os.environ.get("FAUST_TOPIC", "faust-events"),
    key_type=str,
    value_type=str,
    # JSON keys, as the table writes them: the record lands in the partition `table_route`
    # (and kroute) compute for the key, so the table partition holding it is that one.
    key_serializer="json",
    partitions=PARTITIONS,
)
counts = app.Table("counts", default=int, partitions=PARTITIONS)
forwarded = {"arrived": 0, "served_here": 0}


@app.agent(lookups)
async def count(stream: Any) -> None:
    async for key, _value in stream.items():
        counts[key] += 1


def _counting_arrivals(handler: Any) -> Any:
    """Outermost: every lookup this worker received, whoever ends up answering it."""

    async def arrived(view: View, request: Request, key: str) -> Response:
        forwarded["arrived"] += 1
        return await handler(view, request, key=key)

    return arrived


@app.page("/count/{key}/")
@_counting_arrivals
@app.table_route(table=counts, match_info="key")
async def get_count(web: View, request: Request, key: str) -> Response:
    forwarded["served_here"] += 1  # reached only when table_route did not forward
    return web.json(
        {
            "key": key,
            "count": counts[key],
            "worker": WORKER,
            "request_id": request.headers.get("x-request-id"),
        },
        headers={"x-faust-worker": WORKER},
    )


@app.page("/counters/")
async def get_counters(web: View, _request: Request) -> Response:
    return web.json({**forwarded, "forwarded": forwarded["arrived"] - forwarded["served_here"]})


if __name__ == "__main__":
    faust.Worker(app, loglevel="info").execute_from_commandline()
