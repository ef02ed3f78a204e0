"""A real headless browser (Debian's chromium) for pages a person reads: DOM after scripts ran,
and a screenshot kept as a test artifact (in $KROUTE_TEST_ARTIFACTS, else the test's tmp dir)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ARTIFACTS = Path(os.environ.get("KROUTE_TEST_ARTIFACTS", "test-artifacts"))


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    assert found, "chromium is missing: scripts/test installs it (apt-get install chromium)"
    return found


def _run(url: str, *flags: str, profile: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         f"--user-data-dir={profile}", "--virtual-time-budget=4000", "--window-size=1280,1600",
         *flags, url],
        check=False, capture_output=True, text=True, timeout=90,
    )  # fmt: skip


def rendered_dom(url: str, profile: Path) -> str:
    """The page's DOM once its scripts have run (fetches included)."""
    done = _run(url, "--dump-dom", profile=profile)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def screenshot(url: str, name: str, profile: Path) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = (ARTIFACTS / name).resolve()
    done = _run(url, f"--screenshot={path}", profile=profile)
    assert done.returncode == 0, done.stderr[-2000:]
    assert path.stat().st_size > 5_000, "an empty screenshot"
    return path
