"""Test-suite settings shared by every folder."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

from tests import progress

# No per-example deadline: on a loaded 2-core CI machine a pure-function example can take longer
# than hypothesis's default 200 ms (DeadlineExceeded seen in tests/runtime/data/test_shard.py),
# and these properties are about results, not speed (speed is measured in bench/).
settings.register_profile("dcp", deadline=None)
settings.load_profile("dcp")

# The planner's kernels compiled on their first call, in this process and every process a test
# starts: the suite tests the compiled kernels (auto mode would run most small tests' kernels as
# Python). tests/planner/test_jit.py compares the modes and runs auto where it is the subject.
os.environ.setdefault("DCP_PLANNER_JIT", "always")


@pytest.hookimpl(trylast=True)  # after pytest's terminal reporter exists
def pytest_configure(config: pytest.Config) -> None:
    progress.install(config)
