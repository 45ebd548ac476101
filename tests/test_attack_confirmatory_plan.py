"""Bad input to ``python -m studies.confirmatory.confirmatory run|copy --plan FILE`` and to the α plan itself:
refused in one line naming the file, the test or the option, exit 2, with nothing run, copied or overwritten (no
traceback, no silently used default)."""
import json
from pathlib import Path

import pytest

from studies.confirmatory import confirmatory as C
from studies.confirmatory.alpha_plan import PlanError, load_plan

PLAN4 = Path(C.__file__).resolve().parent / "protocols" / "protocol4" / "alpha_plan.json"


def _plan(tmp_path, test: int, **change) -> Path:
    plan = json.loads(PLAN4.read_text())
    plan["tests"][test].update(change)
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(plan))  # json writes NaN / Infinity for float('nan') / float('inf'), as a hand edit may
    return f


@pytest.mark.parametrize("test, change, says", [
    (0, {"id": ["primary"]}, "unique id"),
    (0, {"margin": float("nan")}, "margin"),
    (0, {"margin": -0.02}, "margin"),
    (0, {"margin": True}, "margin"),
    (1, {"threshold": float("nan")}, "threshold nan"),
    (1, {"threshold": "0.9"}, "threshold '0.9'"),
    (5, {"threshold": 0}, "threshold 0"),  # within: both bounds inside +-0 can never hold
])
def test_a_broken_test_of_the_plan_is_refused_naming_the_file(tmp_path, test, change, says):
    f = _plan(tmp_path, test, **change)
    with pytest.raises(PlanError) as e:
        load_plan(f)
    msg = str(e.value)
    assert msg.startswith(str(f)) and says in msg and "\n" not in msg


def test_the_committed_plans_still_load():
    for f in sorted(PLAN4.parent.parent.glob("*/alpha_plan.json")):
        load_plan(f)


def _no_compare(monkeypatch):
    import nvflare_jobs.compare as compare_mod

    calls = []
    monkeypatch.setattr(compare_mod, "compare", lambda **o: calls.append(o) or 0)
    return calls


@pytest.mark.parametrize("method, says", [("fedavgg", "'fedavgg'"), ("ohfl:fusion_order=group:strategy=cia",
                                                                      "fusion_order")])
def test_run_with_a_plan_naming_an_unknown_method_runs_nothing(tmp_path, capsys, monkeypatch, method, says):
    calls = _no_compare(monkeypatch)
    f = _plan(tmp_path, 0, b=method)
    res = tmp_path / "res"
    assert C.main(["run", "--cmp", str(tmp_path / "cmp"), "--results", str(res), "--seeds", "50",
                   "--plan", str(f)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(f) in err and says in err
    assert calls == [] and not res.exists()


def test_a_refused_compare_overwrites_nothing_of_a_seed_already_copied(tmp_path, capsys, monkeypatch):
    """compare refusing its input (exit 2, before any run) left the results folder's wall_seconds.txt of the seed
    overwritten with 0 (or a FileNotFoundError traceback where the seed had no folder yet)."""
    import nvflare_jobs.compare as compare_mod

    monkeypatch.setattr(compare_mod, "compare", lambda **o: 2)
    res = tmp_path / "res"
    wall = res / "seeds" / "seed50" / "wall_seconds.txt"
    wall.parent.mkdir(parents=True)
    wall.write_text("926\n")
    args = ["run", "--cmp", str(tmp_path / "cmp"), "--results", str(res), "--plan", str(PLAN4)]
    assert C.main([*args, "--seeds", "50"]) == 2
    assert wall.read_text() == "926\n"
    assert C.main([*args, "--seeds", "51"]) == 2  # no folder yet: no traceback, none made
    assert not (res / "seeds" / "seed51").exists()
    assert "retry" not in capsys.readouterr().err


@pytest.mark.parametrize("cmd", ["run", "copy"])
def test_an_empty_plan_is_refused_not_replaced_by_the_default_methods(tmp_path, capsys, monkeypatch, cmd):
    calls = _no_compare(monkeypatch)
    cmp, res = tmp_path / "cmp", tmp_path / "res"
    (cmp / "seed10").mkdir(parents=True)
    assert C.main([cmd, "--cmp", str(cmp), "--results", str(res), "--plan", ""]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--plan is empty" in err
    assert calls == [] and not res.exists()


@pytest.mark.parametrize("cmd", ["run", "copy"])
@pytest.mark.parametrize("seeds", ["", "50,,51", "x", " "])
def test_a_malformed_seed_list_is_refused_in_one_line(tmp_path, capsys, monkeypatch, cmd, seeds):
    calls = _no_compare(monkeypatch)
    cmp, res = tmp_path / "cmp", tmp_path / "res"
    (cmp / "seed10").mkdir(parents=True)
    with pytest.raises(SystemExit) as e:
        C.main([cmd, "--cmp", str(cmp), "--results", str(res), "--seeds", seeds])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "--seeds" in err.strip().splitlines()[-1]
    assert calls == [] and not res.exists()


def test_copy_from_a_missing_comparison_folder_says_so(tmp_path, capsys):
    res = tmp_path / "res"
    assert C.main(["copy", "--cmp", str(tmp_path / "nope"), "--results", str(res), "--seeds", "50"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(tmp_path / "nope") in err and not res.exists()
    (tmp_path / "cmp").mkdir()
    assert C.main(["copy", "--cmp", str(tmp_path / "cmp"), "--results", str(res), "--seeds", "50"]) == 1
    assert "seed50" in capsys.readouterr().err and not res.exists()
