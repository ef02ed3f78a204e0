"""Traffic for the fault tests: a writer that keeps changing the topic, readers that keep asking.

Readers keep every outcome (status, latency, answer), so a test can say afterwards what failed,
what hung and whether what was served was right.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import httpx
from confluent_kafka import KafkaError, Message

from kroute.cluster_harness import keyed_producer

ANSWERED = (200, 404)  # a value, or "no such key": both are answers, not failures


@dataclass(slots=True)
class Write:
    """One record the writer produced: its number (in its value, `{"write": n}`), whether it
    was a tombstone, when produce() was called and when the broker acknowledged it
    (time.monotonic(); None until then, and for ever if it failed)."""

    n: int
    deleted: bool
    sent_at: float
    acked_at: float | None = None


class Writer:
    """Updates and deletes (tombstones) of `keys` at about `rate` records a second. It keeps
    every key's writes in order (`history`), so a reader's answer can be judged by the writes
    it does not show yet (`tests.reliability.truth.true_staleness_s`)."""

    def __init__(self, bootstrap: str, topic: str, keys: list[str], rate: float = 40) -> None:
        self._producer = keyed_producer(bootstrap, linger_ms=5)
        self._topic, self._keys, self._interval = topic, keys, 1 / rate
        self._lock = threading.Lock()
        self.history: dict[str, list[Write]] = defaultdict(list)
        self._running = threading.Event()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self.written = 0
        # (partition, offset) -> (key, value) of each delivered record: the truth check asks the
        # topic to hold each at the offset the broker gave it (nothing lost in a broker restart).
        self.acknowledged: dict[tuple[int, int], tuple[bytes | None, bytes | None]] = {}
        self._thread = threading.Thread(target=self._run, name="writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        chooser = random.Random(7)
        while not self._stop.is_set():
            if not self._running.wait(0.1):
                self._idle.set()
                continue
            self._idle.clear()
            self._write(chooser.choice(self._keys), deleted=chooser.random() < 0.2)
            # Serving delivery reports while waiting stamps each acknowledgement when it comes
            # (poll returns early when it served one: wait out the interval).
            next_at = time.monotonic() + self._interval
            while (left := next_at - time.monotonic()) > 0:
                self._producer.poll(left)

    def _write(self, key: str, *, deleted: bool) -> None:
        write = Write(self.written, deleted, time.monotonic())
        value = None if deleted else json.dumps({"write": write.n}).encode()
        with self._lock:
            self.history[key].append(write)

        def delivered(error: KafkaError | None, message: Message) -> None:
            # A failed record may or may not be in the topic: no claim either way.
            if error is None:
                write.acked_at = time.monotonic()
                self.acknowledged[(message.partition(), message.offset())] = (
                    message.key(),
                    message.value(),
                )

        self._producer.produce(self._topic, key=key.encode(), value=value, on_delivery=delivered)
        self._producer.poll(0)
        self.written += 1

    def writes_to(self, key: str) -> list[Write]:
        with self._lock:
            return list(self.history.get(key, ()))

    def write_to(self, keys: list[str]) -> None:
        """From now on write only to `keys` (a few hot keys change often enough for a stale
        replica to show within seconds)."""
        self._keys = keys

    def resume(self) -> None:
        self._running.set()

    def pause(self) -> None:
        """Stop writing and wait until everything written is in the topic."""
        self._running.clear()
        self._idle.wait(5)
        # Generous: on a loaded machine the broker has taken over 30 s to acknowledge a few
        # seconds of writes; librdkafka fails a record only after message.timeout.ms (5 min).
        left = self._producer.flush(120)
        assert left == 0, f"{left} of {self.written} records not delivered in 120 s"

    def close(self) -> None:
        self.pause()
        self._stop.set()
        self._thread.join(5)


@dataclass(frozen=True, slots=True)
class Outcome:
    at: float  # time.monotonic() when sent
    key: str
    status: int  # 0: no HTTP answer at all
    latency_s: float
    answer: Any  # the JSON body (a 200's carries the value and where it came from), or the error


class Readers:
    """`threads` loops of keyed GETs through the proxy at `url`, until stopped."""

    def __init__(
        self,
        url: str,
        keys: list[str],
        threads: int = 2,
        headers: dict[str, str] | None = None,
        timeout_s: float = 5,
    ) -> None:
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(
                target=self._run, args=(url, keys, i, headers or {}, timeout_s), daemon=True
            )
            for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def _run(
        self, url: str, keys: list[str], seed: int, headers: dict[str, str], timeout_s: float
    ) -> None:
        chooser = random.Random(seed)
        with httpx.Client(base_url=url, timeout=timeout_s, headers=headers) as client:
            while not self._stop.is_set():
                key = chooser.choice(keys)
                started = time.monotonic()
                try:
                    response = client.get(f"/stores/customers/keys/{key}")
                except httpx.HTTPError as exc:
                    outcome = Outcome(started, key, 0, time.monotonic() - started, repr(exc))
                else:
                    outcome = Outcome(
                        started,
                        key,
                        response.status_code,
                        time.monotonic() - started,
                        response.json(),
                    )
                self.outcomes.append(outcome)

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)
        return self.outcomes


def failures(outcomes: list[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if o.status not in ANSWERED]
