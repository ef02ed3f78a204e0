"""Kafka-exact partitioning: which partition a producer wrote a key to.

`partition(key, n, algorithm)` takes the serialized key bytes; `KeyPartitioner` takes key text
for one route, with the serializer and hash resolved once and results cached, for the proxy's
request path. This package is a pure leaf: it imports only the standard library and mmh3.

Algorithms (`ALGORITHMS`):
- `murmur2`: Kafka's Java client, `toPositive(murmur2(key)) % n` (BuiltInPartitioner,
  formerly DefaultPartitioner); also librdkafka's `murmur2` / `murmur2_random`.
- `crc32`: librdkafka's `consistent` / `consistent_random` (and Sarama's CRC partitioner).
- `fnv1a`: librdkafka's `fnv1a` / `fnv1a_random`, which Go Sarama's default hash partitioner
  matches.
- `murmur3`: murmur3_x86_32 (seed 0) via mmh3 & 0x7fffffff, for custom partitioners. This is
  *not* what any Kafka client does by default.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from partitioner.errors import (
    InvalidPartitionCount,
    KeyFormatError,
    PartitionerError,
    UnknownAlgorithm,
    UnknownKeyFormat,
)
from partitioner.hashes import ACCELERATED, POSITIVE_HASHES, PositiveHash, murmur2
from partitioner.serializers import KEY_SERIALIZERS, key_serializer, serialize_key

__all__ = [
    "ACCELERATED",
    "ALGORITHMS",
    "KEY_FORMATS",
    "InvalidPartitionCount",
    "KeyFormatError",
    "KeyPartitioner",
    "PartitionerError",
    "UnknownAlgorithm",
    "UnknownKeyFormat",
    "key_serializer",
    "murmur2",
    "partition",
    "positive_hash",
    "serialize_key",
]

ALGORITHMS: tuple[str, ...] = tuple(POSITIVE_HASHES)
KEY_FORMATS: tuple[str, ...] = tuple(KEY_SERIALIZERS)


def positive_hash(algorithm: str) -> PositiveHash:
    """The non-negative hash a producer takes modulo the partition count, by algorithm name."""
    try:
        return POSITIVE_HASHES[algorithm]
    except KeyError:
        raise UnknownAlgorithm(algorithm, ALGORITHMS) from None


def _checked_partition_count(num_partitions: int) -> int:
    # bool is an int subclass; True partitions is a caller bug, not 1 partition.
    if (
        not isinstance(num_partitions, int)
        or isinstance(num_partitions, bool)
        or num_partitions < 1
    ):
        raise InvalidPartitionCount(num_partitions)
    return num_partitions


def partition(key: bytes, num_partitions: int, algorithm: str = "murmur2") -> int:
    """The partition a producer using `algorithm` writes `key` (serialized bytes) to."""
    return positive_hash(algorithm)(key) % _checked_partition_count(num_partitions)


class KeyPartitioner:
    """Key text -> partition for one route: serializer and hash resolved once, results cached.

    The cache maps key text to partition (serialization included, which for UUID keys costs
    more than the hash). Invalid keys raise KeyFormatError every time; they are never cached.
    """

    __slots__ = (
        "algorithm",
        "key_format",
        "num_partitions",
        "partition_of",
        "partition_of_bytes",
        "serialize",
    )

    def __init__(
        self,
        key_format: str,
        algorithm: str,
        num_partitions: int,
        cache_size: int = 65536,
    ) -> None:
        serialize = key_serializer(key_format)
        hash_of = positive_hash(algorithm)
        count = _checked_partition_count(num_partitions)

        def compute(text: str) -> int:
            return hash_of(serialize(text)) % count

        def compute_from_bytes(key: bytes) -> int:
            return hash_of(key) % count

        self.key_format = key_format
        self.algorithm = algorithm
        self.num_partitions = count
        # For callers that need the key's bytes too (a store lookup): serialize once, then hash.
        self.serialize: Callable[[str], bytes] = serialize
        self.partition_of_bytes: Callable[[bytes], int] = compute_from_bytes

        self.partition_of: Callable[[str], int] = (
            functools.lru_cache(maxsize=cache_size)(compute) if cache_size > 0 else compute
        )

    def __repr__(self) -> str:
        return (
            f"KeyPartitioner(key_format={self.key_format!r}, algorithm={self.algorithm!r}, "
            f"num_partitions={self.num_partitions})"
        )
