"""What a caller of the partitioner sees, pinned where mutants of partitioner/ survived the other
tests (scripts/mutation, docs/testing.md): the pure-Python hash references themselves (the
fallback when the C extension is not built), the reasons a 400 answer carries, the errors'
fields, base64 padding, and a bounded cache.
"""

from __future__ import annotations

import pytest

from partitioner import (
    InvalidPartitionCount,
    KeyFormatError,
    KeyPartitioner,
    UnknownAlgorithm,
    UnknownKeyFormat,
    partition,
    serialize_key,
)
from partitioner.hashes import (
    fnv1a_librdkafka,
    fnv1a_librdkafka_reference,
    murmur2,
    murmur2_positive,
    murmur2_positive_reference,
    murmur2_reference,
)
from tests.partitioner.independent import four_byte_key_with_murmur2

INT32_MIN = -(2**31)


@pytest.mark.parametrize(
    "target", [INT32_MIN, -1, -973932308, 0, 1, 2**31 - 1], ids=lambda t: f"murmur2={t}"
)
def test_the_murmur2_references_make_a_hash_positive_as_kafka_does(target):
    """toPositive is `h & 0x7fffffff`: INT32_MIN goes to 0 and -1 to 2**31-1 (abs() would give
    2**31 and 1, another partition)."""
    key = four_byte_key_with_murmur2(target)
    assert murmur2_reference(key) == murmur2(key) == target
    assert murmur2_positive_reference(key) == murmur2_positive(key) == target & 0x7FFFFFFF


@pytest.mark.parametrize("key", [b"", b"a", b"ab", b"abc", b"abcd", b"abcde", b"\xff" * 7])
def test_the_references_agree_with_the_c_versions_on_every_tail_length(key):
    assert murmur2_reference(key) == murmur2(key)
    assert murmur2_positive_reference(key) == murmur2_positive(key)
    assert fnv1a_librdkafka_reference(key) == fnv1a_librdkafka(key)


@pytest.mark.parametrize(
    ("text", "key_format", "reason"),
    [
        ("4x", "int32", "expected a decimal integer such as 42 or -7"),
        ("2147483648", "int32", "out of range [-2147483648, 2147483647]"),
        ("abc", "hex", "expected an even number of hex digits"),
        ("a b", "base64", "contains characters outside the base64 alphabets"),
        ("QUJDR", "base64", "truncated: length is not a valid base64 length"),
        ("not-a-uuid", "uuid", "expected a UUID such as 123e4567-e89b-12d3-a456-426614174000"),
        ("\ud800", "string", "not encodable as UTF-8 (lone surrogate)"),
        ("\ud800", "json", "not encodable as UTF-8 (lone surrogate)"),
    ],
)
def test_a_bad_key_says_exactly_why_in_the_400(text, key_format, reason):
    """The proxy answers 400 with the error's reason and format (proxy.handler): they are what
    a client reads."""
    with pytest.raises(KeyFormatError) as caught:
        serialize_key(text, key_format)
    assert (caught.value.key_format, caught.value.key, caught.value.reason) == (
        key_format,
        text,
        reason,
    )
    assert str(caught.value) == f"invalid {key_format} key {text!r}: {reason}"


def test_unknown_names_and_counts_carry_what_was_asked_and_what_is_known():
    with pytest.raises(UnknownKeyFormat) as bad_format:
        serialize_key("k", "yaml")
    assert bad_format.value.key_format == "yaml"
    assert bad_format.value.known[:2] == ("string", "int32")
    assert str(bad_format.value).startswith(
        "unknown key format 'yaml'; expected one of string, int32, int64, uuid,"
    )
    with pytest.raises(UnknownAlgorithm) as bad_algorithm:
        partition(b"k", 3, "md5")
    assert bad_algorithm.value.algorithm == "md5"
    assert bad_algorithm.value.known == ("murmur2", "crc32", "fnv1a", "murmur3")
    assert str(bad_algorithm.value) == (
        "unknown partitioner 'md5'; expected one of murmur2, crc32, fnv1a, murmur3"
    )
    with pytest.raises(InvalidPartitionCount) as bad_count:
        partition(b"k", 0)
    assert bad_count.value.num_partitions == 0
    assert str(bad_count.value) == "num_partitions must be an integer >= 1, got 0"


def test_string_is_the_default_key_format():
    assert serialize_key("customer-1") == b"customer-1"


@pytest.mark.parametrize("text", ["QUI", "QUI=", "QUI=="])
def test_base64_padding_is_optional_and_not_counted(text):
    assert serialize_key(text, "base64") == b"AB"


def test_base64_keeps_trailing_letters_that_look_like_padding_characters():
    assert serialize_key("AAAX", "base64") == b"\x00\x00\x17"
    assert serialize_key("AAAX==", "base64") == b"\x00\x00\x17"


def test_the_key_cache_is_bounded():
    """A proxy sees unbounded distinct keys: its per-route cache must not grow with them."""
    partitioner = KeyPartitioner("string", "murmur2", 12, cache_size=8)
    for i in range(100):
        partitioner.partition_of(f"k{i}")
    assert partitioner.partition_of.cache_info().currsize == 8  # type: ignore[attr-defined]
