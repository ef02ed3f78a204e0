"""Cost of the partition step per key, side by side in one run.

Variants, for 16-, 64- and 256-byte keys:
- murmur2_python:   the pure-Python reference (what kroute pays without the C extension);
- murmur2_c:        partitioner._speedups, uncached (every key new);
- key_partitioner_uncached: key text -> UTF-8 -> murmur2 (C) -> % n, the whole step, no cache;
- key_partitioner_cached:   the same through KeyPartitioner's LRU cache, every lookup a hit
                            (the proxy's case for hot keys);
- mmh3 (reference, C murmur3 from PyPI), timed in the same run.

Usage: .venv/bin/python -m benchmarks.partitioner_bench [--keys 5000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable

import mmh3

from benchmarks.results_file import git_revision, machine_notes, write_json, write_section
from partitioner import ACCELERATED, KeyPartitioner
from partitioner.hashes import murmur2_positive, murmur2_positive_reference

KEY_SIZES = (16, 64, 256)
NUM_PARTITIONS = 12


def time_per_item(
    function: Callable[[object], object], items: list, repeats: int
) -> tuple[float, float]:
    """(best, median) nanoseconds per item over `repeats` passes through all items."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for item in items:
            function(item)
        samples.append((time.perf_counter_ns() - start) / len(items))
    return min(samples), statistics.median(samples)


def loop_overhead(items: list, repeats: int) -> float:
    def nothing(_item: object) -> None:
        return None

    return time_per_item(nothing, items, repeats)[0]


def make_text_keys(count: int, size: int, rng: random.Random) -> list[str]:
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789-"
    return ["".join(rng.choices(alphabet, k=size)) for _ in range(count)]


def measure(num_keys: int, repeats: int) -> dict[str, dict[str, float]]:
    rng = random.Random(42)
    by_size: dict[str, dict[str, float]] = {}
    for size in KEY_SIZES:
        texts = make_text_keys(num_keys, size, rng)
        raw = [text.encode() for text in texts]
        overhead = loop_overhead(raw, repeats)
        cached = KeyPartitioner("string", "murmur2", NUM_PARTITIONS, cache_size=num_keys * 2)
        uncached = KeyPartitioner("string", "murmur2", NUM_PARTITIONS, cache_size=0)
        for text in texts:  # warm the cache: every timed lookup is a hit
            cached.partition_of(text)
        variants: dict[str, tuple[Callable[[object], object], list]] = {
            "murmur2_python": (murmur2_positive_reference, raw),
            "murmur2_c": (murmur2_positive, raw),
            "key_partitioner_uncached": (uncached.partition_of, texts),
            "key_partitioner_cached": (cached.partition_of, texts),
            "mmh3": (mmh3.hash, raw),
        }
        by_size[str(size)] = {
            name: round(max(time_per_item(fn, items, repeats)[0] - overhead, 0.0), 1)
            for name, (fn, items) in variants.items()
        }
    return by_size


def render(by_size: dict[str, dict[str, float]], command: str) -> str:
    names = [
        "murmur2_python",
        "murmur2_c",
        "key_partitioner_uncached",
        "key_partitioner_cached",
        "mmh3",
    ]
    lines = [
        "## Partitioner: cost per key",
        "",
        f"Command: `{command}` (revision {git_revision()}; {machine_notes()}).",
        "Best of the repeats, Python's loop-and-call overhead subtracted; ns per key.",
        "",
        "| key bytes | " + " | ".join(names) + " | murmur2_c / mmh3 |",
        "|---|" + "---|" * (len(names) + 1),
    ]
    for size, row in by_size.items():
        ratio = row["murmur2_c"] / row["mmh3"] if row["mmh3"] else float("nan")
        lines.append(
            f"| {size} | " + " | ".join(f"{row[n]:.0f}" for n in names) + f" | {ratio:.2f} |"
        )
    lines += [
        "",
        "Without the C extension, murmur2 alone costs what the murmur2_python column says.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=5000, help="distinct keys per size (<= 100000)")
    parser.add_argument("--repeats", type=int, default=7, help="passes per variant (<= 50)")
    args = parser.parse_args(argv)
    if not (1 <= args.keys <= 100_000 and 1 <= args.repeats <= 50):
        parser.error("--keys must be 1..100000 and --repeats 1..50")
    if not ACCELERATED:
        print("warning: partitioner._speedups is not built; murmur2_c times the Python fallback")

    by_size = measure(args.keys, args.repeats)
    command = "python -m benchmarks.partitioner_bench " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    markdown = render(by_size, command.strip())
    print(markdown)
    write_json(
        "partitioner",
        {
            "ns_per_key": {
                size: {k: v for k, v in row.items() if k != "mmh3"} for size, row in by_size.items()
            },
            "mmh3_ns_per_key": {size: row["mmh3"] for size, row in by_size.items()},
            "accelerated": ACCELERATED,
            "command": command.strip(),
            "machine": machine_notes(),
        },
    )
    write_section("partitioner", markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
