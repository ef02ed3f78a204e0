"""Settings of the run command (`kroute run`), read once from KROUTE_* environment variables."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from common.settings import EnvSettings, SettingsError

__all__ = ["RunSettings", "SettingsError"]


class RunSettings(EnvSettings):
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
