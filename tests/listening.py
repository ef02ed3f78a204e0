"""Closing a test server's listening sockets while connections are still arriving."""

from __future__ import annotations

import asyncio

# Accepted -> its transport made -> connection_made: the loop turns an accepted connection
# takes to reach the protocol.
_TURNS_TO_CONNECTION_MADE = 3


async def stop_listening(server: asyncio.Server) -> None:
    """`server.close()`, without dropping a connection on its way in. `Server.close()` while a
    connection is accepted but its transport not yet made makes asyncio drop that transport
    unclosed (CPython gh-109564): an unraisable ResourceWarning, which pytest reports in
    whatever test the garbage collector runs in. So: stop accepting, let the connections
    already accepted reach their protocols (which then own them), then close."""
    loop = asyncio.get_running_loop()
    for listening in server.sockets:
        loop.remove_reader(listening.fileno())
    for _ in range(_TURNS_TO_CONNECTION_MADE):
        await asyncio.sleep(0)
    server.close()
