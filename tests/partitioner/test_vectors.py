"""Published test vectors, each table citing the file it was copied from."""

from __future__ import annotations

import pytest

from partitioner import partition
from partitioner.hashes import (
    crc32_unsigned,
    fnv1a_librdkafka,
    fnv1a_librdkafka_reference,
    murmur2,
    murmur2_positive,
    murmur2_positive_reference,
    murmur2_reference,
)

# apache/kafka clients/src/test/java/org/apache/kafka/common/utils/UtilsTest.java, testMurmur2
KAFKA_UTILS_TEST_MURMUR2 = [
    (b"21", -973932308),
    (b"foobar", -790332482),
    (b"a-little-bit-long-string", -985981536),
    (b"a-little-bit-longer-string", -1486304829),
    (b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971),
    (b"abc", 479470107),
]

# confluentinc/librdkafka src/rdmurmur2.c, unittest_murmurhashneutral2 ("java_murmur2_results").
# These are already made non-negative (toPositive), the value taken modulo the partition count.
LIBRDKAFKA_MURMUR2 = [
    (b"kafka", 1348980580),
    (b"amqp", 767747138),
    (b"giberish123456789", 257239820),
]

# confluentinc/librdkafka src/rdfnv1a.c, unittest_fnv1a (values from Go's hash/fnv).
_SHORT, _UNALIGNED = b"1234", b"PreAmbleWillBeRemoved,ThePrePartThatIs"
LIBRDKAFKA_FNV1A = [
    (b"kafka", 0xD33C4E1),
    (b"giberish123456789", 0x77A58295),
    (_SHORT, 0x23BDD03),
    (_SHORT[1:], 0x2DEA3CD2),
    (_SHORT[2:], 0x740FA83E),
    (_SHORT[3:], 0x310CA263),
    (_UNALIGNED, 0x65CBD69C),
    (_UNALIGNED[1:], 0x6E49C79A),
    (_UNALIGNED[2:], 0x69EED356),
    (_UNALIGNED[3:], 0x6ABCC023),
    (b"", 0x7EE3623B),
]

# confluentinc/librdkafka tests/0048-partitioner.c, do_test_partitioners: per key the hash
# each partitioner takes modulo the partition count (NULL key left out: it is not routable).
_KEYS_0048 = [b"", b"23456", b"this is another string with more length to it perhaps", b"hejsan"]
LIBRDKAFKA_0048 = {
    "crc32": [0x0, 0xB1B451D7, 0xB0150DF7, 0xD077037E],  # "consistent"
    "murmur2": [0x106E08D9, 0x058D780F, 0x4F7703DA, 0x5EC19395],  # "murmur2(_random)"
    "fnv1a": [0x7EE3623B, 0x27E6F469, 0x155E3E5F, 0x17B1E27A],  # "fnv1a(_random)"
}


@pytest.mark.parametrize(("key", "expected"), KAFKA_UTILS_TEST_MURMUR2)
@pytest.mark.parametrize("implementation", [murmur2, murmur2_reference], ids=["fast", "reference"])
def test_kafka_utils_test_murmur2(implementation, key, expected):
    assert implementation(key) == expected


@pytest.mark.parametrize(("key", "expected"), LIBRDKAFKA_MURMUR2)
@pytest.mark.parametrize(
    "positive", [murmur2_positive, murmur2_positive_reference], ids=["fast", "reference"]
)
def test_librdkafka_murmur2_unittest(positive, key, expected):
    assert positive(key) == expected
    assert murmur2(key) & 0x7FFFFFFF == expected


@pytest.mark.parametrize(("key", "expected"), LIBRDKAFKA_FNV1A)
@pytest.mark.parametrize(
    "implementation", [fnv1a_librdkafka, fnv1a_librdkafka_reference], ids=["fast", "reference"]
)
def test_librdkafka_fnv1a_unittest(implementation, key, expected):
    assert implementation(key) == expected


@pytest.mark.parametrize("algorithm", sorted(LIBRDKAFKA_0048))
@pytest.mark.parametrize("num_partitions", [7, 17])  # 0048 runs with 7 (quick) or 17
def test_librdkafka_0048_partitioner(algorithm, num_partitions):
    expected = [h % num_partitions for h in LIBRDKAFKA_0048[algorithm]]
    assert [partition(key, num_partitions, algorithm) for key in _KEYS_0048] == expected


def test_crc32_matches_0048_hashes():
    assert [crc32_unsigned(key) for key in _KEYS_0048] == LIBRDKAFKA_0048["crc32"]


# The pure-Python references answer where the C extension could not be built: the same tables.
REFERENCE_POSITIVE_HASHES = {
    "murmur2": murmur2_positive_reference,
    "fnv1a": fnv1a_librdkafka_reference,
    "crc32": crc32_unsigned,
}


@pytest.mark.parametrize("algorithm", sorted(LIBRDKAFKA_0048))
def test_librdkafka_0048_hashes_from_the_pure_python_references(algorithm):
    positive = REFERENCE_POSITIVE_HASHES[algorithm]
    assert [positive(key) for key in _KEYS_0048] == LIBRDKAFKA_0048[algorithm]


@pytest.mark.parametrize(("key", "signed"), KAFKA_UTILS_TEST_MURMUR2)
def test_kafka_utils_test_murmur2_made_positive_by_the_reference(key, signed):
    """Five of the six Kafka vectors are negative: toPositive is `& 0x7fffffff`, not abs()."""
    assert murmur2_positive_reference(key) == signed & 0x7FFFFFFF
