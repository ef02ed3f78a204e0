"""Errors raised by the partitioner; all are ValueErrors about the caller's input.

    PartitionerError(ValueError)
    ├── UnknownAlgorithm        the partitioner name is not one we implement
    ├── InvalidPartitionCount   num_partitions < 1 (or not an int)
    ├── UnknownKeyFormat        the key serializer name is not one we implement
    └── KeyFormatError          this key text cannot be serialized in that format

Each carries what a caller needs to build a precise 4xx answer without parsing the message.
"""

from __future__ import annotations


class PartitionerError(ValueError):
    """Base class: the input to the partitioner or a key serializer is wrong."""


class UnknownAlgorithm(PartitionerError):
    def __init__(self, algorithm: str, known: tuple[str, ...]) -> None:
        self.algorithm = algorithm
        self.known = known
        super().__init__(f"unknown partitioner {algorithm!r}; expected one of {', '.join(known)}")


class InvalidPartitionCount(PartitionerError):
    def __init__(self, num_partitions: object) -> None:
        self.num_partitions = num_partitions
        super().__init__(f"num_partitions must be an integer >= 1, got {num_partitions!r}")


class UnknownKeyFormat(PartitionerError):
    def __init__(self, key_format: str, known: tuple[str, ...]) -> None:
        self.key_format = key_format
        self.known = known
        super().__init__(f"unknown key format {key_format!r}; expected one of {', '.join(known)}")


class KeyFormatError(PartitionerError):
    """The key text is not valid for its format (for example 'abc' as an int32 key)."""

    def __init__(self, key_format: str, key: str, reason: str) -> None:
        self.key_format = key_format
        self.key = key
        self.reason = reason
        super().__init__(f"invalid {key_format} key {key!r}: {reason}")
