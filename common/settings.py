"""The settings base: one frozen object per component, read once from KROUTE_* variables.

Each component subclasses EnvSettings and builds its settings from an injectable mapping
(`from_env(environ)`); an invalid value stops start-up with one message naming every variable
that is wrong, its value, and what it expects.
"""

from __future__ import annotations

import ipaddress
import os
import re
import textwrap
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Self
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, SecretStr, ValidationError
from pydantic.fields import FieldInfo

from partitioner import ALGORITHMS, KEY_FORMATS

ENV_PREFIX = "KROUTE_"


class SettingsError(ValueError):
    """One or more KROUTE_* variables are invalid; the message names each of them."""


class EnvSettings(BaseModel):
    """Base: fields map to KROUTE_<FIELD NAME IN CAPITALS> (or their `env_names` entry);
    unknown KROUTE_* names are ignored here and reported by common.known_settings."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    # Field name -> its variable, where that is not KROUTE_<FIELD NAME> (a name that says more
    # than the attribute the code reads).
    env_names: ClassVar[Mapping[str, str]] = {}
    # Old variable -> field name: still read, with a warning, while the new variable is unset.
    deprecated_env: ClassVar[Mapping[str, str]] = {}

    @classmethod
    def variable(cls, name: str) -> str:
        """The environment variable of a field."""
        return cls.env_names.get(name, ENV_PREFIX + name.upper())

    @classmethod
    def variables(cls) -> dict[str, str]:
        """Every variable this component reads -> its field (deprecated names included)."""
        current = {cls.variable(name): name for name in cls.model_fields}
        return {**current, **cls.deprecated_env}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Self:
        source = os.environ if environ is None else environ
        origin = {name: cls.variable(name) for name in cls.model_fields}
        for old, name in cls.deprecated_env.items():
            if old in source and origin[name] not in source:
                origin[name] = old
        values: dict[str, Any] = {
            name: source[variable] for name, variable in origin.items() if variable in source
        }
        for name, variable in origin.items():
            if name in values and variable in cls.deprecated_env:
                values[name] = cls.check_deprecated(variable, values[name])
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            problems = [_describe(error, values, cls, origin) for error in exc.errors()]
            raise SettingsError("invalid configuration: " + "; ".join(problems)) from None

    @classmethod
    def check_deprecated(cls, variable: str, value: str) -> str:
        """The value of a deprecated variable, if it can mean only what its new name means
        (SettingsError otherwise). Subclasses refuse values that are ambiguous."""
        return value

    @classmethod
    def deprecated_in(cls, environ: Mapping[str, str]) -> list[tuple[str, str]]:
        """(old variable, new variable) for each deprecated name set in the environment."""
        return [
            (old, cls.variable(name)) for old, name in cls.deprecated_env.items() if old in environ
        ]

    @classmethod
    def documentation(cls) -> list[tuple[str, str, str]]:
        """(variable, default, meaning) for every setting: the README's configuration table."""
        return [
            (cls.variable(name), _default_text(field), field.description or "")
            for name, field in cls.model_fields.items()
        ]


def help_text(cls: type[EnvSettings], usage: str, summary: str) -> str:
    """A --help answer: the usage, then every variable with its default and meaning."""
    lines = [
        f"usage: {usage}",
        "",
        *textwrap.wrap(summary, 96),
        "",
        "Settings (environment variables):",
    ]
    for variable, default, meaning in cls.documentation():
        lines.append(f"  {variable} (default: {default})")
        lines += textwrap.wrap(
            meaning,
            width=96,
            initial_indent="      ",
            subsequent_indent="      ",
            break_on_hyphens=False,  # keep Maven coordinates and flags whole
            break_long_words=False,
        )
    old = [f"{old} (now {cls.variable(name)})" for old, name in cls.deprecated_env.items()]
    if old:
        lines += ["", "Still read, with a warning: " + ", ".join(old) + "."]
    return "\n".join(lines) + "\n"


def _default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "(required)"
    if field.default_factory is not None:
        return "(computed)"
    return "(none)" if field.default is None else str(field.default)


