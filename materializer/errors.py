"""Errors of the materializer.

MaterializerError(Exception)
├── EndOffsetsError   the broker did not tell us a partition's high watermark
└── StoreError        the store cannot be opened or written
    └── StoreCorrupted  RocksDB found its files damaged: the store is rebuilt from Kafka
"""

from __future__ import annotations


class MaterializerError(Exception):
    """Base class for materializer failures."""


class EndOffsetsError(MaterializerError):
    retriable = True  # a leader change or a broker restart clears it

    def __init__(self, topic: str, partitions: list[int], reason: str) -> None:
        self.topic = topic
        self.partitions = partitions
        self.reason = reason
        super().__init__(f"end offsets of {topic} partitions {partitions}: {reason}")


class StoreError(MaterializerError):
    retriable = False


class StoreCorrupted(StoreError):
    """RocksDB reported corruption on open (damaged or missing files, not a held lock)."""


_TRACEBACK = "Traceback (most recent call last):"


def first_line(exc: BaseException) -> str:
    """An exception as one short line. Spark's carry whole tracebacks (a failed query's, a
    Python worker's, with the query's plan after them): the line that says what happened is
    the exception line of the last Python traceback ("ValueError: poison record"), not the
    first line ("An exception was thrown from the Python worker ...")."""
    text = str(exc).strip()
    if _TRACEBACK in text:
        after = text.rsplit(_TRACEBACK, 1)[1].splitlines()[1:]
        # Frames are indented; the first line that is not is the exception itself.
        raised = next((line for line in after if line.strip() and not line[0].isspace()), None)
        if raised is not None:
            return f"{type(exc).__name__}: {raised.strip()}"[:500]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0]}"[:500] if lines else type(exc).__name__
