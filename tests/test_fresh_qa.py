"""Bad input a fresh user gave the most recently changed commands (status, site score, evaluate of a FENS run,
predict, confirmatory analyse): each is refused in one line naming the file, exit 2, and nothing is lost."""
from __future__ import annotations

import argparse
import json

import pytest


def _one_line(err: str, *says):
    err = err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for s in says:
        assert s in err, err


@pytest.mark.parametrize("content", ["{", "[]", "", "42"])
def test_status_names_a_metrics_file_that_is_not_a_json_object(tmp_path, capsys, content):
    from nvflare_jobs.commands.status import run_status

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.json").write_text(content)
    rc = run_status(argparse.Namespace(target=str(run), json=False, watch=None, startup_kit=None))
    assert rc == 2
    _one_line(capsys.readouterr().err, str(run / "metrics.json"), "not a readable JSON object")
    assert (run / "metrics.json").read_text() == content  # nothing lost


def test_status_skips_model_index_entries_that_are_not_objects(tmp_path):
    from nvflare_jobs.status import run_folder_view

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.json").write_text(json.dumps({"sites": {"site-1": {}}}))
    (run / "models.json").write_text(json.dumps({"models": ["x", {"name": "site-1_local.pt", "kind": "local"}]}))
    v = run_folder_view(run)
    assert [m["name"] for m in v["models"]] == ["site-1_local.pt"]
    (run / "models.json").write_text("[1, 2]")
    assert run_folder_view(run)["models"] == []


@pytest.mark.parametrize("content, says", [
    ("", "not readable as JSON"), ("{", "not readable as JSON"), ("[]", "expected a JSON object, found list"),
    ("{}", "no 'name'"), ('{"name": "x"}', "no 'name'"),
    ('{"name": "x", "paired": [{"primary": "auc"}]}', "paired[0] lacks comparison, auc, balanced_accuracy, seeds"),
    ('{"name": "x", "paired": [{"comparison": "c", "auc": 1, "balanced_accuracy": {"a": 1, "b": 2}}]}',
     "paired[0] lacks auc.a/b"),
])
def test_confirmatory_analyse_names_a_bad_paired_file_and_writes_nothing(tmp_path, capsys, content, says):
    from benchmarks import confirmatory as C

    cmp, res = tmp_path / "cmp", tmp_path / "res"
    cmp.mkdir()
    (cmp / "paired_external.json").write_text(content)
    assert C.main(["analyse", "--cmp", str(cmp), "--results", str(res)]) == 2
    _one_line(capsys.readouterr().err, str(cmp / "paired_external.json"), says)
    assert not res.exists()


@pytest.mark.parametrize("rel", ["seed10/ohfl/metrics.json", "seed10/ohfl/external/x/summary.json",
                                 "seed10/local/external/x/audit.json"])
def test_confirmatory_analyse_names_a_truncated_run_file(tmp_path, capsys, rel):
    from benchmarks import confirmatory as C

    cmp, res = tmp_path / "cmp", tmp_path / "res"
    q = {"metric": "auc", "a": 0.9, "b": 0.8}
    (cmp).mkdir()
    (cmp / "paired_external.json").write_text(json.dumps({"name": "x", "paired": [
        {"comparison": "ohfl vs local+ft", "primary": "auc", "seeds": [10], "auc": q, "balanced_accuracy": q}]}))
    for m in ("ohfl", "local"):
        (cmp / "seed10" / m).mkdir(parents=True)
        (cmp / "seed10" / m / "metrics.json").write_text("{}")
    (cmp / "seedX" / "ohfl").mkdir(parents=True)  # not a seed folder: ignored
    (cmp / "seedX" / "ohfl" / "metrics.json").write_text("{}")
    assert C.main(["analyse", "--cmp", str(cmp), "--results", str(res)]) == 0  # the well-formed folder analyses
    bad = cmp / rel
    bad.parent.mkdir(parents=True, exist_ok=True)
    bad.write_text('{"models": ')
    assert C.main(["analyse", "--cmp", str(cmp), "--results", str(tmp_path / "res2")]) == 2
    _one_line(capsys.readouterr().err, str(bad), "not readable as JSON")
    assert not (tmp_path / "res2").exists()


def _fake_run(tmp_path, index: str, metrics: str = '{"labels": "binary"}'):
    run = tmp_path / "run"
    (run / "models").mkdir(parents=True)
    (run / "models" / "site-1_local.pt").write_bytes(b"not read: the index is refused first")
    (run / "metrics.json").write_text(metrics)
    if index is not None:
        (run / "models.json").write_text(index)
    return run


@pytest.mark.parametrize("index, says", [
    ('{"models": ["x"]}', "models[0] is not a model entry"),
    ('{"models": [{"file": "models/site-1_local.pt", "sha256": "0"}]}', "models[0] is not a model entry"),
    ('{"models": {"site-1_local": {}}}', "'models' is a dict, not a list"),
])
def test_evaluate_names_a_hand_edited_model_index(tmp_path, capsys, index, says):
    from nvflare_jobs.cli import main

    run = _fake_run(tmp_path, index)
    assert main(["evaluate", "--run", str(run), "--data", str(tmp_path), "--no-audit"]) == 2
    _one_line(capsys.readouterr().err, str(run / "models.json"), says)
    assert (run / "models.json").read_text() == index and not (run / "external").exists()


@pytest.mark.parametrize("metrics, says", [("", "not readable as JSON"), ("[1]", "expected a JSON object, found list")])
def test_evaluate_names_a_truncated_or_edited_metrics_file(tmp_path, capsys, metrics, says):
    from nvflare_jobs.cli import main

    run = _fake_run(tmp_path, None, metrics)
    assert main(["evaluate", "--run", str(run), "--data", str(tmp_path), "--no-audit"]) == 2
    _one_line(capsys.readouterr().err, str(run / "metrics.json"), says)
    assert (run / "metrics.json").read_text() == metrics and not (run / "models.json").exists()


def test_simulate_refuses_aspect_with_a_profile_instead_of_dropping_it(tmp_path, capsys):
    """--aspect is written into generated site configs; with --profile the configs decide, so it would be ignored."""
    from nvflare_jobs.cli import main

    prof, out = tmp_path / "profile", tmp_path / "run"
    prof.mkdir()
    assert main(["simulate", "--method", "fens", "--profile", str(prof), "--aspect", "crop", "--out", str(out)]) == 2
    _one_line(capsys.readouterr().err, "--aspect crop", "--profile", str(prof))
    assert not out.exists()
