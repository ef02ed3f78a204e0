"""Benchmark scripts: each prints its figures and writes them to RESULTS.md and results/*.json."""
