"""The order in which pytest-xdist hands test files to its workers: longest first, by measured time.

xdist gives each worker whole files (--dist loadfile) in collection order (--no-loadscope-reorder in
pyproject.toml); by default it would hand out the files with the most tests first, which leaves the
few long end-to-end files for last while one core idles. Here the selected tests of each file are
summed from tests/durations.json (each test's setup, call and teardown seconds, measured on 2
workers), so the fast tier (-m "not slow") is ordered by its own tests too. A test the file does not
name yet counts as its file's mean; a file it does not name at all goes first (it may be long, and a
short one costs the end of the run nothing).

`python -m pytest --record-durations` (the whole suite) rewrites the file from its run. tests/conftest.py
imports these hooks.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import pytest

__all__ = ["pytest_addoption", "pytest_configure", "pytest_collection_modifyitems", "pytest_runtest_logreport",
           "pytest_sessionfinish", "DURATIONS_FILE"]

DURATIONS_FILE = Path(__file__).with_name("durations.json")
_TESTS = DURATIONS_FILE.parent


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--record-durations", action="store_true",
                     help="write each test's measured seconds (this run's) into tests/durations.json, from which "
                     "the test files are handed to the workers longest first")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--record-durations") and (config.option.markexpr or config.option.keyword):
        raise pytest.UsageError("--record-durations records the whole suite's times: run it without -m or -k")


def _test_id(nodeid: str, rootpath: Path) -> str | None:
    """A test's id as tests/durations.json names it (its path relative to tests/), None outside tests/."""
    path, sep, rest = nodeid.partition("::")
    try:
        return (rootpath / path).resolve().relative_to(_TESTS).as_posix() + sep + rest
    except ValueError:
        return None


def _recorded() -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(DURATIONS_FILE.read_text()).items()}
    except FileNotFoundError:
        return {}


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected: the order of what runs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seconds = _recorded()
    files: dict[str, list[str | None]] = defaultdict(list)
    for item in items:
        files[item.path.as_posix()].append(_test_id(item.nodeid, config.rootpath))

    def file_seconds(ids: list[str | None]) -> float:
        known = [seconds[i] for i in ids if i in seconds]
        if not known:
            return math.inf if any(i is not None for i in ids) else 0.0  # (outside tests/: last)
        mean = sum(known) / len(known)
        return sum(seconds.get(i, mean) for i in ids if i is not None)

    total = {path: file_seconds(ids) for path, ids in files.items()}
    items.sort(key=lambda item: -total[item.path.as_posix()])  # stable: each file's tests keep their order


_measured: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _measured[report.nodeid] += report.duration  # setup + call + teardown (the controller sees every worker's)


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    if not config.getoption("--record-durations") or hasattr(config, "workerinput"):
        return
    measured = {test: round(s, 2) for nodeid, s in _measured.items()
                if (test := _test_id(nodeid, config.rootpath)) is not None}
    ran = {test.partition("::")[0] for test in measured}
    seconds = {test: s for test, s in _recorded().items()  # the files this run left out, unless since removed
               if test.partition("::")[0] not in ran and (_TESTS / test.partition("::")[0]).is_file()}
    seconds.update(measured)
    DURATIONS_FILE.write_text(json.dumps(dict(sorted(seconds.items())), indent=0) + "\n")
