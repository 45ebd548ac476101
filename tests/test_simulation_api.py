"""The one run API (``nvflare_jobs.simulation``): options checked before anything is written, the library's
defaults equal the command line's, and a run's outcome read back as a ``Run``. The simulator itself runs in the
slow tests and ``cxr-hfl compare`` (which calls ``simulate(..., isolate=True)``)."""
from __future__ import annotations

import argparse
import json

import pytest

from nvflare_jobs import simulation
from nvflare_jobs.simulation import Run, SimulateError, check, finished, simulate


def test_check_fills_the_command_lines_defaults():
    from nvflare_jobs.commands.simulate import _add_method_args

    p = argparse.ArgumentParser()
    _add_method_args(p)
    for method in ("fedavg", "ohfl", "fedtopo", "fedprox"):
        cli = p.parse_args(["--method", method])
        simulation._defaults(cli)
        lib = check(method, {})
        for k, v in vars(cli).items():
            if k != "probe":
                assert lib[k] == v, (method, k)


def test_check_types_text_options_and_names_the_bad_one():
    got = check("fedtopo", {"rounds": "4", "lam": "0.5", "ablate": ["no_ema"]})
    assert (got["rounds"], got["lam"], got["ablate"]) == (4, 0.5, ["no_ema"])
    with pytest.raises(SimulateError, match=r"unknown option\(s\) \['bogus'\] for fedavg"):
        check("fedavg", {"bogus": 1})
    with pytest.raises(SimulateError, match=r"fedtopo: option 'rho' \(--rho\): rho must lie in \[0, 1\)"):
        check("fedtopo", {"rho": 1.5})
    with pytest.raises(SimulateError, match="--paper is an OHFL option"):
        check("fedavg", {"paper": True})
    with pytest.raises(SimulateError, match="unknown method 'fedfoo'"):
        check("fedfoo", {})


def test_simulate_refuses_bad_options_before_writing(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(SimulateError, match="option 'mu'"):
        simulate("fedprox", None, {"mu": -1}, out)
    assert not out.exists()


def test_finished_reads_the_run_back(tmp_path):
    assert finished("fedavg", tmp_path, 1) == Run(tmp_path, "fedavg", 1, None, None)
    assert not finished("fedavg", tmp_path, 0).ok
    (tmp_path / "metrics.json").write_text(json.dumps({"method": "fedavg"}))
    run = finished("fedavg", tmp_path, 0)
    assert run.ok and run.metrics == {"method": "fedavg"}


@pytest.mark.parametrize("key, value", [("rounds", 0), ("rounds", -2), ("finetune_epochs", -1), ("local_epochs", -1),
                                        ("batch_size", 0), ("seed", -1), ("min_sites", 0)])
def test_the_library_refuses_what_the_command_line_refuses(tmp_path, key, value):
    """``simulate --rounds 0`` / ``--finetune-epochs -1`` are refused by the command line; the library (what compare
    calls for a variant such as ``fedavg:rounds=0``) took them: the job then ran 1 round for ``rounds`` 0 while the
    budget line said 0 epochs. Both now refuse the same values, typed or as text, before anything is written."""
    from nvflare_jobs.commands.simulate import _add_method_args

    p = argparse.ArgumentParser()
    _add_method_args(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--method", "fedavg", "--" + key.replace("_", "-"), str(value)])
    for v in (value, str(value)):
        with pytest.raises(SimulateError, match=rf"option {key}: must be an integer >= \d+, got {value}"):
            check("fedavg", {key: v})
    out = tmp_path / "run"
    with pytest.raises(SimulateError):
        simulate("fedavg", None, {key: value}, out)
    assert not out.exists()
    least = int(str(p.parse_args(["--method", "fedavg", "--" + key.replace("_", "-"), str(value + 5)]).__dict__[key]))
    assert check("fedavg", {key: least})[key] == least  # a value the command line takes passes
