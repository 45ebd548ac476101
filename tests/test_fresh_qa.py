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
    (run / "metrics.json").write_text(json.dumps({"method": "local", "sites": {"site-1": {}}}))
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
    from studies.confirmatory import confirmatory as C

    cmp, res = tmp_path / "cmp", tmp_path / "res"
    cmp.mkdir()
    (cmp / "paired_external.json").write_text(content)
    assert C.main(["analyse", "--cmp", str(cmp), "--results", str(res)]) == 2
    _one_line(capsys.readouterr().err, str(cmp / "paired_external.json"), says)
    assert not res.exists()


@pytest.mark.parametrize("rel", ["seed10/ohfl/metrics.json", "seed10/ohfl/external/x/summary.json",
                                 "seed10/local/external/x/audit.json"])
def test_confirmatory_analyse_names_a_truncated_run_file(tmp_path, capsys, rel):
    from studies.confirmatory import confirmatory as C

    cmp, res = tmp_path / "cmp", tmp_path / "res"
    q = {"metric": "auc", "a": 0.9, "b": 0.8}
    (cmp).mkdir()
    (cmp / "paired_external.json").write_text(json.dumps({"name": "x", "paired": [
        {"comparison": "ohfl vs local+ft", "primary": "auc", "seeds": [10], "auc": q, "balanced_accuracy": q}]}))
    for m in ("ohfl", "local", "fedavg"):
        (cmp / "seed10" / m).mkdir(parents=True)
        (cmp / "seed10" / m / "metrics.json").write_text(json.dumps({"method": m, "seed": 10}))
    (cmp / "seedX" / "ohfl").mkdir(parents=True)  # not a seed folder: ignored
    (cmp / "seedX" / "ohfl" / "metrics.json").write_text("{}")
    from pathlib import Path

    plan = Path(C.__file__).parent / "protocols" / "confirmatory" / "alpha_plan.json"  # primary: ohfl vs local+ft
    args = ["analyse", "--cmp", str(cmp), "--seeds", "10", "--plan", str(plan), "--results"]
    assert C.main([*args, str(res)]) == 0  # the well-formed folder analyses
    bad = cmp / rel
    bad.parent.mkdir(parents=True, exist_ok=True)
    bad.write_text('{"models": ')
    assert C.main([*args, str(tmp_path / "res2")]) == 2
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


def test_predict_squares_a_global_model_as_its_run_did_like_evaluate(tmp_path):
    """A global model file records no aspect: predict takes it from the run's sites (as evaluate does), so a
    letterbox run's global model predicts exactly as the same weights with aspect letterbox in their header."""
    import csv

    import numpy as np
    import torch
    from PIL import Image

    from hfl_components.models import build_model, save_model_file
    from nvflare_jobs.evaluation import predict_files

    torch.manual_seed(0)
    spec = {"family": "cnn", "depth": "shallow", "width": 0.25, "in_channels": 1, "num_classes": 2}
    state = {k: (v + 0.05 * torch.randn_like(v) if v.is_floating_point() and "running" not in k else v)
             for k, v in build_model(spec).state_dict().items()}  # an untrained head answers 0.5 to every image
    rng = np.random.default_rng(0)
    img = tmp_path / "scans" / "wide.png"
    img.parent.mkdir()
    a = rng.integers(0, 255, size=(80, 200), dtype=np.uint8)
    a[:, 150:] = 255  # a bright right edge: a centred letterbox and a stretch see different pixels
    Image.fromarray(a, mode="L").save(img)
    run = tmp_path / "run"
    (run / "resolved_configs").mkdir(parents=True)
    for s in ("site-1", "site-2"):
        (run / "resolved_configs" / f"{s}.json").write_text(json.dumps({"input_size": 32, "aspect": "letterbox"}))
    files = {"run": save_model_file(run / "global_model.pt", spec, state, input_size=32, kind="global"),
             "letterbox": save_model_file(tmp_path / "lb.pt", spec, state, input_size=32, aspect="letterbox"),
             "stretch": save_model_file(tmp_path / "st.pt", spec, state, input_size=32, aspect="stretch")}
    p = {}
    for k, f in files.items():
        predict_files(f, [str(img.parent)], tmp_path / f"{k}.csv")
        with open(tmp_path / f"{k}.csv") as fh:
            p[k] = float(next(csv.DictReader(fh))["p_PNEUMONIA"])
    assert p["run"] == p["letterbox"] and p["letterbox"] != p["stretch"]


def _op_model(tmp_path, op):
    import numpy as np
    from PIL import Image

    from hfl_components.models import build_model, save_model_file

    spec = {"family": "cnn", "depth": "shallow", "width": 0.25, "in_channels": 1, "num_classes": 2}
    (tmp_path / "scans").mkdir(exist_ok=True)
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (96, 96), dtype=np.uint8), mode="L").save(
        tmp_path / "scans" / "a.png")
    return save_model_file(tmp_path / "m.pt", spec, build_model(spec).state_dict(), input_size=32, labels="binary",
                           kind="deployed", operating_point=op)


