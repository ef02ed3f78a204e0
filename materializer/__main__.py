"""`python -m materializer`: run one materializer node, configured by KROUTE_* variables.

`python -m materializer --help` lists every setting with its default and meaning.
"""

from __future__ import annotations

import os
import sys

import structlog
import uvloop

from common.java import JavaNotFound, find_java
from common.known_settings import report_unknown_variables
from common.logging import configure_logging, json_stderr, spark_json_logging
from common.settings import SettingsError, help_text
from materializer.errors import StoreError
from materializer.node import Node
from materializer.settings import NodeSettings

USAGE = "python -m materializer  (configured by KROUTE_* environment variables)"
SUMMARY = (
    "Run one materializer node: Spark reads the node's partitions of a Kafka topic into a "
    "RocksDB store, and an HTTP server answers lookups from it."
)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args in (["--help"], ["-h"]):
        print(help_text(NodeSettings, USAGE, SUMMARY), end="")
        return 0
    if args:
        print(f"kroute materializer: unexpected arguments {args}; see --help", file=sys.stderr)
        return 2
    try:
        settings = NodeSettings.from_env()
        java = find_java(os.environ)
    except (SettingsError, JavaNotFound) as exc:
        print(f"kroute materializer: {exc}", file=sys.stderr)
        return 2
    component = f"materializer:{settings.node_id}"
    json_stderr(component)  # before Spark's JVM starts: it inherits stderr
    configure_logging(settings.log_level, component=component)
    report_unknown_variables(NodeSettings)
    log4j = spark_json_logging(settings.data_dir, component)
    structlog.get_logger("kroute.materializer").info(
        "Spark's log4j output: JSON lines on stderr, warnings and up",
        log4j_configuration=str(log4j),
    )
    try:
        node = Node(settings, java)
    except (StoreError, ValueError) as exc:
        print(f"kroute materializer: {exc}", file=sys.stderr)
        return 2
    uvloop.run(node.run())
    return node.exit_code


if __name__ == "__main__":
    sys.exit(main())
