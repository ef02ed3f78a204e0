"""`python -m materializer`: run one materializer node, configured by KROUTE_* variables."""

from __future__ import annotations

import os
import sys

import uvloop

from common.java import JavaNotFound, find_java
from common.logging import configure_logging
from common.settings import SettingsError
from materializer.errors import StoreError
from materializer.node import Node
from materializer.settings import NodeSettings


def main() -> int:
    try:
        settings = NodeSettings.from_env()
        java = find_java(os.environ)
    except (SettingsError, JavaNotFound) as exc:
        print(f"kroute materializer: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, component=f"materializer:{settings.node_id}")
    try:
        node = Node(settings, java)
    except (StoreError, ValueError) as exc:
        print(f"kroute materializer: {exc}", file=sys.stderr)
        return 2
    uvloop.run(node.run())
    return node.exit_code


if __name__ == "__main__":
    sys.exit(main())
