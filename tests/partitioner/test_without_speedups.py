"""The partitioner where its C extension could not be built: the pure-Python fallback that
`partitioner.hashes` installs must answer exactly as the producers do.

Every other partitioner test runs with the extension (CI checks it is built), so this one
imports the package in a fresh interpreter with the extension hidden, the way a machine
without a compiler sees it, and compares with the independent implementations."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

from tests.partitioner.independent import (
    crc32_bitwise,
    four_byte_key_with_murmur2,
    java_murmur2,
    java_partition,
    murmur3_x86_32,
    sarama_hash_partition,
)

ROOT = Path(__file__).resolve().parents[2]  # the tree under test, which the child imports
NUM_PARTITIONS = (1, 7, 12, 1_000, 2**31 - 1)

_CHILD = """
import json, sys
sys.modules["partitioner._speedups"] = None  # what an unbuilt extension looks like: ImportError
import partitioner
asked = json.load(sys.stdin)
keys = [bytes.fromhex(k) for k in asked["keys"]]
print(json.dumps({
    "accelerated": partitioner.ACCELERATED,
    "module": partitioner.__file__,
    "murmur2": [partitioner.murmur2(k) for k in keys],
    "partitions": {
        algorithm: {str(n): [partitioner.partition(k, n, algorithm) for k in keys]
                    for n in asked["partition_counts"]}
        for algorithm in partitioner.ALGORITHMS
    },
}))
"""


def sample_keys() -> list[bytes]:
    chooser = random.Random(24)
    keys = [chooser.randbytes(chooser.randrange(0, 40)) for _ in range(500)]
    keys += [f"customer-{i:06d}".encode() for i in range(200)]
    edges = (-(2**31), 2**31 - 1, -1, 0)  # toPositive(INT32_MIN) is 0; abs() would overflow
    return keys + [four_byte_key_with_murmur2(h) for h in edges] + [b"", b"\xff" * 17]


def independent(algorithm: str, key: bytes, n: int) -> int:
    if algorithm == "murmur2":
        return java_partition(key, n)
    if algorithm == "crc32":
        return crc32_bitwise(key) % n
    if algorithm == "fnv1a":
        return sarama_hash_partition(key, n)
    return (murmur3_x86_32(key) & 0x7FFFFFFF) % n


def test_without_the_c_extension_every_algorithm_answers_like_the_producers():
    keys = sample_keys()
    child = subprocess.run(
        [sys.executable, "-c", _CHILD],
        input=json.dumps({"keys": [k.hex() for k in keys], "partition_counts": NUM_PARTITIONS}),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
        check=True,
    )
    answers = json.loads(child.stdout)
    assert answers["accelerated"] is False, "the extension was not hidden"
    assert Path(answers["module"]).resolve().is_relative_to(ROOT)
    assert answers["murmur2"] == [java_murmur2(k) for k in keys]
    for algorithm, by_count in answers["partitions"].items():
        for n in NUM_PARTITIONS:
            expected = [independent(algorithm, k, n) for k in keys]
            assert by_count[str(n)] == expected, f"{algorithm} with {n} partitions"
