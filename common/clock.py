"""Wall-clock milliseconds: the unit of every time the Redis contract and the reports carry."""

from __future__ import annotations

import time


def now_ms() -> int:
    return int(time.time() * 1000)
