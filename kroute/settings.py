"""Settings of the run command (`kroute run`), read once from KROUTE_* environment variables."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field

from common.settings import EnvSettings, SettingsError

__all__ = ["RunSettings", "SettingsError"]


class RunSettings(EnvSettings):
    # KROUTE_PARTITIONS also named a node's hosted partitions; for the run command it was
    # always this count, so the old name still works (with a warning).
    env_names: ClassVar[dict[str, str]] = {"partitions": "KROUTE_DEMO_PARTITIONS"}
    deprecated_env: ClassVar[dict[str, str]] = {"KROUTE_PARTITIONS": "partitions"}

    workdir: Path = Field(
        default=Path(".run"), description="Where the run command keeps logs and service data."
    )
    broker_storage: str = Field(
        default="memory://tansu/",
        pattern=r"^(memory|s3|postgres)://",
        description="Tansu storage engine URL (memory:// loses data when the broker stops).",
    )
    startup_timeout_s: float = Field(
        default=30.0, gt=0, le=600, description="How long each service may take to answer."
    )
    proxy_port: int = Field(
        default=8080, ge=1, le=65535, description="The proxy's data port (on 127.0.0.1)."
    )
    admin_port: int = Field(
        default=8090,
        ge=1,
        le=65535,
        description="The proxy's admin port: health, metrics, the cluster status page.",
    )
    partitions: int = Field(
        default=12,
        ge=1,
        le=1000,
        description="Partitions of the demo's bookings topic (formerly KROUTE_PARTITIONS).",
    )
    demo_rate: float = Field(
        default=20.0, ge=0, le=10_000, description="Demo bookings written a second (0: none)."
    )
