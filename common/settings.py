"""The settings base: one frozen object per component, read once from KROUTE_* variables.

Each component subclasses EnvSettings and builds its settings from an injectable mapping
(`from_env(environ)`); an invalid value stops start-up with one message naming every variable
that is wrong, its value, and what it expects.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.fields import FieldInfo

from partitioner import ALGORITHMS, KEY_FORMATS

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
            problems = [_describe(error, values) for error in exc.errors()]
            raise SettingsError("invalid configuration: " + "; ".join(problems)) from None

    @classmethod
    def documentation(cls) -> list[tuple[str, str, str]]:
        """(variable, default, meaning) for every setting: the README's configuration table."""
        return [
            (ENV_PREFIX + name.upper(), _default_text(field), field.description or "")
            for name, field in cls.model_fields.items()
        ]


def _default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "(required)"
    if field.default_factory is not None:
        return "(computed)"
    return "(none)" if field.default is None else str(field.default)


def _describe(error: Any, values: dict[str, Any]) -> str:
    field = str(error["loc"][0]) if error["loc"] else ""
    variable = ENV_PREFIX + field.upper()
    if error["type"] == "missing":
        return f"{variable} is required"
    return f"{variable}={values.get(field)!r}: {error['msg']}"


def known_partitioning_choice(field_name: str, value: str) -> str:
    """Validate a key_format or partitioner setting against what partitioner/ offers.

    The choices live in partitioner/, so settings check them here rather than as Literals.
    """
    choices = KEY_FORMATS if field_name == "key_format" else ALGORITHMS
    if value not in choices:
        raise ValueError(f"expected one of {', '.join(choices)}")
    return value
