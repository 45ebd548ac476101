"""`cxr-hfl report`: the method-specific figures (FedTopo topology/reliability, FedSAF effective rank, OHFL CKA
heatmaps and fine-tuning curves) are drawn by the run's own plotting code and embedded in one HTML file."""
from __future__ import annotations

import json
from pathlib import Path

IMG = '<img src="data:image/png;base64,'


def _site(acc: float, **extra) -> dict:
    return {"model": {"family": "hetero_cnn", "feature_dim": 16}, "input_size": 32, "n_train": 10, "n_test": 4,
            "test": {"n": 4, "accuracy": acc, "balanced_accuracy": acc, "auc": 0.7, "sensitivity": 0.5,
                     "specificity": 0.5, "confusion_matrix": [[1, 1, 0], [0, 1, 0], [0, 0, 1]]}, **extra}


def _run(tmp: Path, method: str, **extra) -> Path:
    from nvflare_jobs import plots

    run = tmp / method
    run.mkdir()
    m = {"method": method, "labels": "subtype", "seed": 3, "wall_time_s": 1.0, "command": f"cxr-hfl simulate --method {method}",
         "sites": {"site-1": _site(0.5), "site-2": _site(0.75)}, "pooled": {}, "bytes_uploaded": 10,
         "bytes_downloaded": 20,
         "rounds": [{"round": r, "task": "train", "val_accuracy": {"site-1": 0.3 + 0.1 * r, "site-2": 0.5}}
                    for r in range(3)], **extra}
    (run / "metrics.json").write_text(json.dumps(m))
    plots.make_all(run, m, {}, ["NORMAL", "BACTERIAL", "VIRAL"])
    return run


def test_fedtopo_and_fedsaf_reports_embed_their_figures(tmp_path):
    from nvflare_jobs.report import render_report

    eye = [[1.0, 0.2, 0.1], [0.2, 1.0, 0.4], [0.1, 0.4, 1.0]]
    topo = render_report(_run(tmp_path, "fedtopo", R_global=eye, S_global=eye)).read_text()
    for cap in ("Per-site test accuracy", "Validation accuracy per round", "FedTopo global relation topology",
                "FedTopo reliability", "Confusion matrix site-1", "Confusion matrix site-2"):
        assert f"<figcaption>{cap}</figcaption>" in topo, cap
    assert topo.count(IMG) == 6
    assert "cxr-hfl simulate --method fedtopo" in topo and "<td>seed</td><td>3</td>" in topo
    saf = render_report(_run(tmp_path, "fedsaf", effective_rank=[1.5, 2.0, 2.4])).read_text()
    assert "<figcaption>FedSAF effective rank of the site prototypes per round</figcaption>" in saf
    assert saf.count(IMG) == 5


def test_report_cli_rejects_other_folders(tmp_path):
    from tests.sim_helpers import run_cli

    r = run_cli("report", str(tmp_path))
    assert r.returncode == 2 and "neither a run folder" in r.stderr


def _aborted_run(tmp: Path, sites: dict | None = None) -> Path:
    """A run the server aborted: both sites excluded in round 0 (the reasons as the controller records them)."""
    from nvflare_jobs import plots

    run = tmp / "aborted"
    run.mkdir()
    m = {"method": "ohfl", "labels": "binary", "seed": 0, "command": "cxr-hfl simulate --method ohfl",
         "sites": sites or {}, "pooled": None, "rounds": [],
         "excluded_sites": {"site-1": [{"round": 0, "task": "train", "reason": "site-1: data.manifest missing"}],
                            "site-2": [{"round": 0, "task": "train", "reason": "site-2: out of memory"}]}}
    (run / "metrics.json").write_text(json.dumps(m))
    plots.make_all(run, m, {}, ["NORMAL", "PNEUMONIA"])
    return run


def test_report_of_an_aborted_run_says_so_and_fails(tmp_path):
    from tests.sim_helpers import run_cli

    run = _aborted_run(tmp_path)
    r = run_cli("report", str(run))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "NO site results" in r.stderr and "site-1" in r.stderr and "site-2" in r.stderr
    assert "data.manifest missing" in r.stderr and "out of memory" in r.stderr
    text = (run / "report.html").read_text()
    top = text.split("How to repeat this run")[0]  # shown before everything else
    assert "NO site results" in top and "Excluded sites (2)" in top
    assert "site-1: data.manifest missing" in top and "site-2: out of memory" in top
    assert "Per-site test accuracy</figcaption>" not in text  # no empty accuracy chart


def test_report_lists_excluded_sites_of_a_run_with_results(tmp_path):
    from tests.sim_helpers import run_cli

    run = _aborted_run(tmp_path, sites={"site-3": _site(0.75)})
    r = run_cli("report", str(run), "--out", str(tmp_path / "r.html"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "WARNING: site-2 excluded" in r.stderr
    text = (tmp_path / "r.html").read_text()
    assert "Excluded sites (2)" in text and "site-2: out of memory" in text and "NO site results" not in text


def test_report_cli_bad_arguments_give_messages(tmp_path):
    from tests.sim_helpers import run_cli

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.json").write_text("{broken")
    r = run_cli("report", str(run))
    assert r.returncode == 2 and "Traceback" not in r.stderr and "unreadable" in r.stderr
    good = _aborted_run(tmp_path, sites={"site-3": _site(0.75)})
    r = run_cli("report", str(good), "--out", str(tmp_path))
    assert r.returncode == 2 and "is a folder" in r.stderr and "Traceback" not in r.stderr


def test_report_refuses_a_metrics_file_without_a_run_record_and_writes_nothing(tmp_path, capsys):
    """``metrics.json`` holding ``{}`` (or another program's object) wrote report.html for a run "with NO site
    results" and exited 1, where ``cxr-hfl status`` refuses the same folder as not a run record: report refuses it
    too (exit 2, one line naming the file) and writes no HTML."""
    from nvflare_jobs.cli import main

    for body in ({}, {"sites": {}}, {"pooled": {"auc": 0.9}}):
        (tmp_path / "metrics.json").write_text(json.dumps(body))
        assert main(["report", str(tmp_path)]) == 2, body
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "not a cxr-hfl run record" in err, err
        assert str(tmp_path / "metrics.json") in err and "Traceback" not in err, err
        assert not (tmp_path / "report.html").exists()


def test_report_of_a_comparison_without_results_says_so_and_fails(tmp_path, capsys):
    """A compare folder whose only run has no site results (unfinished, failed) gave an empty report with exit 0;
    like a run with no site results it says so at the top of the report and on stderr, exit 1."""
    from nvflare_jobs.cli import main

    (tmp_path / "compare.json").write_text(json.dumps({"methods": ["central"], "seeds": [0]}))
    run = tmp_path / "seed0" / "central"
    run.mkdir(parents=True)
    (run / "metrics.json").write_text(json.dumps({"method": "central", "sites": {}}))
    assert main(["report", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "the comparison has NO results" in err, err
    assert "WARNING: the comparison has NO results" in (tmp_path / "report.html").read_text()
