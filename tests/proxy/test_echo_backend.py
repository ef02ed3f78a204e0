"""The stand-in node the proxy tests stop and restart under traffic: stopping it must close
every connection it accepted, however the connections and the stop interleave."""

from __future__ import annotations

import contextlib
import gc
import socket
import sys
import threading
import time

import pytest

from tests.proxy.echo_backend import EchoBackend


def test_stopping_under_a_stream_of_connections_leaves_no_transport_unclosed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stopped while connections arrive (as a prober's do), it used to drop a just-accepted
    connection's transport unclosed now and then (CPython gh-109564): an unraisable
    ResourceWarning that failed whichever test the collector happened to run in."""
    dropped: list[str] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda raised: dropped.append(repr(raised)))
    backend = EchoBackend("n").start()
    stop = threading.Event()

    def connect_and_close() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):  # refused while stopped
                socket.create_connection(("127.0.0.1", backend.port), timeout=0.5).close()

    connectors = [threading.Thread(target=connect_and_close) for _ in range(4)]
    for connector in connectors:
        connector.start()
    try:
        for _ in range(150):
            backend.stop()
            gc.collect()
            backend.restart()
            time.sleep(0.002)
    finally:
        stop.set()
        for connector in connectors:
            connector.join(5)
        backend.shutdown()
    gc.collect()
    assert dropped == [], f"{len(dropped)} objects dropped unclosed, first: {dropped[0]}"
