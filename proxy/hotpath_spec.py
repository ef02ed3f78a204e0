"""What the C path (proxy/_hotpath.c) is given: the C/Python boundary's data, built here once.

The C path serves the common case (proxy/_hotpath.c's header says which); everything it needs
about routes and stores is a named structure from this module, read by field name once in
`Hub.set_routes` and `Hub.set_stores` (never while serving), and each carries `c_serves`:
whether C may serve it at all. Which routes and stores C serves is decided here, in
`c_serves_route` and `c_serves_store`, and nowhere in C: a route C does not serve is still
passed (with its segment count and literals), so a request that matches it goes to the Python
path and routes are tried in the same order on both paths.

The rest of the contract (docs/proxy-hotpath.md):

- what C calls on Python objects: `transport.write`, `slow_data_received` (both protocols),
  `after_fast_response` (`proxy.listener.ClientConnection`), `adopt` and `close_now`
  (`proxy.upstream.UpstreamConnection`), and each `HotStore.partitioners` callable;
- what C reads of Python-built objects besides these structures: `Candidate` and `Cached`
  (built by `proxy.handler`, C types with named fields) and `ClientBase.client_ip_bytes`;
- the clock: C's `shared_now_ms` is `common.clock.SHARED.now_ms()`, read as the wall clock
  plus `Hub.clock_offset_ms`, which `sync_clock` sets (from `RequestHandler.use_snapshot`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from common.clock import SHARED
from proxy import _hotpath
from proxy._hotpath import Hub
from proxy.routes import CompiledRoute

# The key sources C can read, as C numbers them; a route with any other source is Python's.
C_KEY_SOURCES = {
    "path": _hotpath.KEY_PATH,
    "query": _hotpath.KEY_QUERY,
    "header": _hotpath.KEY_HEADER,
}
NOT_IN_C = -1  # a key source, key index or store index C does not have


@dataclass(frozen=True, slots=True)
class HotRoute:
    """One keyed route as `Hub.set_routes` reads it (routes in matching order)."""

    c_serves: bool  # False: a request this route may match goes to the Python path
    segments: int  # path segments of the template
    literals: tuple[tuple[int, bytes], ...]  # (segment index, text) that must match
    key_source: int  # C_KEY_SOURCES value, NOT_IN_C when C does not serve the route
    key_index: int  # the {key} segment, NOT_IN_C when the key is not in the path
    key_name: bytes  # query parameter or lower-case header name (b"" for a path key)
    store_index: int  # the {store} segment, NOT_IN_C when the route names its store
    fixed_store: bytes | None  # the store the route names, None when the path does


@dataclass(frozen=True, slots=True)
class HotStore:
    """One store as `Hub.set_stores` reads it."""

    c_serves: bool  # False: every request for this store goes to the Python path
    name: bytes
    partitioners: tuple[Callable[[str], int], ...]  # per route index: key -> partition
    cache: list[Any]  # per partition, a Cached choice or None; shared with proxy.handler


def c_serves_route(route: CompiledRoute) -> bool:
    """Whether the C path may serve requests of `route`: a key source it reads (path, query,
    header; a new one is Python's until C learns it) and a template short enough for its
    fixed arrays. Everything else about a request (its bytes, headers, store) C checks per
    request, handing what it cannot serve to the Python path."""
    return (
        route.key_source in C_KEY_SOURCES
        and template_segments(route) <= _hotpath.MAX_SEGMENTS
        and len(route.literals) <= _hotpath.MAX_SEGMENTS
    )


def c_serves_store(name: str) -> bool:
    """Whether the C path may serve a store: every store today, as C asks the store's own
    partitioners for a key's partition (a key they refuse goes to the Python path's 400).
    The place to leave a store to Python (its name is kept for that rule)."""
    del name
    return True


def template_segments(route: CompiledRoute) -> int:
    return len(route.spec.path.strip("/").split("/"))


def hot_route(route: CompiledRoute) -> HotRoute:
    serves = c_serves_route(route)
    return HotRoute(
        c_serves=serves,
        segments=template_segments(route),
        literals=tuple((index, text.encode()) for index, text in route.literals),
        key_source=C_KEY_SOURCES[route.key_source] if serves else NOT_IN_C,
        key_index=NOT_IN_C if route.key_index is None else route.key_index,
        key_name=route.key_name.encode(),
        store_index=NOT_IN_C if route.store_index is None else route.store_index,
        fixed_store=None if route.spec.store is None else route.spec.store.encode(),
    )


def hot_routes(routes: Sequence[CompiledRoute]) -> list[HotRoute]:
    """The routes as `Hub.set_routes` takes them, in matching order."""
    return [hot_route(route) for route in routes]


def hot_store(
    name: str, partitioners: Sequence[Callable[[str], int]], cache: list[Any]
) -> HotStore:
    return HotStore(c_serves_store(name), name.encode(), tuple(partitioners), cache)


def sync_clock(hub: Hub) -> None:
    """Align C's shared clock with `common.clock.SHARED` (the one place the offset is set)."""
    hub.clock_offset_ms = SHARED.wall_offset_ms()
