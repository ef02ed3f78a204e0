"""Review 2 of the per-node report clocks: `Cached.extend` (proxy/_hotpath.c) reads
`self->candidates` and each `candidate->replica` without checking them. A Cached made by
`__new__` alone (or cleared by the collector's tp_clear) has candidates NULL, and a Candidate
made by `__new__` alone passes Cached's type check with replica NULL: extend dereferences NULL
(the interpreter dies with SIGSEGV) instead of raising."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPTS = {
    "cached_without_init": (
        "from proxy._hotpath import Cached\nCached.__new__(Cached).extend(5)\n"
    ),
    "candidate_without_init": (
        "from proxy._hotpath import Cached, Candidate\n"
        "c = Cached(choice=None, candidates=(Candidate.__new__(Candidate),), expires_ms=1)\n"
        "c.extend(5)\n"
    ),
}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_extend_raises_instead_of_crashing_on_an_unset_field(name: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPTS[name]],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode >= 0, f"killed by signal {-done.returncode}: {done.stderr[-300:]}"
