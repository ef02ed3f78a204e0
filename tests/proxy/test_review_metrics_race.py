"""The per-replica request counters are rendered in a thread while the event loop adds series.

"One C call" is only atomic while nothing in it can run Python code: on CPython 3.11 a garbage
collection runs inside any allocation of a tracked object, and its finalizers (`__del__`, a
coroutine's `finally`, a weakref callback) are Python code that can hand the GIL to the loop
thread. Copying the counters by iterating their items allocates a tuple per series, so a
collection, and a series added by the loop meanwhile, can land in the middle of it."""

from __future__ import annotations

import gc
import threading

from proxy.metrics import CHOICES, ProxyMetrics, replica_choice_lines


class _FinalizerThatYields:
    """Cyclic garbage whose finalizer, run by a collection in the scraping thread, lets the
    other thread run (as any Python code may): here made certain by a handshake."""

    def __init__(self, scraper: threading.Thread, pause: threading.Event, added: threading.Event):
        self.cycle = self
        self.scraper, self.pause, self.added = scraper, pause, added

    def __del__(self) -> None:
        if threading.current_thread() is self.scraper:
            self.pause.set()
            self.added.wait(2.0)


def test_a_collection_during_the_copy_lets_the_loop_add_a_series_without_breaking_a_scrape():
    metrics = ProxyMetrics()
    for partition in range(20_000):  # a few dozen collections' worth of tuples, were it copied so
        metrics.choice_tally("s", partition, "a", "active")
    pause, added = threading.Event(), threading.Event()

    def event_loop_adding_a_series() -> None:
        if pause.wait(5.0):
            metrics.choice_tally("s", 99_999, "b", "standby")  # a request to a new replica
        added.set()

    loop_thread = threading.Thread(target=event_loop_adding_a_series)
    loop_thread.start()
    try:
        gc.collect()  # the next collection comes only after hundreds of allocations
        _FinalizerThatYields(threading.current_thread(), pause, added)
        text = "".join(replica_choice_lines(metrics))
    finally:
        added.set()
        pause.set()
        loop_thread.join()
    assert pause.is_set()
    series = [line for line in text.splitlines() if line.startswith(CHOICES + "{")]
    assert len(series) in (20_000, 20_001)
