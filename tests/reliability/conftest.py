"""Fixtures shared by the reliability tests (plain helpers are in ``helpers.py``)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs mounted under ``tmp_path``: a real full disk for a write of any size (or
    once filled); skips unless the test may mount (root)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
                      capture_output=True, check=False).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs (a real full disk)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
