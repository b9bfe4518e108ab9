"""A pytest plugin for ``scripts/array_api_suite.py``'s runs of the Array API suite (``-p spmd_suite_plugin``).

- Each test's outcome as soon as it is known, one line ``outcome<TAB>nodeid`` appended to ``$SPMD_SUITE_LOG``
  (and ``started<TAB>nodeid`` before it runs), so a run that dies part-way (a per-test timeout at N ranks
  aborts the MPI job; a file past its budget is killed) still counts what it finished, and the script can
  go on after the test it died in. Outcomes as a junit report counts them: an error in setup or teardown is a
  failure, an xfail is a skip. Only rank 0 (``$PMI_RANK``) writes.
- At N ranks (``$SPMD_SUITE_RANKS`` > 1) every rank must take the same examples, so hypothesis makes no
  decision by the clock, which differs between ranks: no ``too_slow`` health check (draw time, which includes
  the inputs' collectives), generation ends at the first failure (``report_multiple_bugs=False``: else it goes
  on for 10 s of wall time after it) and no shrink / explain phases (a 5-minute deadline). None of these
  changes whether a test passes: one failing example fails it either way; only the search after it is cut.
- Python's ``random`` seeded by the test's name before it runs: the suite's special-case tests take their value
  by ``strategy.example()``, which is not derandomized (the script passes ``--hypothesis-seed``) and shuffles
  with ``random``; unseeded, every rank (and every run) would test another value.
"""
from __future__ import annotations

import os
import random
import zlib

import pytest
from hypothesis import HealthCheck, Phase, settings

LOG = os.environ.get("SPMD_SUITE_LOG") if os.environ.get("PMI_RANK", "0") == "0" else None
_outcomes: dict[str, str] = {}


def _write(outcome: str, nodeid: str) -> None:
    if LOG:
        with open(LOG, "a") as f:
            f.write(f"{outcome}\t{nodeid}\n")


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """After the suite's conftest loaded its profile: the same profile, off the clock at N ranks."""
    if int(os.environ.get("SPMD_SUITE_RANKS", "1")) > 1:
        settings.register_profile("array-api-tests-lockstep", parent=settings.default, report_multiple_bugs=False,
                                  suppress_health_check=[HealthCheck.too_slow],
                                  phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target])
        settings.load_profile("array-api-tests-lockstep")


def pytest_runtest_logstart(nodeid, location):
    _write("started", nodeid)
    random.seed(zlib.crc32(nodeid.encode()))


def pytest_runtest_logreport(report):
    if report.failed:
        outcome = "failed"
    elif report.skipped:
        outcome = "skipped"
    else:
        outcome = "passed" if report.when == "call" else None
    if outcome and _outcomes.get(report.nodeid) != "failed":
        _outcomes[report.nodeid] = outcome


def pytest_runtest_logfinish(nodeid, location):
    _write(_outcomes.pop(nodeid, "failed"), nodeid)
