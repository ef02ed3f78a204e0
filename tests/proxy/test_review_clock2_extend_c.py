"""Review 2 of the per-node report clocks: a Cached made by `__new__` alone (or cleared by
the collector's tp_clear) has its object fields NULL, and a Candidate made by `__new__` alone
passes Cached's type check with its fields NULL. Reading them (`Cached.live`, which reads its
terms, and a candidate's caught-up time, which reads its clock) must not dereference NULL (the
interpreter would die with SIGSEGV)."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPTS = {
    "cached_without_init": ("from proxy._hotpath import Cached\nCached.__new__(Cached).live(5)\n"),
    "candidate_without_init": (
        "from proxy._hotpath import Cached, Candidate\n"
        "c = Cached(choice=None, candidates=(Candidate.__new__(Candidate),), expires_ms=1)\n"
        "c.live(5)\n"
        "Candidate.__new__(Candidate).caught_up_at_ms\n"
    ),
}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_an_unset_field_never_crashes_the_interpreter(name: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPTS[name]],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode >= 0, f"killed by signal {-done.returncode}: {done.stderr[-300:]}"
