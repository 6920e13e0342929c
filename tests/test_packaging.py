"""pyproject.toml installs quietly: setuptools reads it without a deprecation (the licence as a
TOML table printed one three times per install), and the build asks for a setuptools that
reads an SPDX licence string (77+; older ones refuse it)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_setuptools_reads_the_pyproject_without_a_warning() -> None:
    pytest.importorskip("setuptools")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), str(ROOT / "pyproject.toml"))
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []
    assert dist.metadata.license_expression == "Apache-2.0"
    assert dist.metadata.name == "dcp-planner"


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is Python 3.11+")
def test_the_build_asks_for_a_setuptools_that_reads_spdx_licences() -> None:
    import tomllib
    from packaging.requirements import Requirement

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert isinstance(config["project"]["license"], str)
    (setuptools,) = [Requirement(r) for r in config["build-system"]["requires"]
                     if Requirement(r).name == "setuptools"]
    assert not setuptools.specifier.contains("76.9")
    assert setuptools.specifier.contains("77.0")
