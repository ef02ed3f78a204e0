"""Keyed routes: from a request's path, query and headers to (store, key text) — pure.

A route is a path template whose segments are literals, `{key}`, `{store}` or `*` (any one
segment). The key comes from the `{key}` segment, a query parameter or a header. Templates are
grouped by segment count, so matching a request costs a dict lookup and a few comparisons.
A request that matches no template is not keyed: the proxy passes it to any live node.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote

from proxy.errors import BadRequest, KeyRejected
from proxy.settings import RouteSpec

_ANY = "*"


@dataclass(frozen=True, slots=True)
class KeyedRequest:
    route: CompiledRoute
    store: str
    key: str


@dataclass(frozen=True, slots=True)
class CompiledRoute:
    spec: RouteSpec
    literals: tuple[tuple[int, str], ...]  # (segment index, text) that must match
    key_index: int | None
    store_index: int | None
    key_source: str  # path | query | header
    key_name: str  # query parameter or lower-case header name

    def match(self, segments: list[str]) -> bool:
        return all(segments[i] == text for i, text in self.literals)


def compile_route(spec: RouteSpec) -> CompiledRoute:
    segments = spec.path.strip("/").split("/")
    literals = tuple((i, s) for i, s in enumerate(segments) if s not in ("{key}", "{store}", _ANY))
    kind, _, name = spec.key.partition(":")
    return CompiledRoute(
        spec=spec,
        literals=literals,
        key_index=segments.index("{key}") if "{key}" in segments else None,
        store_index=segments.index("{store}") if "{store}" in segments else None,
        key_source=kind,
        key_name=name.lower() if kind == "header" else name,
    )


class RouteTable:
    def __init__(self, specs: tuple[RouteSpec, ...]) -> None:
        self.routes = tuple(compile_route(spec) for spec in specs)
        self._by_length: dict[int, list[CompiledRoute]] = {}
        for route in self.routes:
            length = len(route.spec.path.strip("/").split("/"))
            self._by_length.setdefault(length, []).append(route)

    def match(
        self, path: str, query: str | None, header: Callable[[str], str | None]
    ) -> KeyedRequest | None:
        """The keyed request this is, None when no route matches; KeyRejected for a bad key."""
        segments = path[1:].split("/")  # "/a/b/" has an empty last segment: an empty key
        for route in self._by_length.get(len(segments), ()):
            if route.match(segments):
                return self._extract(route, segments, query, header)
        return None

    @staticmethod
    def _extract(
        route: CompiledRoute,
        segments: list[str],
        query: str | None,
        header: Callable[[str], str | None],
    ) -> KeyedRequest:
        if route.store_index is not None:
            store = _decoded(segments[route.store_index], "store name")
        else:
            store = route.spec.store or ""
        if route.key_source == "path":
            assert route.key_index is not None
            key = _decoded(segments[route.key_index], "key")
        elif route.key_source == "query":
            values = parse_qs(query or "", keep_blank_values=True).get(route.key_name)
            if not values:
                raise KeyRejected(f"missing query parameter {route.key_name!r} (the key)")
            if len(values) > 1:
                raise KeyRejected(f"query parameter {route.key_name!r} given {len(values)} times")
            key = values[0]
        else:
            found = header(route.key_name)
            if found is None:
                raise KeyRejected(f"missing header {route.key_name!r} (the key)")
            key = found
        if not store:
            raise BadRequest("empty store name in the path")
        return KeyedRequest(route, store, key)


def _decoded(segment: str, what: str) -> str:
    if "%" not in segment:
        return segment
    try:
        return unquote(segment, errors="strict")
    except UnicodeDecodeError:
        raise BadRequest(f"the {what} is percent-encoded bytes that are not UTF-8") from None
