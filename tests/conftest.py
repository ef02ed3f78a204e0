"""Session fixtures: the real embedded services, started once and always stopped."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kroute.embedded import BrokerHandle, EmbeddedServices, RedisHandle


@pytest.fixture(scope="session")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServices]:
    services = EmbeddedServices(tmp_path_factory.mktemp("services"))
    try:
        yield services
    finally:
        services.stop()


@pytest.fixture(scope="session")
def broker(embedded: EmbeddedServices) -> BrokerHandle:
    return embedded.start_broker()


@pytest.fixture(scope="session")
def redis_server(embedded: EmbeddedServices) -> RedisHandle:
    return embedded.start_redis()