@pytest.mark.parametrize("op, said", [
    ({"temperature": 1.5, "threshold": None, "unresolved": "no site sent 5 positives"}, "argmax (no federated threshold)"),
    ({"temperature": 1.5, "threshold": 0.25}, "federated threshold 0.250"),
    (None, "predicted at 32 px ("),
])
def test_predict_cli_with_and_without_a_federated_threshold(tmp_path, capsys, op, said):
    """A deployed model whose federation set no threshold predicts at argmax and says so (the summary line raised a
    TypeError on the missing threshold)."""
    from nvflare_jobs.cli import main

    f = _op_model(tmp_path, op)
    out = tmp_path / "p.csv"
    assert main(["predict", "--model", str(f), "--data", str(tmp_path / "scans"), "--out", str(out)]) == 0
    assert said in capsys.readouterr().out and out.is_file()


@pytest.mark.parametrize("op, says", [
    ({"threshold": 0.5}, "temperature None"), ({"temperature": "abc", "threshold": 0.5}, "temperature 'abc'"),
    ({"temperature": 0, "threshold": 0.5}, "temperature 0,"), ({"temperature": 1.0, "threshold": 1.5}, "threshold 1.5"),
    ({"temperature": 1.0, "threshold": "0.3"}, "threshold '0.3'"),
])
def test_predict_names_a_hand_edited_operating_point(tmp_path, capsys, op, says):
    from nvflare_jobs.cli import main

    f = _op_model(tmp_path, op)
    out = tmp_path / "p.csv"
    assert main(["predict", "--model", str(f), "--data", str(tmp_path / "scans"), "--out", str(out)]) == 2
    _one_line(capsys.readouterr().err, str(f), "corrupt model file header: its operating_point", says)
    assert not out.exists()


@pytest.mark.parametrize("content, says", [
    (b"\x00\xba\xff binary, e.g. a model file given as --config", "is not a text (UTF-8) YAML file"),
    (b"a: [\nb: 1\n", "is not valid YAML (line 3, column 1: expected ',' or ']'"),
])
def test_site_score_names_a_config_that_is_not_yaml_text(tmp_path, capsys, content, says):
    from nvflare_jobs.cli import main

    cfg = tmp_path / "hospital-a.yaml"
    cfg.write_bytes(content)
    assert main(["site", "score", "--config", str(cfg), "--model", str(_op_model(tmp_path, None))]) == 2
    _one_line(capsys.readouterr().err, str(cfg), says)
    assert cfg.read_bytes() == content


def test_status_of_a_compare_folder_points_at_one_of_its_runs(tmp_path, capsys):
    from nvflare_jobs.commands.status import run_status

    cmp = tmp_path / "cmp"
    (cmp / "seed0" / "fens").mkdir(parents=True)
    (cmp / "compare.json").write_text("{}")
    (cmp / "seed0" / "fens" / "metrics.json").write_text('{"method": "fens"}')
    rc = run_status(argparse.Namespace(target=str(cmp), json=False, watch=None, startup_kit=None))
    assert rc == 2
    _one_line(capsys.readouterr().err, "compare folder", str(cmp / "seed0" / "fens"))
    assert run_status(argparse.Namespace(target=str(cmp / "seed0" / "fens"), json=True, watch=None,
                                         startup_kit=None)) == 0


def test_compare_external_section_says_how_fens_global_model_was_scored():
    from nvflare_jobs.compare.tables import external_markdown

    def rows(method):
        return [{"method": method, "seed": 0, "model": "global_48px", "kind": "global", "site": None,
                 "input_size": 48, "n": 24, "auc": 0.5, "balanced_accuracy": 0.5, "accuracy": 0.5}]
    ext = {"data": "x", "part": "tuning", "n_images": [24], "probe_images_excluded": [0], "paired": [], "n_boot": 0}
    with_fens = "\n".join(external_markdown({**ext, "rows": rows("fens")}, {}))
    without = "\n".join(external_markdown({**ext, "rows": rows("ohfl")}, {}))
    assert "FENS's (the site models + the aggregator) once, at its own input size" in with_fens
    assert "FENS" not in without and "averaged over sites." in without


def _live_run(tmp_path, age_s: float):
    import time

    run = tmp_path / "run"
    st = run / "workspace" / "server" / "simulate_job" / "cxr_hfl_results" / "status.json"
    st.parent.mkdir(parents=True)
    st.write_text(json.dumps({"phase": "waiting", "time": time.time() - age_s, "task": "fens_local", "round": 0,
                              "waiting_for": ["site-1"], "sites": {"site-1": {"task": "fens_local", "heard_s_ago": 1.0}}}))
    return run, st


