"""Cross-site evaluation as a job: 2 model files x 3 sites in the NVFlare simulator give the 3 x 2 matrix, equal to
each file scored locally on each site's test split; a model of another label scheme is refused naming the site;
only metrics come back. The exported job carries the model files in its server app and passes the job check."""
from __future__ import annotations

import json
import os

import pytest

from tests.deploy_helpers import run_cli, tiny_manifests, tiny_profile

SITES = ["site-1", "site-2", "site-3"]


def _model_files(tmp_path, labels=("binary", "binary")):
    import torch

    from hfl_components.models import build_model
    from hfl_components.models.files import save_model_file

    out = []
    for i, lab in enumerate(labels):
        spec = {"family": "cnn", "depth": ("shallow", "medium")[i % 2], "width": 0.5,
                "num_classes": 3 if lab == "subtype" else 2}
        torch.manual_seed(10 + i)
        m = build_model(spec)
        f = tmp_path / "models" / f"model_{chr(97 + i)}.pt"
        f.parent.mkdir(parents=True, exist_ok=True)
        save_model_file(f, spec, m.state_dict(), input_size=32, labels=lab, kind="deployed")
        out.append(f)
    return out


def test_exported_eval_job_carries_its_models_and_passes_the_job_check(tmp_path):
    from hfl_components.models.files import file_sha256
    from nvflare_jobs.deploy import check_job_folder

    files = _model_files(tmp_path)
    profile = tiny_profile({s: tmp_path / f"{s}.csv" for s in SITES}, tmp_path / "profile")
    r = run_cli("export-eval", "--model", str(files[0]), "--model", str(files[1]), "--profile", str(profile),
                "--out", str(tmp_path / "jobs"))
    assert r.returncode == 0, r.stderr
    job = tmp_path / "jobs" / "cxr_hfl_cross_site"
    meta = check_job_folder(job)
    assert sorted(meta["deploy_map"]) == ["app_server"] + [f"app_{s}" for s in SITES]
    wf = json.loads((job / "app_server" / "config" / "config_fed_server.json").read_text())["workflows"][0]
    assert wf["args"]["models"] == [{"name": "model_a", "file": "models/model_a.pt", "sha256": file_sha256(files[0])},
                                    {"name": "model_b", "file": "models/model_b.pt", "sha256": file_sha256(files[1])}]
    for f in files:
        assert (job / "app_server" / "models" / f.name).read_bytes() == f.read_bytes()
    assert str(tmp_path) not in (job / "app_server" / "config" / "config_fed_server.json").read_text()
    r = run_cli("export-eval", "--model", str(tmp_path / "nope.pt"), "--profile", str(profile), "--out",
                str(tmp_path / "j2"))
    assert r.returncode == 2 and "nope.pt" in r.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cross_site_job_matrix_equals_local_scoring_and_refuses_other_label_schemes(tmp_path, data_root, monkeypatch):
    from nvflare_jobs.crosssite import build_eval_job, model_entries, score_locally
    from hfl_components.flare.site_config import ENV_DIR, load_profile

    man = tiny_manifests(data_root, tmp_path / "data", SITES)
    profile_dir = tiny_profile(man, tmp_path / "profile")
    files = _model_files(tmp_path) + _model_files(tmp_path / "sub", labels=("subtype",))
    profile = load_profile(profile_dir)
    job = build_eval_job(profile, model_entries(files))
    monkeypatch.setenv(ENV_DIR, str(profile_dir))
    ws = tmp_path / "ws"
    job.simulator_run(str(ws), threads=len(SITES), log_config="concise")
    res = json.loads(next(ws.rglob("cxr_hfl_results/cross_site.json")).read_text())
    a1, a2 = f"{tmp_path.name}.models.model_a", "sub.models.model_a"  # two files named model_a.pt, told apart
    assert res["sites"] == SITES and res["models"] == [a1, "model_b", a2]
    assert next(ws.rglob("cxr_hfl_results/cross_site.png")).stat().st_size > 0
    csv_rows = next(ws.rglob("cxr_hfl_results/cross_site.csv")).read_text().splitlines()
    assert len(csv_rows) == 1 + 3 * 3
    for site in SITES:
        local = score_locally(profile_dir / f"{site}.yaml", site, files)
        for name in (a1, "model_b"):
            got, want = res["matrix"][site][name], local[name]
            assert got["n"] == want["n"] == 6
            for k in ("accuracy", "balanced_accuracy", "auc"):
                assert got[k] == pytest.approx(want[k], abs=1e-6), (site, name, k)
            assert got["confusion_matrix"] == want["confusion_matrix"]
            assert "_probs" not in got
        refused = res["matrix"][site][a2]["refused"]
        assert refused.startswith(f"site {site} uses labels 'binary'") and "'subtype'" in refused
    blob = json.dumps(res)
    assert str(data_root) not in blob and ".jpeg" not in blob
    os.environ.pop(ENV_DIR, None)


