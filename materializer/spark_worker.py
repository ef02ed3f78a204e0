"""What a node changes in Spark's Python workers, the processes that run the source's read().

Python 3.10 and 3.11 re-read the whole directory of every zip archive on `sys.path` each time
`importlib.invalidate_caches()` runs (CPython gh-103200; lazy again from 3.12). PySpark's worker
calls it at the start of every task, and Spark puts `pyspark.zip` (1,328 entries), the py4j zip
and the spark-core jar on the worker's path. With one task per micro-batch and a trickle of
writes (~4 batches a second), re-reading archives that never change took 68% of the worker's CPU
(py-spy): the worker used 0.41 cores, and 0.12 with this change.

`skip_unchanged_archive_rereads` makes a zip importer re-read its archive only when the file's
size or modification time changed since it last read it, so a changed archive is still seen.
"""

from __future__ import annotations

import os
import sys
import zipimport
from collections.abc import Callable
from typing import Any

_SIGNATURE = "_kroute_archive_signature"
_installed = False


def skip_unchanged_archive_rereads() -> None:
    """Install the check in this process (idempotent; nothing to do on Python 3.12+)."""
    global _installed  # noqa: PLW0603 - one patch per process
    if _installed or sys.version_info >= (3, 12):
        return
    zipimport.zipimporter.invalidate_caches = _reread_if_changed(  # type: ignore[method-assign, assignment]
        zipimport.zipimporter.invalidate_caches
    )
    _installed = True


def _reread_if_changed(reread: Callable[[Any], None]) -> Callable[[Any], None]:
    def invalidate_caches(importer: Any) -> None:
        signature = _archive_signature(importer.archive)
        if signature is not None and getattr(importer, _SIGNATURE, None) == signature:
            return
        reread(importer)
        setattr(importer, _SIGNATURE, signature)

    return invalidate_caches


def _archive_signature(path: str) -> tuple[int, int, int] | None:
    try:
        status = os.stat(path)
    except OSError:
        return None  # gone: let zipimport find out and forget it
    return (status.st_ino, status.st_size, status.st_mtime_ns)
