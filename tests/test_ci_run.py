"""``.ci/run`` passes on the README's test command's status unchanged: a test run that collected no tests
(pytest exit 5) fails CI like any other non-zero status. A stand-in ``make`` on PATH gives the status."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

CI_RUN = Path(__file__).resolve().parents[1] / ".ci" / "run"


@pytest.mark.parametrize("status", [0, 1, 2, 5])
def test_ci_run_fails_unless_the_tests_pass(tmp_path, status):
    (tmp_path / "make").write_text(f"#!/usr/bin/env bash\necho \"make $*\" > {tmp_path / 'called'}\nexit {status}\n")
    (tmp_path / "make").chmod(0o755)
    r = subprocess.run(["bash", str(CI_RUN)], env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"},
                       capture_output=True, text=True, timeout=60)
    assert (tmp_path / "called").read_text().strip() == "make test"
    assert r.returncode == status, r.stdout + r.stderr
    if status == 5:
        assert "collected no tests" in r.stderr