@pytest.mark.parametrize("bad, says", [(["--min-sites", "0"], ["--min-sites", "got 0", "1 and 3"]),
                                       (["--min-sites", "4"], ["--min-sites", "got 4", "1 and 3"]),
                                       (["--model", "FOLDER"], ["models", "folder"]),
                                       (["--out", "FILE"], ["--out", "not a folder"])])
def test_export_eval_refuses_bad_input_in_one_line_and_writes_nothing(tmp_path, bad, says):
    """--min-sites outside 1..N (0 was silently N-1; above N a job no server could finish), a folder as --model,
    a file as --out: exit 2, one line naming the option or file, no job folder."""
    files = _model_files(tmp_path)
    profile = tiny_profile({s: tmp_path / f"{s}.csv" for s in SITES}, tmp_path / "profile")
    out = tmp_path / "jobs"
    (tmp_path / "a_file").write_text("x")
    bad = [{"FOLDER": str(tmp_path / "models"), "FILE": str(tmp_path / "a_file")}.get(a, a) for a in bad]
    args = {"--model": str(files[0]), "--out": str(out), **dict(zip(bad[::2], bad[1::2]))}
    r = run_cli("export-eval", "--profile", str(profile), *[x for kv in args.items() for x in kv])
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "Traceback" not in r.stderr, r.stderr
    for s in says:
        assert s in err[0], err[0]
    assert not out.exists()


def test_site_score_gives_a_hospital_its_row_of_the_matrix_here(tmp_path, data_root):
    """`cxr-hfl site score` (the hospital operator's seat): each model file scored on the site's own test split
    (6 images), metrics consistent with their confusion matrix, a model of another label scheme refused naming the
    site, a missing model file one line and exit 2."""
    man = tiny_manifests(data_root, tmp_path / "data", ["hospital-a"])
    profile = tiny_profile(man, tmp_path / "profile")
    files = _model_files(tmp_path) + _model_files(tmp_path / "sub", labels=("subtype",))
    cfg = profile / "hospital-a.yaml"
    r = run_cli("site", "score", "--config", str(cfg), *[a for f in files for a in ("--model", str(f))], "--json",
                timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    # two different files named model_a.pt are told apart by their folders
    a1 = f"{tmp_path.name}.models.model_a"
    assert list(res) == [a1, "model_b", "sub.models.model_a"]
    for name in (a1, "model_b"):
        cm = res[name]["confusion_matrix"]  # rows: true class, columns: predicted
        assert res[name]["n"] == 6 and sum(map(sum, cm)) == 6
        recalls = [cm[i][i] / sum(cm[i]) for i in range(2)]
        assert res[name]["balanced_accuracy"] == pytest.approx(sum(recalls) / 2)
        assert res[name]["accuracy"] == pytest.approx((cm[0][0] + cm[1][1]) / 6)
    assert res["sub.models.model_a"]["refused"].startswith("site hospital-a uses labels 'binary'")
    r = run_cli("site", "score", "--config", str(cfg), "--model", str(files[0]), timeout=300)
    assert r.returncode == 0 and "model_a" in r.stdout and "balanced_accuracy" in r.stdout, r.stderr
    r = run_cli("site", "score", "--config", str(cfg), "--model", str(tmp_path / "nope.pt"), timeout=300)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "nope.pt" in err[0], r.stderr


def test_site_score_exits_2_when_every_model_was_refused_and_names_the_refused_ones(tmp_path, data_root, capsys):
    """Only models of another label scheme: nothing could be scored, so exit 2 with one line saying so and naming
    them (with --json too, the JSON still on stdout); one of them beside a scorable model: exit 0, and one stderr
    line names just the refused one."""
    from nvflare_jobs.cli import main

    man = tiny_manifests(data_root, tmp_path / "data", ["hospital-a"], n_train=2, n_val=2, n_test=4)
    cfg = tiny_profile(man, tmp_path / "profile") / "hospital-a.yaml"
    binary = _model_files(tmp_path, labels=("binary",))
    subtype = _model_files(tmp_path / "sub", labels=("subtype", "subtype"))
    only_refused = [a for f in subtype for a in ("--model", str(f))]
    assert main(["site", "score", "--config", str(cfg), *only_refused]) == 2
    out, err = capsys.readouterr()
    assert out.count("refused: site hospital-a uses labels 'binary'") == 2
    assert err.strip() == ("cxr-hfl site score: no model could be scored on site hospital-a: all 2 were refused "
                           "(model_a, model_b; reasons above)")
    assert main(["site", "score", "--config", str(cfg), *only_refused, "--json"]) == 2
    out, err = capsys.readouterr()
    assert set(json.loads(out)) == {"model_a", "model_b"} and len(err.strip().splitlines()) == 1
    assert "no model could be scored" in err and "reasons in the JSON" in err
    assert main(["site", "score", "--config", str(cfg), "--model", str(binary[0]), "--model", str(subtype[0])]) == 0
    out, err = capsys.readouterr()
    a1, a2 = f"{tmp_path.name}.models.model_a", "sub.models.model_a"  # two files named model_a.pt, told apart
    assert f"{a1} " in out and "n=4" in out
    assert err.strip() == f"cxr-hfl site score: 1 of 2 models refused: {a2} (reasons above)"
