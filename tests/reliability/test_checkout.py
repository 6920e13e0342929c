"""A clone placed anywhere, with nothing beside it, runs the README's commands.

Before: ``tests/bench/test_baselines.py::test_workloads_are_deterministic[wikipedia]`` read
``../shared/workloads/...``, which exists only beside the original checkout, and the README
pointed to a ``PLAN_FORMAT.md`` outside the repository.
"""

from __future__ import annotations

import gzip
import hashlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = ROOT / "data" / "workloads"
# A path that climbs out of the repository: "../x", parents[2] from a file one level down, ...
_ESCAPES = re.compile(r"""(["'/]\.\./|REPO\.parent|ROOT\.parent|parents\[(\d+)\]|/work/|shared/)""")


def _depth(path: Path) -> int:
    return len(path.relative_to(ROOT).parts) - 1


@pytest.mark.parametrize("folder", ["tests", "bench", "scripts", "planner", "runtime"])
def test_no_code_reads_outside_the_repository(folder: str) -> None:
    bad = []
    for path in sorted((ROOT / folder).rglob("*")):
        if path.suffix not in (".py", ".sh") or path == Path(__file__):
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for m in _ESCAPES.finditer(line):
                if m.group(2) is not None and int(m.group(2)) <= _depth(path):
                    continue  # parents[k] that stays inside the repository
                if m.group(1) == "shared/" and "shared/gpu-wheels" in line:
                    continue  # GPU scripts: the device machine's checkout carries shared/
                bad.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_workload_ships_with_its_licence() -> None:
    data = gzip.decompress((WORKLOADS / "flexsp_wikipedia_lengths.txt.gz").read_bytes())
    readme = (WORKLOADS / "README.md").read_text()
    assert hashlib.sha256(data).hexdigest() in readme
    assert len(data.split()) == 1_000_000
    licence = (WORKLOADS / "LICENSE.flexsp-apache-2.0").read_text()
    assert "Apache License" in licence
    assert "Version 2.0" in licence


def test_readme_links_resolve_inside_the_repository() -> None:
    docs = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))
    for doc in ("README.md", *docs, "BENCHMARKS.md"):
        text = (ROOT / doc).read_text()
        for target in re.findall(r"\]\(([^)#\s]+)", text):
            if "://" in target:
                continue
            assert (ROOT / doc).parent.joinpath(target).resolve().is_relative_to(ROOT), target
            assert ((ROOT / doc).parent / target).exists(), f"{doc}: link to missing {target}"
    assert (ROOT / "docs" / "PLAN_FORMAT.md").is_file()
