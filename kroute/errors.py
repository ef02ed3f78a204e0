"""Errors of the product shell (run command, embedded services).

KrouteError(Exception)
├── ServiceStartError   an embedded service could not be started; says which and what to do
└── UsageError          bad arguments or input files: the command exits 2, not 1
"""

from __future__ import annotations


class KrouteError(Exception):
    """Base class for errors the run command reports to a person and exits on."""


class ServiceStartError(KrouteError):
    def __init__(self, service: str, detail: str) -> None:
        self.service = service
        self.detail = detail
        super().__init__(f"{service}: {detail}")


class UsageError(KrouteError):
    """What a person typed or wrote is wrong (a flag, a URL, a file): exit code 2."""
