"""The demo's producer: railway bookings keyed by customer id, written to Kafka at a steady rate.

The seeds' example: a `bookings` topic whose key is the customer id and whose value is one
booking as JSON. Materializers running `materializer.examples.bookings` keep, per customer, the
number of bookings and the latest one, so `GET /stores/bookings/keys/<customer>` answers
{"bookings": 3, "latest": {...}}. A few customers book far more than most (Zipf-like), as real
traffic does. The producer uses librdkafka's murmur2 partitioner, the Java client's default.

python -m kroute.demo        (KROUTE_BOOTSTRAP_SERVERS, KROUTE_TOPIC, KROUTE_DEMO_* settings)
"""

from __future__ import annotations

import itertools
import json
import random
import signal
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from types import FrameType

import structlog
from confluent_kafka import KafkaException, Producer
from pydantic import Field

from common.known_settings import report_unknown_variables
from common.logging import configure_logging
from common.settings import EnvSettings, HostPortList, Name, SettingsError

STATIONS = (
    "Amsterdam Centraal", "Antwerpen-Centraal", "Basel SBB", "Berlin Hbf", "Bruxelles-Midi",
    "Frankfurt (Main) Hbf", "Hamburg Hbf", "Köln Hbf", "London St Pancras", "Lyon Part-Dieu",
    "Milano Centrale", "München Hbf", "Paris Gare de Lyon", "Paris Nord", "Rotterdam Centraal",
    "Strasbourg", "Torino Porta Nuova", "Wien Hbf", "Zürich HB",
)  # fmt: skip
FARE_CLASSES = ("second", "second", "second", "first")


class DemoSettings(EnvSettings):
    bootstrap_servers: HostPortList = Field(description="Kafka bootstrap servers, host:port[,...].")
    topic: Name = Field(default="bookings", description="The topic bookings are written to.")
    demo_customers: int = Field(
        default=5000, ge=1, le=10_000_000, description="How many distinct customers book."
    )
    demo_seed_bookings: int = Field(
        default=3000, ge=0, le=10_000_000, description="Bookings written at once on start."
    )
    demo_rate: float = Field(
        default=20.0, ge=0, le=100_000, description="Bookings a second after the seed (0: stop)."
    )


def customer_id(number: int) -> str:
    return f"customer-{number:06d}"


ZIPF_EXPONENT = 0.9  # with 5,000 customers the most frequent books ~7% of the time


def popular_customers(rng: random.Random, customers: int) -> Iterator[str]:
    """Customer ids, skewed: customer-000001 books most, then -000002, ... (Zipf)."""
    weights = itertools.accumulate(1 / rank**ZIPF_EXPONENT for rank in range(1, customers + 1))
    cumulative = list(weights)
    ranks = range(1, customers + 1)
    while True:
        for rank in rng.choices(ranks, cum_weights=cumulative, k=256):
            yield customer_id(rank)


def booking(rng: random.Random, customer: str, number: int, now: datetime) -> dict[str, object]:
    origin, destination = rng.sample(STATIONS, 2)
    departure = now + timedelta(days=rng.randint(0, 60), minutes=rng.randrange(0, 24 * 60, 5))
    return {
        "booking_id": f"B{number:09d}",
        "customer": customer,
        "from": origin,
        "to": destination,
        "departure": departure.strftime("%Y-%m-%dT%H:%M"),
        "class": rng.choice(FARE_CLASSES),
        "seats": rng.choice((1, 1, 1, 2, 2, 3, 4)),
        "price_eur": round(rng.uniform(19, 249), 2),
        "booked_at": now.isoformat(timespec="seconds"),
    }


class BookingProducer:
    def __init__(self, settings: DemoSettings, seed: int = 7) -> None:
        self.settings = settings
        self._rng = random.Random(seed)
        self._customers = popular_customers(self._rng, settings.demo_customers)
        self._producer = Producer(
            {
                "bootstrap.servers": settings.bootstrap_servers,
                "partitioner": "murmur2_random",  # the Java client's default partitioner
                "linger.ms": 5,
                "message.timeout.ms": 30_000,
            }
        )
        self.sent = 0

    def send(self, count: int) -> None:
        now = datetime.now(UTC)
        for _ in range(count):
            customer = next(self._customers)
            value = booking(self._rng, customer, self.sent, now)
            self._produce(customer.encode(), json.dumps(value).encode())
            self.sent += 1

    def _produce(self, key: bytes, value: bytes) -> None:
        while True:
            try:
                self._producer.produce(self.settings.topic, key=key, value=value)
                return
            except BufferError:  # the local queue is full: let it drain
                self._producer.poll(0.1)

    def flush(self, timeout_s: float = 30) -> int:
        """Waits for delivery; the number of records still undelivered."""
        return int(self._producer.flush(timeout_s))

    def run(self, stop: threading.Event) -> None:
        """The seed at once, then `demo_rate` bookings a second until stop is set."""
        self.send(self.settings.demo_seed_bookings)
        self.flush()
        rate = self.settings.demo_rate
        if rate <= 0:
            return
        interval = 1 / rate
        next_at = time.monotonic()
        while not stop.is_set():
            self.send(1)
            self._producer.poll(0)
            next_at += interval
            stop.wait(max(next_at - time.monotonic(), 0))
        self.flush(5)


def main() -> int:
    try:
        settings = DemoSettings.from_env()
    except SettingsError as exc:
        print(f"kroute demo producer: {exc}", file=sys.stderr)  # before logging is set up
        return 2
    configure_logging(component="demo")
    report_unknown_variables(DemoSettings)
    log = structlog.get_logger("kroute.demo")
    stop = threading.Event()

    def request_stop(_signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        producer = BookingProducer(settings)
        log.info(
            "producing",
            seed_bookings=settings.demo_seed_bookings,
            per_second=settings.demo_rate,
            topic=settings.topic,
            bootstrap_servers=settings.bootstrap_servers,
        )
        producer.run(stop)
    except KafkaException as exc:
        log.error("kafka_refused", error=str(exc))
        return 1
    log.info("stopped", bookings=producer.sent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
