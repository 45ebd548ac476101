"""Bad command-line input found by a fresh user: each is refused with one line naming the option, exit 2, before
anything is scanned or written (no partial run folder left behind)."""
from __future__ import annotations

import pytest

from tests.deploy_helpers import run_cli


def _refused(r, out, *says):
    err = r.stderr.strip()
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for s in says:
        assert s in err, err
    assert not out.exists(), sorted(p.name for p in out.rglob("*"))  # nothing partial written


@pytest.mark.parametrize("families, says", [
    ("cnn,foo,cnn,cnn,cnn,cnn", ["--families", "'foo'", "densenet"]),  # unknown name: refused before the scan
    ("CNN,cnn,cnn,cnn,cnn,cnn", ["--families", "'CNN'"]),
    ("cnn,cnn", ["--families", "6 sites", "got 2"]),
    ("cnn,,cnn,cnn,cnn,cnn", ["--families", "empty", "position 2"]),
])
def test_simulate_refuses_bad_families_before_writing(tmp_path, families, says):
    out = tmp_path / "run"
    r = run_cli("simulate", "--method", "ohfl", "--families", families, "--data", str(tmp_path / "no_data"),
                "--out", str(out), timeout=120)
    _refused(r, out, *says)


def test_simulate_refuses_nonpositive_alpha_naming_the_option(tmp_path):
    out = tmp_path / "run"
    r = run_cli("simulate", "--method", "fedavg", "--scheme", "dirichlet", "--alpha", "-1",
                "--data", str(tmp_path / "no_data"), "--out", str(out), timeout=120)
    _refused(r, out, "--alpha", "-1")


def test_simulate_sites_check_is_one_line(tmp_path):
    out = tmp_path / "run"
    r = run_cli("simulate", "--method", "local", "--sites", "0", "--out", str(out), timeout=120)
    _refused(r, out, "--sites must be at least 1")


@pytest.mark.parametrize("flags, says", [(["--sites", "0"], ["--sites", "got 0"]),
                                         (["--sites", "2", "--scheme", "dirichlet", "--alpha", "-1"], ["--alpha", "-1"]),
                                         (["--sites", "2", "--scheme", "dirichlet", "--alpha", "0"], ["--alpha", "got 0"])])
def test_partition_names_the_bad_option_before_scanning(tmp_path, flags, says):
    out = tmp_path / "p"
    # the data root does not exist: the option check comes first, so its message (not the data's) is shown
    r = run_cli("partition", "--data", str(tmp_path / "no_data"), *flags, "--out", str(out), timeout=120)
    _refused(r, out, *says)