def test_status_ages_heartbeats_and_says_interrupted_after_ctrl_c(tmp_path, monkeypatch, capsys):
    """A snapshot written 30 s ago: the site was heard 31 s ago, not 1 s. After Ctrl-C the CLI marks the run
    interrupted, so status says STOPPED at once (it said RUNNING, site training, heard 0 s ago, for 2 minutes)."""
    from nvflare_jobs import cli
    from nvflare_jobs.commands import simulate as sim_cmd
    from nvflare_jobs.status import run_folder_view

    run, st = _live_run(tmp_path, 30.0)
    v = run_folder_view(run)
    assert v["job_state"] == "RUNNING" and v["sites"]["site-1"]["state"] == "training"
    assert 30.5 <= v["sites"]["site-1"]["heard_s_ago"] <= 40

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(sim_cmd, "run_simulate", interrupted)
    assert cli.main(["simulate", "--method", "fens", "--out", str(run)]) == 130
    assert "interrupted" in capsys.readouterr().err
    v = run_folder_view(run)
    assert v["job_state"].startswith("STOPPED (interrupted") and v["sites"]["site-1"]["state"] == "stopped"
    assert json.loads(st.read_text())["task"] == "fens_local"  # the rest of the snapshot kept


@pytest.mark.parametrize("flags, says", [
    (["--methods", "fens,local,fens"], "--methods names fens more than once"),
    (["--methods", "fens", "--external", "NOPE"], "no external data at"),
    (["--methods", "fens", "--part", "tuning"], "--part needs --external"),
])
def test_compare_refusals_name_the_option_and_write_no_folder(tmp_path, capsys, flags, says):
    from nvflare_jobs.cli import main

    out = tmp_path / "cmp"
    flags = [str(tmp_path / f) if f == "NOPE" else f for f in flags]
    assert main(["compare", *flags, "--sites", "3", "--dry-run", "--out", str(out)]) == 2
    _one_line(capsys.readouterr().err, says)
    assert not out.exists()


@pytest.mark.parametrize("cmd", [["status", "RUN"], ["poc", "status"]])
@pytest.mark.parametrize("value", ["-1", "0", "nan"])
def test_watch_needs_seconds_above_zero(tmp_path, capsys, cmd, value):
    """--watch -1 printed the view, then 'sleep length must be non-negative' without naming the option."""
    from nvflare_jobs.cli import main

    cmd = [str(tmp_path) if c == "RUN" else c for c in cmd]
    with pytest.raises(SystemExit) as e:
        main([*cmd, "--watch", value])
    assert e.value.code == 2
    _one_line(capsys.readouterr().err.splitlines()[-1], "--watch", "expected seconds > 0")


@pytest.mark.parametrize("methods, primary, says", [
    (["fens", "local"], "fens vs local+ft", "compare.json: methods fens,local, not the protocol's"),
    (["local", "fedavg", "ohfl"], "fedavg vs local+ft", "no primary comparison of ohfl"),
])
def test_confirmatory_analyse_refuses_another_comparison(tmp_path, capsys, methods, primary, says):
    """A comparison folder of other methods gave a RESULT.md without a primary endpoint, exit 0 -- by default into
    the committed results folder."""
    from studies.confirmatory import confirmatory as C

    cmp, res = tmp_path / "cmp", tmp_path / "res"
    cmp.mkdir()
    q = {"metric": "auc", "a": 0.9, "b": 0.8}
    (cmp / "compare.json").write_text(json.dumps({"methods": methods}))
    (cmp / "paired_external.json").write_text(json.dumps({"name": "x", "paired": [
        {"comparison": primary, "primary": "auc", "seeds": [0], "auc": q, "balanced_accuracy": q}]}))
    assert C.main(["analyse", "--cmp", str(cmp), "--results", str(res)]) == 2
    _one_line(capsys.readouterr().err, says, "nothing was written")
    assert not res.exists()


def test_predict_refuses_a_threshold_for_a_subtype_model(tmp_path, capsys):
    """--threshold was silently ignored for a 3-class model (argmax instead)."""
    import numpy as np
    from PIL import Image

    from hfl_components.models import build_model, save_model_file
    from nvflare_jobs.cli import main

    spec = {"family": "cnn", "depth": "shallow", "width": 0.25, "in_channels": 1, "num_classes": 3}
    f = save_model_file(tmp_path / "m.pt", spec, build_model(spec).state_dict(), input_size=32, labels="subtype")
    (tmp_path / "scans").mkdir()
    Image.fromarray(np.zeros((96, 96), np.uint8), mode="L").save(tmp_path / "scans" / "a.png")
    out = tmp_path / "p.csv"
    assert main(["predict", "--model", str(f), "--data", str(tmp_path / "scans"), "--out", str(out),
                 "--threshold", "0.3"]) == 2
    _one_line(capsys.readouterr().err, "--threshold 0.3", str(f), "3-class (subtype)", "binary")
    assert not out.exists()
    assert main(["predict", "--model", str(f), "--data", str(tmp_path / "scans"), "--out", str(out)]) == 0