def _describe(
    error: Any, values: dict[str, Any], cls: type[EnvSettings], origin: Mapping[str, str]
) -> str:
    field = str(error["loc"][0]) if error["loc"] else ""
    variable = origin.get(field, cls.variable(field))  # the variable the value came from
    if error["type"] == "missing":
        return f"{variable} is required"
    shown = "'***'" if _is_secret(cls.model_fields.get(field)) else repr(values.get(field))
    return f"{variable}={shown}: {error['msg']}"


def _is_secret(field: FieldInfo | None) -> bool:
    """A SecretStr setting (or an optional one): even an invalid value is never repeated."""
    if field is None:
        return False
    types = (field.annotation, *typing.get_args(field.annotation))
    # RedisUrl | None keeps RedisUrl's Annotated wrapper inside the union: look through it.
    return any(t is SecretStr or typing.get_args(t)[:1] == (SecretStr,) for t in types)


_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                       r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$")  # fmt: skip


def check_host(value: str) -> str:
    """An IP address or a DNS host name (RFC 1123), nothing else."""
    try:
        ipaddress.ip_address(value)
    except ValueError:
        if not _HOSTNAME.match(value):
            raise ValueError("expected an IP address or a host name") from None
    return value


def check_host_port(value: str) -> str:
    """host:port, with a port in 1-65535."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{value!r} is not host:port")
    check_host(host.removeprefix("[").removesuffix("]"))
    return value


def check_host_port_list(value: str) -> str:
    """Comma-separated host:port (Kafka's bootstrap servers)."""
    for item in value.split(","):
        check_host_port(item.strip())
    return value


def check_http_url(value: str) -> str:
    """http://host:port, with nothing else a proxy would have to guess about."""
    parts = urlsplit(value)
    if parts.scheme != "http" or not parts.netloc or parts.path not in ("", "/"):
        raise ValueError("expected http://host:port")
    check_host_port(parts.netloc)
    return value


def check_redis_url(value: SecretStr) -> SecretStr:
    """redis://, rediss:// (TLS) or unix://; the message never repeats the URL (a password)."""
    if urlsplit(value.get_secret_value()).scheme not in ("redis", "rediss", "unix"):
        raise ValueError("expected a redis://, rediss:// or unix:// URL")
    return value


def redacted_url(url: SecretStr) -> str:
    """The URL for a log line: where it points, with any user and password as ***."""
    parts = urlsplit(url.get_secret_value())
    if parts.username is None and parts.password is None:
        return parts.geturl()
    netloc = "***@" + parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=netloc).geturl()


def check_file(value: str) -> str:
    if not Path(value).is_file():
        raise ValueError("no such file")
    return value


def check_import_path(value: str) -> str:
    """module:function, both Python names."""
    module, sep, function = value.partition(":")
    names = [*module.split("."), function]
    if not sep or not all(name.isidentifier() for name in names):
        raise ValueError("expected module:function, e.g. mypackage.transforms:bookings")
    return value


def check_name(value: str) -> str:
    """Names that end up in Redis keys, URLs and Kafka (Kafka's legal topic characters)."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,249}", value):
        raise ValueError("expected 1-249 letters, digits, '.', '_' or '-'")
    return value


def check_spark_master(value: str) -> str:
    """The master URLs Spark knows; anything else would fail only after seconds of JVM start."""
    if not re.fullmatch(r"local(\[(\*|\d+)(,\d+)?\])?|(spark|k8s|mesos)://\S+|yarn", value):
        raise ValueError("expected local, local[N], local[*], spark://host:port, yarn or k8s://")
    return value


Name = Annotated[str, AfterValidator(check_name)]
SparkMaster = Annotated[str, AfterValidator(check_spark_master)]
Host = Annotated[str, AfterValidator(check_host)]
HostPortList = Annotated[str, AfterValidator(check_host_port_list)]
HttpUrl = Annotated[str, AfterValidator(check_http_url)]
RedisUrl = Annotated[SecretStr, AfterValidator(check_redis_url)]
ExistingFile = Annotated[str, AfterValidator(check_file)]
ImportPath = Annotated[str, AfterValidator(check_import_path)]


def known_partitioning_choice(field_name: str, value: str) -> str:
    """Validate a key_format or partitioner setting against what partitioner/ offers.

    The choices live in partitioner/, so settings check them here rather than as Literals.
    """
    choices = KEY_FORMATS if field_name == "key_format" else ALGORITHMS
    if value not in choices:
        raise ValueError(f"expected one of {', '.join(choices)}")
    return value
