"""Independent implementations of the producers' hashes, used only by tests.

Written differently from partitioner/hashes.py on purpose: Java's int arithmetic is emulated
with ctypes.c_int32 and an explicit unsigned shift, CRC-32 is computed bit by bit, and the Go
Sarama partitioner is written the way Go evaluates it. Agreement between the two is evidence
neither copied the other's mistake.
"""

from __future__ import annotations

import struct
from ctypes import c_int32, c_uint32


def _int(value: int) -> int:
    """Java int: wrap to signed 32 bits."""
    return c_int32(value).value


def _ushr(value: int, shift: int) -> int:
    """Java's >>> on an int."""
    return c_uint32(value).value >> shift


def java_murmur2(data: bytes) -> int:
    """org.apache.kafka.common.utils.Utils#murmur2, transliterated with Java int semantics."""
    length = len(data)
    seed = _int(0x9747B28C)
    m = 0x5BD1E995
    r = 24
    h = _int(seed ^ length)
    length4 = length // 4
    for (block,) in struct.iter_unpack("<i", data[: length4 * 4]):
        k = _int(block * m)
        k ^= _ushr(k, r)
        k = _int(k * m)
        h = _int(h * m)
        h = _int(h ^ k)
    tail = data[length4 * 4 :]
    if len(tail) == 3:
        h = _int(h ^ (tail[2] << 16))
    if len(tail) >= 2:
        h = _int(h ^ (tail[1] << 8))
    if len(tail) >= 1:
        h = _int(h ^ tail[0])
        h = _int(h * m)
    h = _int(h ^ _ushr(h, 13))
    h = _int(h * m)
    h = _int(h ^ _ushr(h, 15))
    return h


def java_partition(data: bytes, num_partitions: int) -> int:
    """BuiltInPartitioner.partitionForKey: toPositive(murmur2(key)) % numPartitions."""
    return (java_murmur2(data) & 0x7FFFFFFF) % num_partitions


def crc32_bitwise(data: bytes) -> int:
    """CRC-32 (ISO-HDLC, reflected polynomial 0xEDB88320), one bit at a time."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0xEDB88320 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def fnv1a_32(data: bytes) -> int:
    """Go's hash/fnv New32a: the textbook FNV-1a, unsigned."""
    h = 2166136261
    for byte in data:
        h = ((h ^ byte) * 16777619) % (1 << 32)
    return h


def _go_rem(a: int, b: int) -> int:
    """Go's % truncates toward zero, unlike Python's."""
    q = abs(a) // abs(b)
    return a - b * (q if (a >= 0) == (b >= 0) else -q)


def sarama_hash_partition(data: bytes, num_partitions: int) -> int:
    """Sarama NewHashPartitioner (default): int32(h) % n, then negate a negative remainder."""
    h = c_int32(fnv1a_32(data)).value
    partition = _go_rem(h, num_partitions)
    return -partition if partition < 0 else partition


def murmur3_x86_32(data: bytes, seed: int = 0) -> int:
    """Austin Appleby's MurmurHash3_x86_32, unsigned."""
    c1, c2 = 0xCC9E2D51, 0x1B873593
    mask = 0xFFFFFFFF
    h = seed & mask
    nblocks = len(data) // 4
    for (block,) in struct.iter_unpack("<I", data[: nblocks * 4]):
        k = (block * c1) & mask
        k = ((k << 15) | (k >> 17)) & mask
        k = (k * c2) & mask
        h ^= k
        h = ((h << 13) | (h >> 19)) & mask
        h = (h * 5 + 0xE6546B64) & mask
    tail = data[nblocks * 4 :]
    k = 0
    if len(tail) == 3:
        k ^= tail[2] << 16
    if len(tail) >= 2:
        k ^= tail[1] << 8
    if len(tail) >= 1:
        k ^= tail[0]
        k = (k * c1) & mask
        k = ((k << 15) | (k >> 17)) & mask
        k = (k * c2) & mask
        h ^= k
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & mask
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & mask
    h ^= h >> 16
    return h


def _undo_xorshift_right(value: int, shift: int) -> int:
    result = value
    for _ in range(32 // shift + 1):
        result = value ^ (result >> shift)
    return result & 0xFFFFFFFF


def four_byte_key_with_murmur2(target: int) -> bytes:
    """A 4-byte key whose Kafka murmur2 is `target`, by running murmur2 backwards.

    For a 4-byte key every step (odd multiplications, xor-shifts) is a bijection on 32 bits, so
    each has an inverse; this lets tests hit exact hashes such as INT32_MIN.
    """
    m = 0x5BD1E995
    m_inverse = pow(m, -1, 1 << 32)
    h0 = (0x9747B28C ^ 4) & 0xFFFFFFFF
    h = _undo_xorshift_right(target & 0xFFFFFFFF, 15)
    h = (h * m_inverse) & 0xFFFFFFFF
    h = _undo_xorshift_right(h, 13)
    k = h ^ ((h0 * m) & 0xFFFFFFFF)
    k = (k * m_inverse) & 0xFFFFFFFF
    k = _undo_xorshift_right(k, 24)
    k = (k * m_inverse) & 0xFFFFFFFF
    return k.to_bytes(4, "little")
