"""Start the proxy as a real process (`python -m proxy`) and talk to it.

Used by the run command, the tests and the benchmarks, so the proxy always starts the same way:
under the embedded-services launcher (stopped by PID, killed with its owner).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import httpx

from kroute.embedded import EmbeddedServices, ManagedProcess, free_port, kroute_environment


@dataclass
class ProxyHandle:
    process: ManagedProcess
    url: str
    admin_url: str
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=10, trust_env=False))

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.client.get(self.url + path, **kwargs)

    def admin(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.client.get(self.admin_url + path, **kwargs)

    def status(self) -> dict[str, Any]:
        return dict(self.admin("/cluster/status").json())

    def is_live(self) -> bool:
        try:
            return self.admin("/health/live").status_code == 200
        except httpx.HTTPError:
            return False

    def is_ready(self) -> bool:
        try:
            return self.admin("/health/ready").status_code == 200
        except httpx.HTTPError:
            return False

    def worker_pids(self) -> list[int]:
        """The worker processes' pids (KROUTE_WORKERS above 1; none for one process), as the
        proxy's parent reports them (a worker being restarted: None)."""
        return [w["pid"] for w in self.status().get("workers", []) if w["pid"] is not None]

    def close(self) -> None:
        self.client.close()


def start_proxy(
    services: EmbeddedServices,
    redis_url: str,
    *,
    name: str = "proxy",
    wait_ready: bool = True,
    timeout_s: float = 30,
    port: int | None = None,
    admin_port: int | None = None,
    admin_host: str = "127.0.0.1",
    workers: int = 1,
    cpus: str | None = None,
    **settings: str,
) -> ProxyHandle:
    """A proxy on loopback ports (free ones unless given); settings are KROUTE_* names without
    the prefix. The admin listener may get an address of its own (another loopback one).

    One process unless `workers` says more (KROUTE_WORKERS; the proxy's own default is one per
    core): what a test or benchmark measures is then one proxy's behaviour, and a proxy
    started here never competes for the cores with the services it is measured with unasked.
    `cpus` pins the proxy (and its workers) to those CPUs (a taskset list such as 0,1)."""
    port, admin_port = port or free_port(), admin_port or free_port(admin_host)
    env = kroute_environment(
        redis_url=redis_url,
        host="127.0.0.1",
        port=str(port),
        admin_host=admin_host,
        admin_port=str(admin_port),
        workers=str(workers),
        **settings,
    )
    command = [sys.executable, "-m", "proxy"]
    if cpus is not None:
        command = ["taskset", "-c", cpus, *command]
    process = services.start_process(name, command, env=env)
    handle = ProxyHandle(process, f"http://127.0.0.1:{port}", f"http://{admin_host}:{admin_port}")
    services.await_ready(process, handle.is_ready if wait_ready else handle.is_live, timeout_s)
    return handle
