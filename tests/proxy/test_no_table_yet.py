"""A real proxy started while Redis is not there: it has no routing table, and says so.

A keyed read then gets 503 `no_routing_table` (retriable), not 404 `unknown_store`, which
would tell the client that the store does not exist."""

from __future__ import annotations

import uuid

import httpx
import pytest

from kroute.embedded import EmbeddedServices, free_port
from kroute.proxies import start_proxy

pytestmark = pytest.mark.integration


def test_a_proxy_without_a_table_answers_503_no_routing_table(embedded: EmbeddedServices):
    nowhere = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    proxy = start_proxy(
        embedded,
        nowhere,
        name=f"proxy-no-table-{uuid.uuid4().hex[:6]}",
        cluster="no-table",
        wait_ready=False,
        redis_timeout_ms="200",
    )
    try:
        with httpx.Client(timeout=10, trust_env=False) as client:
            answer = client.get(f"{proxy.url}/stores/customers/keys/c-1")
            assert answer.status_code == 503, answer.text
            assert answer.headers["retry-after"] == "1"
            body = answer.json()
            assert body["error"] == "no_routing_table"
            assert body["store"] == "customers"
            assert client.get(f"{proxy.admin_url}/health/ready").status_code == 503
    finally:
        proxy.process.stop()
        proxy.close()
