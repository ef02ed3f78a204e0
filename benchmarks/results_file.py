"""Write a benchmark's figures: a section of benchmarks/RESULTS.md and results/<name>.json.

Each script owns one section, delimited by markers, so re-running one benchmark replaces its
own figures and leaves the others' untouched.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent
RESULTS_MD = BENCHMARKS / "RESULTS.md"
RESULTS_JSON_DIR = BENCHMARKS / "results"

_HEADER = """# kroute benchmark results

Figures measured on this project's machine (2 cores, shared and noisy): compare the rows of one
run with each other, not with figures from another run. Each section says the command that
produced it; re-running that command replaces the section.
"""


def machine_notes() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, {platform.system()}"


def git_state() -> tuple[str, bool | None]:
    """(the commit checked out, short; whether tracked files differ from it); ("unknown", None)
    outside a git checkout."""
    try:
        head, changes = (
            subprocess.run(
                command, capture_output=True, text=True, check=True, cwd=BENCHMARKS, timeout=10
            ).stdout.strip()
            for command in (
                ["git", "rev-parse", "--short", "HEAD"],
                ["git", "status", "--porcelain", "--untracked-files=no"],
            )
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown", None
    return head, bool(changes)


def git_revision() -> str:
    """The commit measured, with "+changes" when tracked files differ from it (for prose)."""
    head, dirty = git_state()
    return f"{head}+changes" if dirty else head


def _stamped(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with the revision it measured: `revision` (a commit) and `dirty` (whether the
    tree had changes). A script that read git_revision() when it began keeps that (the tree may
    change during a long run); else the tree is read now."""
    given = data.get("revision")
    if isinstance(given, str) and given != "unknown":
        head, _, suffix = given.partition("+")
        return {**data, "revision": head, "dirty": suffix == "changes"}
    head, dirty = git_state()
    return {**data, "revision": head, "dirty": dirty}


def write_json(name: str, data: dict[str, Any]) -> Path:
    """results/<name>.json, stamped with the revision measured (see _stamped)."""
    RESULTS_JSON_DIR.mkdir(exist_ok=True)
    path = RESULTS_JSON_DIR / f"{name}.json"
    path.write_text(json.dumps(_stamped(data), indent=2, sort_keys=True) + "\n")
    return path


def write_section(name: str, markdown: str) -> Path:
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    text = RESULTS_MD.read_text() if RESULTS_MD.exists() else _HEADER
    block = f"{begin}\n{markdown.strip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    RESULTS_MD.write_text(text)
    return RESULTS_MD
