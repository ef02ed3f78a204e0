"""The C/Python boundary (proxy.hotpath_spec, Hub.set_routes and Hub.set_stores) against what
a broken caller or a future maintainer may hand it: a table that fails to read part-way must
leave the hub serving the table it had (a half-read store once had no partitioners, and the
next request crashed the process; a half-read route matched with a key index outside the
request), a list that changes while it is read, and a route C does not serve ahead of one it
does (route order must stay the Python path's)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from proxy.hotpath_spec import HotRoute, HotStore, hot_routes
from tests.proxy.inprocess import (
    STORE,
    InProcessProxy,
    get,
    key_in,
    run,
    unique_id,
)


async def c_forwards_a_read(proxy: InProcessProxy, partition: int = 0) -> None:
    """One read of the default route after the table change: answered right, and by C."""
    before = proxy.forwarded_in_c
    client = proxy.connect()
    rid = unique_id("after")
    client.send(get(key_in(partition, "after"), rid))
    [reply] = await proxy.answers(client, 1)
    assert reply.status == 200, reply
    assert reply.header("x-request-id") == rid, reply
    assert proxy.forwarded_in_c == before + 1, "the C path kept its table and served it"


class HalfStore:
    """Its name reads, its partitioners are a list (not a tuple): reading stops there."""

    def __init__(self) -> None:
        self.c_serves = True
        self.name = STORE.name.encode()
        self.partitioners = [lambda key: 0]
        self.cache: list[Any] = []


def test_a_store_table_that_fails_part_way_leaves_the_old_one_in_place() -> None:
    async def scenario(proxy: InProcessProxy) -> None:
        await proxy.warm(0)
        with pytest.raises(TypeError, match=r"HotStore\.partitioners must be tuple"):
            proxy.proxy.hub.set_stores([HalfStore()])  # type: ignore[list-item]
        await c_forwards_a_read(proxy)

    run("c", scenario)


BAD_ROUTES: dict[str, tuple[dict[str, Any], type[Exception], str]] = {
    "key outside the template": (dict(key_index=99), ValueError, "inconsistent route"),
    # read up to its literals: half-read, it would match any path of four segments
    "literal text, not bytes": (
        dict(literals=((0, "stores"),)),
        TypeError,
        "HotRoute.literals holds",
    ),
}


@pytest.mark.parametrize("bad", list(BAD_ROUTES))
def test_a_route_table_that_fails_part_way_leaves_the_old_one_in_place(bad: str) -> None:
    changes, error, message = BAD_ROUTES[bad]

    async def scenario(proxy: InProcessProxy) -> None:
        await proxy.warm(0)
        hub = proxy.proxy.hub
        [default] = hot_routes(proxy.proxy.handler.routes.routes)
        with pytest.raises(error, match=message):
            hub.set_routes([replace(default, **changes)])
        await c_forwards_a_read(proxy)
        before = proxy.forwarded_in_c
        client = proxy.connect()
        key = key_in(0, "elsewhere")  # its partition's choice is cached: C could serve it
        client.send(f"GET /elsewhere/customers/keys/{key} HTTP/1.1\r\n\r\n".encode())
        await proxy.answers(client, 1)
        assert proxy.forwarded_in_c == before, "not keyed: the Python path passes it through"

    run("c", scenario)


class Shrinking:
    """A route that empties the list it is read from, as its first field is read."""

    def __init__(self, route: HotRoute, specs: list[Any]) -> None:
        self._route = route
        self._specs = specs

    def __getattr__(self, name: str) -> Any:
        self._specs.clear()
        return getattr(self._route, name)


def test_a_table_list_changed_while_it_is_read_is_read_as_it_was_given() -> None:
    async def scenario(proxy: InProcessProxy) -> None:
        await proxy.warm(0)
        hub = proxy.proxy.hub
        [default] = hot_routes(proxy.proxy.handler.routes.routes)
        specs: list[Any] = []
        specs += [Shrinking(default, specs), default, default]
        hub.set_routes(specs)  # three routes read, though the list is empty after the first
        await c_forwards_a_read(proxy)

    run("c", scenario)


def test_stores_keep_their_order_too_when_one_fails() -> None:
    """set_stores with every store valid but the last: the old table, not the first stores."""

    async def scenario(proxy: InProcessProxy) -> None:
        await proxy.warm(0)
        hub = proxy.proxy.hub
        renamed = HotStore(True, b"other", (lambda key: 0,), [None])
        with pytest.raises(TypeError):
            hub.set_stores([renamed, HalfStore()])  # type: ignore[list-item]
        await c_forwards_a_read(proxy)  # "customers" is still there

    run("c", scenario)


# A route C does not serve ahead of one it does, matching the same requests: the Python path
# takes "/c/<key>" as the first route (store "customers"); C must not serve it as the second
# (store "c", which does not exist: a 404 from the Python path's store lookup).
ORDERED_ROUTES = [
    {"path": "/c/{key}", "store": "customers"},
    {"path": "/{store}/{key}"},
]


@pytest.mark.parametrize("path", ["c", "python"])
def test_a_route_c_does_not_serve_keeps_its_place_in_the_order(path: str) -> None:
    async def scenario(proxy: InProcessProxy) -> None:
        await proxy.warm(0)  # the default route is not in this table: an unkeyed read
        hub = proxy.proxy.hub
        first, second = hot_routes(proxy.proxy.handler.routes.routes)
        hub.set_routes([replace(first, c_serves=False), second])
        client = proxy.connect()
        key = key_in(0, "order")
        for n in range(2):  # the second would be C's, were the route its to serve
            client.send(
                f"GET /c/{key} HTTP/1.1\r\nhost: proxy.test\r\nx-request-id: o-{n}\r\n\r\n".encode()
            )
        before = proxy.forwarded_in_c
        replies = await proxy.answers(client, 2)
        assert [r.status for r in replies] == [200, 200], replies
        assert proxy.forwarded_in_c == before, "the route C does not serve went to Python"
        client.send(f"GET /customers/{key} HTTP/1.1\r\nhost: proxy.test\r\n\r\n".encode())
        await proxy.answers(client, 3)
        if path == "c":
            assert proxy.forwarded_in_c == before + 1, "the route after it is C's"

    run(path, scenario, routes=json.dumps(ORDERED_ROUTES))
