"""Route matching pinned where mutants of proxy/routes.py survived the other tests
(scripts/mutation, docs/testing.md): the table the C path matches with, and the exact
answers a client gets for a bad key.
"""

from __future__ import annotations

import dataclasses

import pytest

from proxy import _hotpath
from proxy.errors import BadRequest, KeyRejected
from proxy.hotpath_spec import HotRoute, c_serves_route, hot_routes
from proxy.routes import RouteTable, compile_route
from proxy.settings import RouteSpec

SPECS = (
    RouteSpec(path="/stores/{store}/keys/{key}"),
    RouteSpec(path="/v1/*/lookup", store="cards", key="query:id"),
    RouteSpec(path="/check/", store="cards", key="header:X-Card"),
)
TABLE = RouteTable(SPECS)
NO_HEADERS = {}.get


def test_the_c_path_gets_every_route_in_matching_order():
    """proxy._hotpath matches with these HotRoutes (proxy.hotpath_spec): segment count,
    literals, key source (0 path, 1 query, 2 header), key segment or -1, key name, store
    segment or -1, named store."""
    assert hot_routes(TABLE.routes) == [
        HotRoute(True, 4, ((0, b"stores"), (2, b"keys")), 0, 3, b"", 1, None),
        HotRoute(True, 3, ((0, b"v1"), (2, b"lookup")), 1, -1, b"id", -1, b"cards"),
        HotRoute(True, 1, ((0, b"check"),), 2, -1, b"x-card", -1, b"cards"),
    ]


def test_compiled_routes_say_where_key_and_store_are():
    route = compile_route(SPECS[0])
    assert (route.key_index, route.store_index, route.key_source, route.key_name) == (
        3,
        1,
        "path",
        "",
    )
    by_header = compile_route(SPECS[2])
    assert (by_header.key_index, by_header.store_index) == (None, None)
    assert (by_header.key_source, by_header.key_name) == ("header", "x-card")
    by_query = compile_route(RouteSpec(path="/q", store="s", key="query:ID"))
    assert by_query.key_name == "ID"  # query parameters are case-sensitive, headers are not


def test_a_template_with_a_trailing_slash_matches_its_segments():
    keyed = TABLE.match("/check", None, {"x-card": "7"}.get)
    assert keyed is not None
    assert (keyed.store, keyed.key) == ("cards", "7")


def test_the_store_segment_is_decoded_and_must_not_be_empty():
    keyed = TABLE.match("/stores/my%20store/keys/k", None, NO_HEADERS)
    assert keyed is not None
    assert keyed.store == "my store"
    with pytest.raises(BadRequest) as empty:
        TABLE.match("/stores//keys/k", None, NO_HEADERS)
    assert str(empty.value) == "empty store name in the path"
    with pytest.raises(BadRequest) as not_utf8:
        TABLE.match("/stores/%FF/keys/k", None, NO_HEADERS)
    assert str(not_utf8.value) == "the store name is percent-encoded bytes that are not UTF-8"
    with pytest.raises(BadRequest) as bad_key:
        TABLE.match("/stores/s/keys/%C3", None, NO_HEADERS)
    assert str(bad_key.value) == "the key is percent-encoded bytes that are not UTF-8"


def test_a_query_key_is_read_from_the_query_string_only():
    keyed = TABLE.match("/v1/x/lookup", "a=1&id=k%2B1&b=2", NO_HEADERS)
    assert keyed is not None
    assert keyed.key == "k+1"
    with pytest.raises(KeyRejected) as missing:
        TABLE.match("/v1/x/lookup", None, NO_HEADERS)
    assert str(missing.value) == "missing query parameter 'id' (the key)"
    with pytest.raises(KeyRejected) as twice:
        TABLE.match("/v1/x/lookup", "id=1&id=2&id=3", NO_HEADERS)
    assert str(twice.value) == "query parameter 'id' given 3 times"


def test_a_missing_header_key_names_the_header():
    with pytest.raises(KeyRejected) as missing:
        TABLE.match("/check", None, NO_HEADERS)
    assert str(missing.value) == "missing header 'x-card' (the key)"


def test_only_slashes_are_trimmed_from_a_template():
    table = RouteTable((RouteSpec(path="/XL/{key}/X", store="s"),))
    keyed = table.match("/XL/k/X", None, NO_HEADERS)
    assert keyed is not None
    assert (keyed.store, keyed.key) == ("s", "k")


def test_a_keyed_request_carries_the_route_it_matched():
    """The handler picks the route's key format and partitioner from it."""
    keyed = TABLE.match("/v1/x/lookup", "id=1", NO_HEADERS)
    assert keyed is not None
    assert keyed.route is TABLE.routes[1]


def test_no_query_string_means_no_parameter_whatever_its_name():
    table = RouteTable((RouteSpec(path="/q", store="s", key="query:XXXX"),))
    with pytest.raises(KeyRejected) as missing:
        table.match("/q", None, NO_HEADERS)
    assert str(missing.value) == "missing query parameter 'XXXX' (the key)"


def literal_path(segments: int) -> str:
    return "/" + "/".join(f"s{i}" for i in range(segments))


def test_the_c_path_serves_templates_up_to_its_segment_limit_and_no_longer():
    """C keeps a route's literals in fixed arrays of MAX_SEGMENTS (proxy/_hotpath.c): a route
    at the limit is C's, one segment more is the Python path's (which serves it the same)."""
    limit = _hotpath.MAX_SEGMENTS
    at_limit = compile_route(RouteSpec(path=literal_path(limit - 1) + "/{key}", store="s"))
    over = compile_route(RouteSpec(path=literal_path(limit) + "/{key}", store="s"))
    assert c_serves_route(at_limit)
    assert not c_serves_route(over)  # its literals alone fit: the segments do not
    every_segment_literal = compile_route(
        RouteSpec(path=literal_path(limit), store="s", key="query:id")
    )
    assert len(every_segment_literal.literals) == limit
    assert c_serves_route(every_segment_literal)


def test_a_key_source_c_does_not_read_is_the_python_paths():
    """A new key source starts as Python's (docs/proxy-hotpath.md): C is handed the route so
    routes keep their order, marked as not served."""
    cookie = dataclasses.replace(compile_route(SPECS[2]), key_source="cookie")
    assert not c_serves_route(cookie)
    (hot,) = hot_routes([cookie])
    assert hot.c_serves is False
