"""Keyed routes: templates, key sources and the errors a client sees (pure)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from proxy.errors import BadRequest, KeyRejected
from proxy.routes import RouteTable
from proxy.settings import DEFAULT_ROUTES, RouteSpec, parse_routes

TABLE = RouteTable(
    (
        *parse_routes(DEFAULT_ROUTES),
        RouteSpec(path="/customers/{key}", store="customers"),
        RouteSpec(path="/v1/*/lookup", store="cards", key="query:id"),
        RouteSpec(path="/check", store="cards", key="header:X-Card"),
    )
)
NO_HEADERS = {}.get


def test_path_key_and_store():
    keyed = TABLE.match("/stores/orders/keys/o-1", None, NO_HEADERS)
    assert keyed is not None
    assert (keyed.store, keyed.key) == ("orders", "o-1")


def test_percent_encoded_keys_are_decoded_and_empty_keys_kept():
    keyed = TABLE.match("/stores/s/keys/a%2Fb%20c", None, NO_HEADERS)
    assert keyed is not None
    assert keyed.key == "a/b c"
    empty = TABLE.match("/stores/s/keys/", None, NO_HEADERS)
    assert empty is not None
    assert empty.key == ""


def test_fixed_store_wildcard_query_and_header_keys():
    assert TABLE.match("/customers/c-9", None, NO_HEADERS).key == "c-9"  # type: ignore[union-attr]
    by_query = TABLE.match("/v1/anything/lookup", "id=42&x=1", NO_HEADERS)
    assert by_query is not None
    assert (by_query.store, by_query.key) == ("cards", "42")
    by_header = TABLE.match("/check", None, {"x-card": "7"}.get)
    assert by_header is not None
    assert by_header.key == "7"


def test_blank_query_and_header_keys_are_keys():
    """An empty key is a key (producers write records keyed b""): a blank query value or header
    is looked up like the empty path segment, not taken as missing, and a blank value still
    counts when the parameter is given twice."""
    by_query = TABLE.match("/v1/x/lookup", "id=&x=1", NO_HEADERS)
    assert by_query is not None
    assert (by_query.store, by_query.key) == ("cards", "")
    with pytest.raises(KeyRejected, match="given 2 times"):
        TABLE.match("/v1/x/lookup", "id=&id=2", NO_HEADERS)
    by_header = TABLE.match("/check", None, {"x-card": ""}.get)
    assert by_header is not None
    assert by_header.key == ""


def test_unkeyed_paths_match_nothing():
    for path in ("/", "/stores/s/keys", "/stores/s/keys/k/extra", "/customers", "/other"):
        assert TABLE.match(path, None, NO_HEADERS) is None


def test_missing_or_ambiguous_keys_are_rejected():
    with pytest.raises(KeyRejected, match="missing query parameter 'id'"):
        TABLE.match("/v1/x/lookup", "other=1", NO_HEADERS)
    with pytest.raises(KeyRejected, match="given 2 times"):
        TABLE.match("/v1/x/lookup", "id=1&id=2", NO_HEADERS)
    with pytest.raises(KeyRejected, match="missing header 'x-card'"):
        TABLE.match("/check", None, NO_HEADERS)
    with pytest.raises(BadRequest, match="not UTF-8"):
        TABLE.match("/stores/s/keys/%FF", None, NO_HEADERS)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"path": "/a/{key}"}, "store"),
        ({"path": "/a", "store": "s"}, "no {key}"),
        ({"path": "/a/{key}", "store": "s", "key": "query:id"}, "not the path"),
        ({"path": "/a/{key}", "store": "s", "key": "cookie:x"}, "key must be"),
        ({"path": "/a/{key}", "store": "s", "key_format": "float"}, "key_format"),
        ({"path": "/a/{key}", "store": "s", "partitioner": "md5"}, "partitioner"),
        ({"path": "a/{key}", "store": "s"}, "pattern"),
    ],
)
def test_bad_route_specs_say_what_is_wrong(spec, message):
    with pytest.raises(ValidationError, match=message):
        RouteSpec.model_validate(spec)
