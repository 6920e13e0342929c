"""One line per test file as it finishes, in place of pytest's dots (the README's ``-q`` run).

The suite runs for many minutes on 2 cores; a row of dots says neither how far it is nor which
part is slow. With this plugin a quiet or normal run prints, when a file's last test is done::

    [ 41/731   0:52]  tests/planner/test_cli.py: 24 passed in 3.1 s
    [ 49/731   1:40]  tests/runtime/train/test_train_dist.py: 7 passed, 1 skipped in 47.9 s
        FAILED tests/runtime/train/test_train_dist.py::test_x

(tests done so far of those collected, the session's elapsed time, the file, its outcomes and
its wall time, module fixtures' set-up and tear-down included). A failure is named under its
file's line as soon as that file is done; pytest's own summary still follows at the end. The
lines carry no cursor tricks, so a CI log reads the same as a terminal. A verbose run (``-v``)
keeps pytest's own per-test lines, and ``-p no:dcp-file-progress`` turns this off.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Generator

import pytest

# pytest's own words, in the order its summary line uses.
_ORDER = ("failed", "passed", "skipped", "xfailed", "xpassed", "error")


class FileProgress:
    def __init__(self, config: pytest.Config) -> None:
        self._config = config
        self._start = time.monotonic()
        self._file_start: float | None = None
        self._counts: Counter[str] = Counter()
        self._failed: list[str] = []
        self._done = 0
        self._last: pytest.Item | None = None

    def _reporter(self) -> pytest.TerminalReporter | None:
        tr = self._config.pluginmanager.get_plugin("terminalreporter")
        return tr  # type: ignore[no-any-return]

    @pytest.hookimpl(wrapper=True)
    def pytest_report_teststatus(
        self, report: pytest.TestReport, config: pytest.Config
    ) -> Generator[None, tuple[str, str, object], tuple[str, str, object]]:
        # Keep pytest's category and word (its summary uses them); drop only the dot.
        category, _letter, word = yield
        return category, "", word

    def pytest_runtest_logstart(self, nodeid: str, location: tuple[str, int | None, str]) -> None:
        if self._file_start is None:
            self._file_start = time.monotonic()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        category, _, _ = self._config.hook.pytest_report_teststatus(
            report=report, config=self._config)
        if category:
            self._counts[category] += 1
            if category in ("failed", "error"):
                self._failed.append(f"{'FAILED' if category == 'failed' else 'ERROR'} "
                                    f"{report.nodeid}")
        if report.when == "teardown":
            self._done += 1

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> Generator[None, object, object]:
        result = yield
        self._last = item
        if nextitem is None or nextitem.path != item.path:
            self._file_done(item)
        return result

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        # A run stopped inside a file (-x, Ctrl-C): that file's line, for what did run.
        if self._last is not None and self._file_start is not None:
            self._file_done(self._last)

    def _file_done(self, item: pytest.Item) -> None:
        tr = self._reporter()
        now = time.monotonic()
        took = now - (self._file_start if self._file_start is not None else now)
        self._file_start = None
        if tr is None:
            return
        total = item.session.testscollected
        elapsed = int(now - self._start)
        outcomes = ", ".join(f"{self._counts[k]} {k}" for k in _ORDER if self._counts[k])
        where = item.nodeid.split("::", 1)[0]
        width = len(str(total))
        tr.ensure_newline()
        tr.write_line(
            f"[{self._done:{width}d}/{total} {elapsed // 60:3d}:{elapsed % 60:02d}]  {where}: "
            f"{outcomes or 'nothing run'} in {took:.1f} s",
            red=bool(self._failed),
        )
        for line in self._failed:
            tr.write_line(f"    {line}", red=True)
        self._counts.clear()
        self._failed.clear()


def install(config: pytest.Config) -> None:
    """Register the plugin for a quiet or normal terminal run (tests/conftest.py calls this)."""
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is None or config.get_verbosity() > 0 or config.getoption("collectonly"):
        return
    if config.pluginmanager.has_plugin("xdist") and config.getoption("numprocesses", None):
        return
    tr.showfspath = False  # the file's line replaces pytest's "path ....." prefix
    # and its count replaces the "[ 42%]" column (pytest would pad a lone "[100%]" line at the end)
    if hasattr(tr, "_show_progress_info"):
        tr._show_progress_info = False
    config.pluginmanager.register(FileProgress(config), "dcp-file-progress")
