"""A pytest plugin for ``tests/test_layout.py``: list the test files pytest would import.

``pytest -p tests.collected_files --collect-only tests`` walks the folders as a real run does
(``norecursedirs``, ``python_files``, conftests) but imports no test module: each file it would
collect becomes an empty collector, and the paths are printed one per line, prefixed
``collected-file: ``. A full ``--collect-only`` imports every test module (torch, Megatron,
torchtitan, Ray): about 50 s of a loaded 2-core machine, for the same answer.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_SEEN: list[Path] = []


class _Unimported(pytest.File):
    def collect(self) -> list[pytest.Item]:
        return []


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.File:
    _SEEN.append(module_path)
    return _Unimported.from_parent(parent, path=module_path)


def pytest_collection_finish(session: pytest.Session) -> None:
    for path in _SEEN:
        print(f"collected-file: {path.relative_to(session.config.rootpath).as_posix()}")
