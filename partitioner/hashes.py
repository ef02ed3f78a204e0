"""The hash functions Kafka producers use to place a keyed record, each made non-negative
exactly the way its producer does before taking it modulo the partition count.

Pure-Python references live here; `partitioner/_speedups.c` has bit-identical C versions of the
two byte loops, used when the extension was built (see `ACCELERATED`).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import mmh3

PositiveHash = Callable[[bytes], int]

_MASK32 = 0xFFFFFFFF
_MURMUR2_SEED = 0x9747B28C
_MURMUR2_M = 0x5BD1E995
_FNV1A_OFFSET = 0x811C9DC5
_FNV1A_PRIME = 0x01000193


def murmur2_reference(data: bytes) -> int:
    """Kafka's `Utils.murmur2` as a signed 32-bit int.

    Mirrors org.apache.kafka.common.utils.Utils#murmur2 line by line; Java's int overflow is
    emulated by masking to 32 bits after every multiplication.
    """
    length = len(data)
    h = (_MURMUR2_SEED ^ length) & _MASK32
    length4 = length // 4
    for i in range(length4):
        i4 = i * 4
        k = data[i4] | (data[i4 + 1] << 8) | (data[i4 + 2] << 16) | (data[i4 + 3] << 24)
        k = (k * _MURMUR2_M) & _MASK32
        k ^= k >> 24
        k = (k * _MURMUR2_M) & _MASK32
        h = (h * _MURMUR2_M) & _MASK32
        h ^= k
    tail = length & ~3
    remainder = length % 4
    if remainder == 3:
        h ^= data[tail + 2] << 16
    if remainder >= 2:
        h ^= data[tail + 1] << 8
    if remainder >= 1:
        h ^= data[tail]
        h = (h * _MURMUR2_M) & _MASK32
    h ^= h >> 13
    h = (h * _MURMUR2_M) & _MASK32
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def murmur2_positive_reference(data: bytes) -> int:
    """`Utils.toPositive(Utils.murmur2(key))` (BuiltInPartitioner.partitionForKey).

    toPositive is `h & 0x7fffffff`, so INT32_MIN maps to 0 rather than overflowing like abs().
    """
    return murmur2_reference(data) & 0x7FFFFFFF


def fnv1a_librdkafka_reference(data: bytes) -> int:
    """librdkafka `rd_fnv1a` (src/rdfnv1a.c): FNV-1a 32, then |h| of it read as int32, unsigned.

    Go Sarama's default NewHashPartitioner takes `int32(h) % n` and negates a negative remainder;
    librdkafka takes `|int32(h)| % n`. For every h both give `|h| mod n` (including
    h == INT32_MIN, where both give 2**31 mod n), so this one function serves both producers.
    Sarama's WithAbsFirst option (`(h & 0x7fffffff) % n`) is a different partitioner.
    """
    h = _FNV1A_OFFSET
    for byte in data:
        h = ((h ^ byte) * _FNV1A_PRIME) & _MASK32
    if h & 0x80000000:
        h = (-h) & _MASK32
    return h


def crc32_unsigned(data: bytes) -> int:
    """librdkafka `consistent`/`consistent_random`: `rd_crc32(key) % n`, CRC-32 as unsigned."""
    return zlib.crc32(data)


def murmur3_positive(data: bytes) -> int:
    """murmur3_x86_32 with seed 0, made non-negative like Kafka's toPositive.

    Not Kafka's default partitioner: offered for custom producer partitioners built on
    murmur3 (for example Guava's `Hashing.murmur3_32_fixed()` followed by `& 0x7fffffff`).
    """
    return mmh3.hash(data, 0, signed=True) & 0x7FFFFFFF


try:
    from partitioner import _speedups  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - exercised only where the C extension could not be built
    ACCELERATED = False
    murmur2: Callable[[bytes], int] = murmur2_reference
    murmur2_positive: PositiveHash = murmur2_positive_reference
    fnv1a_librdkafka: PositiveHash = fnv1a_librdkafka_reference
else:
    ACCELERATED = True
    murmur2 = _speedups.murmur2
    murmur2_positive = _speedups.murmur2_positive
    fnv1a_librdkafka = _speedups.fnv1a_librdkafka

#: Algorithm name -> the non-negative hash its producer takes modulo the partition count.
POSITIVE_HASHES: dict[str, PositiveHash] = {
    "murmur2": murmur2_positive,
    "crc32": crc32_unsigned,
    "fnv1a": fnv1a_librdkafka,
    "murmur3": murmur3_positive,
}
