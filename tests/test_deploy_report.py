"""The deployed round of a ``deploy: best_val`` site reaches metrics.json and the console summary."""
import json


def test_best_val_deployed_round_is_in_metrics_json_and_the_summary(tmp_path, capsys):
    from nvflare_jobs.results import print_summary as _print_summary
    from nvflare_jobs.results import assemble_run

    test = {"n": 4, "accuracy": 0.75, "balanced_accuracy": 0.5, "auc": 0.6,
            "confusion_matrix": [[2, 1], [0, 1]]}
    rec = {"method": "local", "rounds": [], "sites": {
        "site-1": {"model": {"family": "cnn", "depth": "shallow"}, "input_size": 64, "n_train": 10, "n_test": 4,
                   "test": test, "deploy": {"rule": "best_val", "round": 3, "score": 0.6}},
        "site-2": {"model": {"family": "cnn", "depth": "shallow"}, "input_size": 64, "n_train": 10, "n_test": 4,
                   "test": test, "deploy": {"rule": "last (validation split holds < 2 classes)", "round": 4,
                                            "score": -1.0}},
        "site-3": {"model": {"family": "cnn", "depth": "shallow"}, "input_size": 64, "n_train": 10, "n_test": 4,
                   "test": test}}}
    src = tmp_path / "cxr_hfl_results" / "server_results.json"
    src.parent.mkdir()
    src.write_text(json.dumps(rec))
    m = assemble_run(src, tmp_path / "run", labels="binary", seed=0, wall_time_s=1.0,
                     class_names=["normal", "pneumonia"])
    on_disk = json.loads((tmp_path / "run" / "metrics.json").read_text())["sites"]
    assert on_disk["site-1"]["deploy"] == {"rule": "best_val", "round": 3, "score": 0.6}
    assert on_disk["site-2"]["deploy"]["rule"].startswith("last (validation split holds < 2")
    assert "deploy" not in on_disk["site-3"]  # deploy: last sites report nothing extra
    _print_summary(m, tmp_path / "run")
    out = capsys.readouterr().out
    assert ("deployed round (deploy: best_val): site-1 round 3 (best_val, validation balanced accuracy 0.600); "
            "site-2 round 4 (last (validation split holds < 2 classes), validation balanced accuracy n/a)") in out
