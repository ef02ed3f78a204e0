"""The `kroute` command: run the product locally, check Java, compute a key's partition.

kroute run [--failover]             start the whole product with demo data; Ctrl-C stops it
kroute node                         run one materializer node (--help: its KROUTE_* settings)
kroute proxy                        run the proxy (--help: its KROUTE_* settings)
kroute partition KEY -n 12          the partition a producer wrote KEY to
kroute check-java                   is there a Java 17+ for Spark?
kroute adapt faust --worker URL ...  put kroute in front of a Faust app (docs/faust.md)
kroute adapt fixed --placement FILE  a service whose placement is fixed (docs/existing-services.md)
kroute contract check --redis URL    what is wrong with the keys a writer put in Redis
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

from common.java import JavaNotFound, JavaRuntime, find_java
from common.known_settings import unknown_variables
from common.settings import EnvSettings, help_text
from kroute import contract_check
from kroute.adapters import faust as faust_adapter
from kroute.adapters import fixed as fixed_adapter
from kroute.embedded import EmbeddedServices
from kroute.errors import KrouteError, UsageError
from kroute.product import SAMPLE_CUSTOMERS, Product, failover_demo, start_product
from kroute.settings import RunSettings, SettingsError
from materializer.settings import NodeSettings
from partitioner import ALGORITHMS, KEY_FORMATS, PartitionerError, partition, serialize_key
from proxy.settings import ProxySettings

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


def command_run(args: argparse.Namespace) -> int:
    settings = RunSettings.from_env()
    _warn_about_variables()
    say("kroute: checking Java for Spark ...")
    java = find_java(os.environ)
    say(f"  Java {java.major} ({java.source}: {java.java})")
    signal.signal(signal.SIGTERM, _raise_stop)
    with EmbeddedServices(
        settings.workdir, startup_timeout_s=settings.startup_timeout_s
    ) as services:
        try:
            product = start_product(services, settings, java, say)
            _print_product(product, java, settings)
            if args.failover:
                failover_demo(product, say)
                say("")
                say("Still running on the survivors. Press Ctrl-C to stop.")
            _watch_until_stopped(product)
        except (KeyboardInterrupt, _StopRequested):
            say("\nkroute: stopping everything it started ...")
    say("kroute: stopped.")
    return EXIT_OK


def _warn_about_variables() -> None:
    """KROUTE_* names nothing reads (typos) and old names, said before anything starts."""
    for entry in unknown_variables(os.environ):
        meant = f" (did you mean {entry.closest}?)" if entry.closest else ""
        say(f"kroute: warning: no kroute component reads {entry.variable}{meant}")
    for old, new in RunSettings.deprecated_in(os.environ):
        say(f"kroute: warning: {old} is deprecated here; use {new}")


def _print_product(product: Product, java: JavaRuntime, settings: RunSettings) -> None:
    proxy = product.proxy
    say("")
    say("kroute is up (all on 127.0.0.1):")
    say(f"  proxy (lookups)         : {proxy.url}")
    say(f"  cluster status page     : {product.status_page}")
    say(f"  metrics                 : {proxy.admin_url}/metrics")
    for name, node in product.nodes.items():
        say(f"  materializer {name}          : {node.url}")
    say(f"  Kafka bootstrap servers : {product.broker.bootstrap_servers}   (topic bookings)")
    say(f"  Redis                   : {product.redis_server.url}")
    say(f"  Java for Spark          : {java.java_home}")
    say(f"  logs                    : {settings.workdir.resolve()}/")
    say("")
    say("The demo producer writes railway bookings keyed by customer id; each lookup answers")
    say("that customer's booking count and latest booking. Try, in another terminal:")
    for customer in SAMPLE_CUSTOMERS[:3]:
        say(f"  curl -si {product.lookup_url(customer)}")
    say(f"  curl -s -H 'x-kroute-max-lag: 0' {product.lookup_url(SAMPLE_CUSTOMERS[3])}")
    say(f"  curl -s {proxy.admin_url}/cluster/status")
    say("The x-kroute-node, -partition, -role and -lag headers say who answered and how fresh.")
    say("To see a node die and standbys take over: ./scripts/run --failover")
    say("")
    say("Press Ctrl-C to stop.")


def _watch_until_stopped(product: Product) -> None:
    while True:
        product.check_running()
        time.sleep(1.0)


def command_component(args: argparse.Namespace) -> int:
    """Become the component's own entry point (same process, same exit code)."""
    os.execv(sys.executable, [sys.executable, "-m", args.module])  # noqa: S606 - fixed argv


# Components `kroute` starts: (module, settings class, summary for --help).
COMPONENTS: dict[str, tuple[str, type[EnvSettings], str]] = {
    "node": (
        "materializer",
        NodeSettings,
        "Run one materializer node: Spark reads the node's partitions of a Kafka topic into a "
        "RocksDB store, and an HTTP server answers lookups from it.",
    ),
    "proxy": (
        "proxy",
        ProxySettings,
        "Run the partition-aware proxy: each keyed request goes to the node that holds its "
        "partition (or a standby inside the lag budget).",
    ),
}


def _add_component_commands(commands: Any) -> None:
    for name, (module, settings, summary) in COMPONENTS.items():
        usage = f"kroute {name}  (configured by KROUTE_* environment variables)"
        command = commands.add_parser(
            name,
            help=summary.split(":")[0].lower(),
            usage=usage,
            description=help_text(settings, usage, summary).split("\n", 2)[2],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        command.set_defaults(handler=command_component, module=module)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kroute", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="start the whole product locally; Ctrl-C stops it")
    run.add_argument(
        "--failover",
        action="store_true",
        help="once up, kill -9 one node and show lookups answered by standbys",
    )
    run.set_defaults(handler=command_run)
    _add_component_commands(commands)
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

    adapt = commands.add_parser("adapt", help="publish an existing service's placement in Redis")
    adapters = adapt.add_subparsers(dest="adapter", required=True)
    faust_adapter.add_command(adapters)
    fixed_adapter.add_command(adapters)
    contract_check.add_command(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except (SettingsError, PartitionerError, UsageError) as exc:
        print(f"kroute: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (JavaNotFound, KrouteError) as exc:
        print(f"kroute: {exc}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
