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
    _refused(r, out, "--sites: must be an integer >= 1, got 0")


@pytest.mark.parametrize("flags, says", [
    (["--sites", "0"], ["--sites", "got 0"]),
    (["--sites", "2", "--scheme", "dirichlet", "--alpha", "-1"], ["--alpha", "-1"]),
    (["--sites", "2", "--scheme", "dirichlet", "--alpha", "0"], ["--alpha", "got 0"]),
])
def test_partition_names_the_bad_option_before_scanning(tmp_path, flags, says):
    out = tmp_path / "p"
    # the data root does not exist: the option check comes first, so its message (not the data's) is shown
    r = run_cli("partition", "--data", str(tmp_path / "no_data"), *flags, "--out", str(out), timeout=120)
    _refused(r, out, *says)


@pytest.mark.parametrize("cmd", [["status", "5"], ["results", "5", "--out", "OUT"], ["submit", "--job", "JOB"]])
def test_startup_kit_missing_or_not_an_admin_kit_is_bad_input(tmp_path, cmd):
    """No --startup-kit, or a server kit given as one: exit 2 naming --startup-kit, not a server error (exit 1)."""
    out = tmp_path / "out"
    args = [a.replace("OUT", str(out)) for a in cmd]
    if "JOB" in args:  # a well-formed exported job, so that the kit is what is checked
        job_root = tmp_path / "jobs"
        r = run_cli("export-job", "--method", "fedavg", "--profile", "site_configs/consortium", "--out", str(job_root))
        assert r.returncode == 0, r.stderr
        args = [a.replace("JOB", str(job_root / "cxr_hfl_fedavg")) for a in args]
    if cmd[0] != "status":  # status 5 without a kit is "not a run folder", tested elsewhere
        r = run_cli(*args, timeout=120)
        _refused(r, out, "--startup-kit", "required")
    server_kit = tmp_path / "server.example.org"
    (server_kit / "startup").mkdir(parents=True)
    (server_kit / "startup" / "fed_server.json").write_text("{}")
    (server_kit / "local").mkdir()
    r = run_cli(*args, "--startup-kit", str(server_kit), timeout=120)
    _refused(r, out, f"--startup-kit {server_kit}", "fed_admin.json")


@pytest.mark.parametrize("flags, says", [(["--families", "cnn,foo,cnn,cnn,cnn,cnn"], ["--families", "'foo'"]),
                                         (["--scheme", "dirichlet", "--alpha", "0"], ["--alpha", "got 0"]),
                                         (["--methods", ""], ["--methods", "empty"])])
def test_compare_refuses_bad_site_options_before_writing(tmp_path, flags, says):
    out = tmp_path / "cmp"
    args = ["compare", *(["--methods", "local,fedavg"] if "--methods" not in flags else []), *flags,
            "--data", str(tmp_path / "no_data"), "--out", str(out), "--dry-run"]
    _refused(run_cli(*args, timeout=120), out, *says)


@pytest.mark.parametrize("method, extra, says", [
    ("fedsaf", [], ["--families", "fedsaf", "prototype"]),  # was silently ignored: the pool's backbones trained
    ("ohfl", ["--profile", "site_configs/consortium"], ["--families", "--profile", "model"]),
])
def test_simulate_refuses_families_it_would_ignore(tmp_path, method, extra, says):
    out = tmp_path / "run"
    r = run_cli("simulate", "--method", method, "--families", "cnn,cnn,densenet,densenet,resnet,resnet", *extra,
                "--data", str(tmp_path / "no_data"), "--out", str(out), timeout=120)
    _refused(r, out, *says)
