"""Review (91e5b33, the C path reads report clocks): the new C parts of Candidate and Cached
under odd use. Documents cases checked; all pass on 91e5b33 (no bug found here).

- objects made by `__new__` alone: `Cached.live` returns without touching terms;
- odd terms refused at init (not a tuple, a non-clock, a non-int, an int past long long,
  a 3-tuple), and an int subclass / bool base accepted as its value;
- reference counts of `clock` and `terms` balanced through init, re-init and deallocation;
- a cycle through a Cached's choice collected (tp_clear drops terms) without a crash;
- the stored expiry never moves earlier, whatever a clock does afterwards."""

from __future__ import annotations

import gc
import sys

import pytest

from proxy._hotpath import Cached, Candidate, ReportClock, Tally


def _candidate(clock: ReportClock | None, caught: int = 1_000) -> Candidate:
    return Candidate(
        target=object(), replica=None, provenance=b"", idle=[], host_line=b"",
        choice_tally=None, node_tally=Tally(), lag=0, caught_up_at_ms=caught, clock=clock,
    )  # fmt: skip


def test_new_alone_objects_do_not_crash_live_or_the_caught_up_getter():
    cached = Cached.__new__(Cached)
    assert cached.live(0) is False  # expires_ms 0, no terms: expired, nothing read
    assert cached.live(-1) is True
    assert cached.terms is None
    candidate = Candidate.__new__(Candidate)
    assert candidate.caught_up_at_ms == 0  # (zeroed memory: no clock, "as given" 0)
    assert candidate.clock is None


@pytest.mark.parametrize(
    "terms",
    [
        [(ReportClock(), 1)],  # a list, not a tuple
        ((object(), 1),),
        ((ReportClock(), "1"),),
        ((ReportClock(), 1.0),),
        ((ReportClock(), 2**63),),
        ((ReportClock(), -(2**63) - 1),),
        ((ReportClock(), 1, 2),),
        (ReportClock(),),
    ],
)
def test_odd_terms_are_refused(terms):
    with pytest.raises(TypeError):
        Cached(choice=None, candidates=(), expires_ms=0, terms=terms, cap_ms=10)


def test_int_subclass_and_bool_bases_read_as_their_values():
    class Int(int):
        pass

    clock = ReportClock(5)
    cached = Cached(
        choice=None, candidates=(), expires_ms=0, terms=((clock, Int(10)), (clock, True)),
        cap_ms=100,
    )  # fmt: skip
    assert cached.live(5)  # 1 + 5 = 6 is the earliest term
    assert not cached.live(6)


def test_clock_and_terms_reference_counts_balance():
    clock = ReportClock(3)
    before = sys.getrefcount(clock)
    for _ in range(1_000):
        candidate = _candidate(clock)
        candidate.__init__(
            target=object(), replica=None, provenance=b"", idle=[], host_line=b"",
            choice_tally=None, node_tally=Tally(), clock=clock,
        )  # fmt: skip
        terms = ((clock, 1), (clock, 2))
        cached = Cached(choice=None, candidates=(candidate,), expires_ms=0, terms=terms, cap_ms=10)
        cached.__init__(choice=None, candidates=(candidate,), expires_ms=0, terms=terms)
        assert cached.terms is terms
        del candidate, cached, terms
    assert sys.getrefcount(clock) == before
    # a failed init leaves the object as it was
    cached = Cached(choice=None, candidates=(), expires_ms=7, terms=((clock, 1),), cap_ms=9)
    with pytest.raises(TypeError):
        cached.__init__(choice=None, candidates=(), expires_ms=0, terms=((clock, "x"),))
    with pytest.raises(OverflowError):
        cached.__init__(choice=None, candidates=(), expires_ms=0, terms=(), cap_ms=2**70)
    assert (cached.expires_ms, cached.cap_ms, cached.terms) == (7, 9, ((clock, 1),))
    del cached
    assert sys.getrefcount(clock) == before


def test_a_cycle_through_a_cached_choice_is_collected():
    clock = ReportClock()
    before = sys.getrefcount(clock)
    for _ in range(100):
        holder: list[object] = []
        cached = Cached(choice=holder, candidates=(_candidate(clock),), expires_ms=0,
                        terms=((clock, 5),), cap_ms=10)  # fmt: skip
        holder.append(cached)
        del cached, holder
    gc.collect()
    assert sys.getrefcount(clock) == before


def test_the_stored_expiry_never_moves_earlier():
    clock = ReportClock()
    cached = Cached(choice=None, candidates=(), expires_ms=100, terms=((clock, 100),), cap_ms=500)
    clock.shift_ms = 50
    assert cached.live(120)
    assert cached.expires_ms == 150
    clock.shift_ms = -1_000  # never done by the table (its clocks only move later)
    assert cached.live(149)
    assert cached.expires_ms == 150
    assert not cached.live(150)
    clock.shift_ms = 10_000
    assert cached.live(499)
    assert not cached.live(500)
