"""Steady HTTP load with every outcome kept: for failover, staleness and soak benchmarks.

wrk measures capacity; these benchmarks need something else: a fixed request rate, the outcome
of each request (status, latency, which replica answered, the body when asked), and the
connection it used, so "no request hung for the whole timeout more than once per connection"
can be checked. Each connection is its own keep-alive socket with one request in flight,
paced to its share of the rate; a failed or timed-out connection is replaced. It runs on its
own event loop in a thread, so the caller can kill nodes meanwhile.

Latency is counted from when a request was due, not from when it went out (wrk2's and
HdrHistogram's answer to coordinated omission): each connection keeps a constant-rate schedule,
and when an answer comes late the requests due meanwhile wait for it, then go out back to back,
each timed from its own due time. A user behind a hung connection waits as long; timing from
the actual send would record one slow request and hide the queue behind it. `service_ms` is
the time from the actual send, for questions about one request (did it wait out the timeout?).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

KEPT_HEADERS = (b"x-kroute-node", b"x-kroute-role", b"x-kroute-partition", b"x-kroute-lag")


@dataclass(slots=True)
class Outcome:
    sent_at: float  # when it was due: wall clock, seconds (comparable with other processes)
    latency_ms: float  # from when it was due until its answer (waiting behind others included)
    status: int  # 0: no answer (connection refused, reset or timed out)
    connection: int
    path: str
    label: str
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    service_ms: float = 0.0  # from the actual send until its answer


@dataclass(frozen=True)
class Request:
    path: str
    headers: tuple[tuple[str, str], ...] = ()
    label: str = ""  # groups outcomes in reports, e.g. the lag budget asked for


class SteadyLoad:
    """GETs at `rate` per second over `connections` connections until `stop()`."""

    def __init__(
        self,
        host: str,
        port: int,
        requests: Iterator[Request],
        *,
        rate: float,
        connections: int = 8,
        timeout_s: float = 10.0,
        keep_body: bool = False,
    ) -> None:
        self._host, self._port = host, port
        self._requests = requests
        self._interval = connections / rate
        self._connections = connections
        self._timeout_s = timeout_s
        self._keep_body = keep_body
        self._lock = threading.Lock()
        self.outcomes: list[Outcome] = []
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="steady-load", daemon=True)

    def start(self) -> SteadyLoad:
        self._thread.start()
        return self

    def stop(self) -> list[Outcome]:
        self._stopping.set()
        self._thread.join(self._timeout_s + 5)
        with self._lock:
            return list(self.outcomes)

    def snapshot(self) -> list[Outcome]:
        with self._lock:
            return list(self.outcomes)

    def _next_request(self) -> Request:
        with self._lock:
            return next(self._requests)

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        start = time.monotonic()
        wall_minus_monotonic = time.time() - start
        workers = [
            self._connection(
                i, start + i * self._interval / self._connections, wall_minus_monotonic
            )
            for i in range(self._connections)
        ]
        await asyncio.gather(*workers)

    async def _connection(self, number: int, first_at: float, wall_offset: float) -> None:
        streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        due = first_at
        while not self._stopping.is_set():
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            if self._stopping.is_set():
                break
            request = self._next_request()
            began = time.monotonic()
            try:
                if streams is None:
                    streams = await asyncio.wait_for(
                        asyncio.open_connection(self._host, self._port), self._timeout_s
                    )
                status, headers, body, keep = await asyncio.wait_for(
                    self._exchange(streams, request), self._timeout_s
                )
                if not keep:
                    streams[1].close()
                    streams = None
            except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError):
                status, headers, body = 0, {}, b""
                if streams is not None:
                    streams[1].close()
                streams = None
            answered = time.monotonic()
            outcome = Outcome(
                due + wall_offset,
                (answered - due) * 1000,
                status,
                number,
                request.path,
                request.label,
                headers,
                body if self._keep_body else b"",
                service_ms=(answered - began) * 1000,
            )
            with self._lock:
                self.outcomes.append(outcome)
            # The schedule never slips: requests due while this one was late are sent next,
            # back to back, and their wait counts in their latency.
            due += self._interval
        if streams is not None:
            streams[1].close()

    async def _exchange(
        self, streams: tuple[asyncio.StreamReader, asyncio.StreamWriter], request: Request
    ) -> tuple[int, dict[str, str], bytes, bool]:
        reader, writer = streams
        extra = "".join(f"{name}: {value}\r\n" for name, value in request.headers)
        writer.write(
            f"GET {request.path} HTTP/1.1\r\nHost: {self._host}\r\n{extra}\r\n".encode("latin-1")
        )
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        fields = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            fields[name.strip().lower()] = value.strip()
        if fields.get(b"transfer-encoding", b"").lower() == b"chunked":
            body = await _read_chunked(reader)
        else:
            body = await reader.readexactly(int(fields.get(b"content-length", b"0")))
        kept = {name.decode(): fields[name].decode() for name in KEPT_HEADERS if name in fields}
        return status, kept, body, fields.get(b"connection", b"").lower() != b"close"


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)


def cycle_requests(paths: list[str], make: Callable[[str], Request] = Request) -> Iterator[Request]:
    return (make(path) for path in itertools.cycle(paths))


def percentile(values: list[float], q: float) -> float | None:
    """The value at quantile `q` (the rank below, no interpolation), to 0.1; None if none."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


def latency_figures(latencies: list[float]) -> dict[str, float | None]:
    """p50, p99 and max of latencies in ms (None where there are none), as reports show them."""
    return {
        "p50_ms": percentile(latencies, 0.5),
        "p99_ms": percentile(latencies, 0.99),
        "max_ms": round(max(latencies), 1) if latencies else None,
    }


def failures(outcomes: list[Outcome]) -> list[Outcome]:
    """The outcomes that were not a 200 (no answer at all included)."""
    return [o for o in outcomes if o.status != 200]


def failures_by_status(outcomes: list[Outcome]) -> dict[str, int]:
    """How many of the outcomes failed with each status ("0": no answer)."""
    return dict(Counter(str(o.status) for o in failures(outcomes)))
