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
