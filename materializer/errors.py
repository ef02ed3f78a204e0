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
