"""A pytest plugin for the GPU check: each failed phase's report is written as the test ends, not in the session's
closing summary, which a process timed out later (a hung test after it) never prints.

Loaded with ``-p benchmarks.pytest_live_report`` (this checkout on ``PYTHONPATH``).
"""

from __future__ import annotations

from typing import Any

BEGIN, END = "--- live report: ", "--- end of live report ---"
_config: list[Any] = []  # the session's config, for its terminal reporter


def pytest_configure(config: Any) -> None:
    _config[:] = [config]


def pytest_runtest_logreport(report: Any) -> None:
    terminal = _config[0].pluginmanager.get_plugin("terminalreporter") if _config else None
    if not report.failed or terminal is None:
        return
    terminal.write_line("")
    terminal.write_line(f"{BEGIN}{report.nodeid} ({report.when})")
    for line in report.longreprtext.splitlines():
        terminal.write_line(line)
    terminal.write_line(END)
