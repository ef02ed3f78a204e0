"""Zip importers re-read an archive only when it changed (the fix for CPython gh-103200)."""

from __future__ import annotations

import os
import sys
import zipfile
import zipimport
from pathlib import Path

import pytest

from materializer.spark_worker import skip_unchanged_archive_rereads

pytestmark = pytest.mark.skipif(sys.version_info >= (3, 12), reason="lazy in Python 3.12+")


def write_archive(path: Path, modules: dict[str, str]) -> None:
    with zipfile.ZipFile(path, "w") as archive:
        for name, source in modules.items():
            archive.writestr(f"{name}.py", source)


def count_directory_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    reads: list[str] = []
    read_directory = zipimport._read_directory  # type: ignore[attr-defined]

    def counting(archive: str) -> object:
        reads.append(archive)
        return read_directory(archive)

    monkeypatch.setattr(zipimport, "_read_directory", counting)
    return reads


def test_an_unchanged_archive_is_not_read_again(tmp_path, monkeypatch):
    archive = tmp_path / "static.zip"
    write_archive(archive, {"static_module": "VALUE = 1\n"})
    importer = zipimport.zipimporter(str(archive))
    skip_unchanged_archive_rereads()
    reads = count_directory_reads(monkeypatch)

    for _ in range(5):
        importer.invalidate_caches()

    assert reads == [str(archive)]  # once, to learn its signature; never again
    assert importer.find_spec("static_module") is not None


def test_a_changed_archive_is_read_again_and_its_new_modules_found(tmp_path, monkeypatch):
    archive = tmp_path / "changing.zip"
    write_archive(archive, {"first_module": "VALUE = 1\n"})
    importer = zipimport.zipimporter(str(archive))
    skip_unchanged_archive_rereads()
    importer.invalidate_caches()
    assert importer.find_spec("second_module") is None

    write_archive(archive, {"first_module": "VALUE = 1\n", "second_module": "VALUE = 2\n"})
    later = archive.stat().st_mtime_ns + 1_000_000_000
    os.utime(archive, ns=(later, later))
    reads = count_directory_reads(monkeypatch)
    importer.invalidate_caches()

    assert reads == [str(archive)]
    assert importer.find_spec("second_module") is not None


def test_a_deleted_archive_is_forgotten(tmp_path):
    archive = tmp_path / "gone.zip"
    write_archive(archive, {"gone_module": "VALUE = 1\n"})
    importer = zipimport.zipimporter(str(archive))
    skip_unchanged_archive_rereads()
    importer.invalidate_caches()
    archive.unlink()

    importer.invalidate_caches()

    assert importer.find_spec("gone_module") is None
