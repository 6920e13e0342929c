"""Fixtures of the bench scripts' smoke tests (plain helpers are in ``helpers.py``)."""

from __future__ import annotations

import subprocess

import pytest

from tests.bench.helpers import ROOT


@pytest.fixture
def planner_changed() -> bool:
    """Whether the working tree changed ``planner/`` since HEAD (then a HEAD-vs-this comparison
    may differ); skips outside a git checkout, where there is no HEAD to compare with."""
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                      check=False).returncode != 0:
        pytest.skip("not a git checkout")
    return bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "planner"],
                               capture_output=True, text=True, check=True).stdout.strip())
