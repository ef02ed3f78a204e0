"""Settings of the run command, read once from KROUTE_* environment variables.

Each component gets one frozen settings object built from an injectable mapping; an invalid
value stops start-up with one message naming the variable and what it expects.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError

ENV_PREFIX = "KROUTE_"


class SettingsError(ValueError):
    """One or more KROUTE_* variables are invalid; the message names each of them."""


class EnvSettings(BaseModel):
    """Base: fields map to KROUTE_<FIELD NAME IN CAPITALS>; unknown KROUTE_* names are ignored."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Self:
        source = os.environ if environ is None else environ
        values: dict[str, Any] = {
            name: source[ENV_PREFIX + name.upper()]
            for name in cls.model_fields
            if ENV_PREFIX + name.upper() in source
        }
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            problems = [
                f"{ENV_PREFIX}{str(error['loc'][0]).upper()}={values.get(str(error['loc'][0]))!r}: "
                f"{error['msg']}"
                for error in exc.errors()
            ]
            raise SettingsError("invalid configuration: " + "; ".join(problems)) from None

    @classmethod
    def documentation(cls) -> list[tuple[str, str, str]]:
        """(variable, default, meaning) for every setting: the README's configuration table."""
        return [
            (ENV_PREFIX + name.upper(), str(field.default), field.description or "")
            for name, field in cls.model_fields.items()
        ]


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
