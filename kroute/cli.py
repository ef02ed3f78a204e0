"""The `kroute` command: run the product locally, check Java, compute a key's partition.

kroute run                          start the embedded services; Ctrl-C stops them
kroute partition KEY -n 12          the partition a producer wrote KEY to
kroute check-java                   is there a Java 17+ for Spark?
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Sequence
from types import FrameType

from common.java import JavaNotFound, JavaRuntime, find_java
from kroute.embedded import EmbeddedServices
from kroute.errors import KrouteError
from kroute.settings import RunSettings, SettingsError
from partitioner import ALGORITHMS, KEY_FORMATS, PartitionerError, partition, serialize_key

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def say(message: str = "") -> None:
    print(message, flush=True)


def command_check_java(_args: argparse.Namespace) -> int:
    runtime = find_java(os.environ)
    say(f"Java {runtime.major} from {runtime.source}: {runtime.java}")
    return EXIT_OK


def command_partition(args: argparse.Namespace) -> int:
    key_bytes = serialize_key(args.key, args.key_format)
    chosen = partition(key_bytes, args.partitions, args.algorithm)
    say(f"{chosen}")
    if args.verbose:
        say(f"key bytes (hex): {key_bytes.hex()}")
        say(f"format={args.key_format} algorithm={args.algorithm} partitions={args.partitions}")
    return EXIT_OK


class _StopRequested(Exception):
    """Raised from the SIGTERM handler so shutdown runs the same path as Ctrl-C."""


def _raise_stop(signum: int, _frame: FrameType | None) -> None:
    raise _StopRequested(signal.Signals(signum).name)


def command_run(_args: argparse.Namespace) -> int:
    settings = RunSettings.from_env()
    say("kroute: checking Java for Spark ...")
    java = find_java(os.environ)
    say(f"  Java {java.major} ({java.source}: {java.java})")
    signal.signal(signal.SIGTERM, _raise_stop)
    with EmbeddedServices(
        settings.workdir, startup_timeout_s=settings.startup_timeout_s
    ) as services:
        try:
            say("kroute: starting the Kafka broker (Tansu) ...")
            broker = services.start_broker(settings.broker_storage)
            say("kroute: starting redis-server ...")
            redis_server = services.start_redis()
            _print_endpoints(broker.bootstrap_servers, redis_server.url, java, settings)
            _watch_until_stopped(services)
        except (KeyboardInterrupt, _StopRequested):
            say("\nkroute: stopping everything it started ...")
    say("kroute: stopped.")
    return EXIT_OK


def _print_endpoints(
    bootstrap: str, redis_url: str, java: JavaRuntime, settings: RunSettings
) -> None:
    say()
    say("kroute is up (embedded services, all on 127.0.0.1):")
    say(f"  Kafka bootstrap servers : {bootstrap}   (Tansu, storage {settings.broker_storage})")
    say(f"  Redis                   : {redis_url}")
    say(f"  Java for Spark          : {java.java_home}")
    say(f"  logs                    : {settings.workdir.resolve()}/")
    say()
    say("Try, in another terminal:")
    say("  .venv/bin/kroute partition customer-42 --partitions 12")
    say("  .venv/bin/kroute partition 42 --key-format int64 --partitions 12 --verbose")
    say(f"  redis-cli -u {redis_url} ping")
    say()
    say("Press Ctrl-C to stop.")


def _watch_until_stopped(services: EmbeddedServices) -> None:
    while True:
        for process in services.processes:
            if not process.is_running():
                code = process.popen.returncode
                raise KrouteError(
                    f"{process.name} (pid {process.pid}) exited with code {code}; "
                    f"its log ends with:\n{process.log_tail()}"
                )
        time.sleep(1.0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kroute", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    commands.add_parser("run", help="start kroute locally; Ctrl-C stops it").set_defaults(
        handler=command_run
    )
    commands.add_parser("check-java", help="find a Java 17+ runtime for Spark").set_defaults(
        handler=command_check_java
    )

    part = commands.add_parser("partition", help="the partition a producer wrote a key to")
    part.add_argument("key", help="the key as text (see --key-format)")
    part.add_argument(
        "-n", "--partitions", type=int, required=True, help="the topic's partition count"
    )
    part.add_argument("-f", "--key-format", choices=KEY_FORMATS, default="string")
    part.add_argument("-a", "--algorithm", choices=ALGORITHMS, default="murmur2")
    part.add_argument("-v", "--verbose", action="store_true", help="also print the key's bytes")
    part.set_defaults(handler=command_partition)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except (SettingsError, PartitionerError) as exc:
        print(f"kroute: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (JavaNotFound, KrouteError) as exc:
        print(f"kroute: {exc}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
