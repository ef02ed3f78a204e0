"""The public entry points: partition() and KeyPartitioner, including their errors and edges."""

from __future__ import annotations

import pytest

from partitioner import (
    ALGORITHMS,
    InvalidPartitionCount,
    KeyFormatError,
    KeyPartitioner,
    UnknownAlgorithm,
    murmur2,
    partition,
)
from partitioner.hashes import murmur2_positive_reference, murmur2_reference
from tests.partitioner.independent import four_byte_key_with_murmur2, java_partition

INT32_MIN = -(2**31)


def test_algorithms_are_the_documented_four():
    assert ALGORITHMS == ("murmur2", "crc32", "fnv1a", "murmur3")


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "3", None])
def test_rejects_partition_counts_that_are_not_positive_ints(bad):
    with pytest.raises(InvalidPartitionCount, match="num_partitions"):
        partition(b"key", bad)
    with pytest.raises(InvalidPartitionCount):
        KeyPartitioner("string", "murmur2", bad)


def test_unknown_algorithm_names_the_known_ones():
    with pytest.raises(UnknownAlgorithm, match="murmur2, crc32, fnv1a, murmur3") as caught:
        partition(b"key", 3, "default")
    assert caught.value.algorithm == "default"


def test_key_whose_murmur2_is_int32_min_goes_to_partition_zero():
    # toPositive(INT32_MIN) == 0, where a naive abs() would overflow to a negative partition.
    key = four_byte_key_with_murmur2(INT32_MIN)
    assert murmur2(key) == INT32_MIN
    assert murmur2_reference(key) == INT32_MIN
    assert murmur2_positive_reference(key) == 0
    for num_partitions in (1, 7, 12, 100, 2**31 - 1):
        assert partition(key, num_partitions) == 0 == java_partition(key, num_partitions)


def test_key_whose_murmur2_is_int32_max_keeps_its_value():
    key = four_byte_key_with_murmur2(2**31 - 1)
    assert partition(key, 2**31 - 1) == 0
    assert partition(key, 1000) == (2**31 - 1) % 1000


@pytest.mark.parametrize(
    "key",
    [
        b"",
        b"\x00",
        b"\xff",
        b"\x00\xff\x00\xff\x00",
        b"\xff" * 17,
        "日本語".encode(),
        "🚂".encode(),
    ],
)
@pytest.mark.parametrize("num_partitions", [1, 7, 12, 100])
def test_edge_keys_match_java(key, num_partitions):
    assert partition(key, num_partitions) == java_partition(key, num_partitions)


def test_one_partition_always_answers_zero():
    assert {partition(bytes([i]), 1, algo) for i in range(256) for algo in ALGORITHMS} == {0}


def test_key_partitioner_serializes_then_hashes():
    router = KeyPartitioner("int64", "murmur2", 12)
    assert router.partition_of("42") == partition((42).to_bytes(8, "big"), 12)
    assert (
        repr(router) == "KeyPartitioner(key_format='int64', algorithm='murmur2', num_partitions=12)"
    )


def test_key_partitioner_serializes_once_for_callers_that_need_the_bytes():
    router = KeyPartitioner("int32", "crc32", 7)
    key = router.serialize("42")
    assert key == (42).to_bytes(4, "big")
    assert router.partition_of_bytes(key) == router.partition_of("42") == partition(key, 7, "crc32")


def test_key_partitioner_raises_for_bad_keys_every_time():

    router = KeyPartitioner("int32", "murmur2", 12)
    for _ in range(2):  # an error is never cached as an answer
        with pytest.raises(KeyFormatError, match="decimal integer"):
            router.partition_of("forty-two")


def test_key_partitioner_without_cache_gives_the_same_answers():
    cached = KeyPartitioner("uuid", "fnv1a", 100)
    uncached = KeyPartitioner("uuid", "fnv1a", 100, cache_size=0)
    key = "123e4567-e89b-12d3-a456-426614174000"
    assert (
        cached.partition_of(key)
        == uncached.partition_of(key)
        == partition(key.encode(), 100, "fnv1a")
    )
