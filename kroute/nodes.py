"""Start materializer nodes as real processes (`python -m materializer`) and talk to them.

Used by the run command, the tests and the benchmarks, so a node always starts the same way:
under the embedded-services launcher (stopped by PID, killed with its owner).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kroute.embedded import EmbeddedServices, ManagedProcess, free_port, kroute_environment


@dataclass
class NodeHandle:
    process: ManagedProcess
    url: str
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=10, trust_env=False))

    def get(self, path: str) -> httpx.Response:
        return self.client.get(self.url + path)

    def metadata(self) -> dict[str, Any]:
        return dict(self.get("/metadata").json())

    def is_ready(self) -> bool:
        try:
            return self.get("/health/ready").status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.is_ready():
            if not self.process.is_running():
                raise RuntimeError(f"node exited:\n{self.process.log_tail(40)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"node not ready after {timeout_s:.0f}s: {self.url}")
            time.sleep(0.3)

    def wait_caught_up(self, ends: dict[int, int], timeout_s: float = 120) -> dict[str, Any]:
        """Until every hosted partition's current offset equals the given end offset."""
        deadline = time.monotonic() + timeout_s
        metadata: dict[str, Any] = {}
        while time.monotonic() < deadline:
            if not self.process.is_running():
                raise RuntimeError(f"node exited:\n{self.process.log_tail(40)}")
            try:
                metadata = self.metadata()
            except httpx.HTTPError:
                time.sleep(0.2)
                continue
            current = {p["partition"]: p.get("current_offset") for p in metadata["partitions"]}
            if current and all(current.get(p) == end for p, end in ends.items()):
                return metadata
            time.sleep(0.05)
        raise TimeoutError(f"not caught up within {timeout_s:.0f}s: {metadata}")

    def close(self) -> None:
        self.client.close()


def node_environment(
    bootstrap: str, topic: str, data_dir: Path, port: int, name: str, **settings: str
) -> dict[str, str]:
    """The process environment for a node: ours without KROUTE_*, plus its settings."""
    return kroute_environment(
        node_id=name,
        bootstrap_servers=bootstrap,
        topic=topic,
        port=str(port),
        data_dir=str(data_dir),
        **settings,
    )


def start_node(
    services: EmbeddedServices,
    bootstrap: str,
    topic: str,
    data_dir: Path,
    *,
    name: str = "node-a",
    wait_ready: bool = True,
    **settings: str,
) -> NodeHandle:
    """Start a node on a free loopback port; by default wait until it is ready to serve."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = node_environment(bootstrap, topic, data_dir, port, name, **settings)

    def live() -> bool:
        try:
            return httpx.get(url + "/health/live", timeout=1, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    process = services.start_process(
        name, [sys.executable, "-m", "materializer"], env=env, ready=live, timeout_s=60
    )
    node = NodeHandle(process, url)
    if wait_ready:
        node.wait_ready()
    return node
