"""The run-level model index ``RUN/models.json`` is what `cxr-hfl evaluate` and cross-site evaluation read: every
model file of a run with its hash (group and fused models too), a file not in the index is not scored, a file whose
bytes differ from its entry is refused in one line naming it (evaluate, export-eval, and the server at job start),
and a run folder from before the index is indexed on first use. Fast: tiny model files, no data, no simulator."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tests.deploy_helpers import run_cli, tiny_profile

SITES = ["site-1", "site-2", "site-3"]


def _save(path: Path, seed: int, size: int | None = 32, site: str | None = None) -> Path:
    import torch

    from hfl_components.models import build_model, save_model_file

    spec = {"family": "cnn", "depth": "shallow", "width": 0.5, "num_classes": 2}
    torch.manual_seed(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_model_file(path, spec, build_model(spec).state_dict(), input_size=size, labels="binary", site=site)
    return path


def _run(tmp_path: Path, groups: bool = False) -> Path:
    """A run folder: two sites at 32 and 48 px, their deployed/local models, a global model (or two architecture
    groups' models) and a fused one, metrics.json and resolved_configs/ (the sites' input sizes)."""
    run = tmp_path / "run"
    (run / "resolved_configs").mkdir(parents=True)
    sites = {}
    for i, (site, size) in enumerate((("site-1", 32), ("site-2", 48))):
        (run / "resolved_configs" / f"{site}.json").write_text(json.dumps({"input_size": size}))
        _save(run / "models" / f"{site}_deployed.pt", i, size, site)
        _save(run / "models" / f"{site}_local.pt", 10 + i, size, site)
        sites[site] = {"input_size": size, "test": {"accuracy": 0.5 + i / 10}, "model": {"family": "cnn"}}
    if groups:
        for g, site in (("g0", "site-1"), ("g1", "site-2")):
            _save(run / "global_models" / f"{g}.pt", 20, None)
            _save(run / "global_models" / f"{g}_fused.pt", 21, None)
        (run / "global_models" / "groups.json").write_text(json.dumps(
            {"g0": {"sites": ["site-1"]}, "g1": {"sites": ["site-2"]}}))
    else:
        _save(run / "global_model.pt", 20, None)
        _save(run / "global_fused.pt", 21, None)
    (run / "metrics.json").write_text(json.dumps({"method": "ohfl", "seed": 4, "labels": "binary", "sites": sites}))
    return run


def test_index_lists_fused_and_group_models_with_their_hash(tmp_path):
    from nvflare_jobs.models_index import write_models_index

    run = _run(tmp_path, groups=True)
    idx = json.loads(write_models_index(run, json.loads((run / "metrics.json").read_text())).read_text())
    by = {e["name"]: e for e in idx["models"]}
    assert sorted(by) == ["fused-g0", "fused-g1", "global-g0", "global-g1", "site-1_deployed", "site-1_local",
                          "site-2_deployed", "site-2_local"]
    e = by["fused-g1"]
    assert (e["kind"], e["group"], e["file"], e["site"]) == ("fused", "g1", "global_models/g1_fused.pt", None)
    assert e["sha256"] == hashlib.sha256((run / e["file"]).read_bytes()).hexdigest()
    assert (by["site-2_deployed"]["seed"], by["site-2_deployed"]["input_size"]) == (4, 48)


def test_evaluate_reads_the_index_not_the_folder(tmp_path):
    """The models evaluate scores are the index's entries (global models once per input size of their sites); a
    model file dropped into models/ after the run is not scored; the index is written first for an older run."""
    from nvflare_jobs.evaluation import list_run_models

    run = _run(tmp_path)
    said = []
    models = list_run_models(run, "all", log=said.append)
    assert said and "had no models.json" in said[0] and (run / "models.json").is_file()
    assert [m["name"] for m in models] == ["site-1_deployed", "site-1_local", "site-2_deployed", "site-2_local",
                                           "global_32px", "global_48px", "fused_32px", "fused_48px"]
    assert {m["name"]: m["path"] for m in models}["fused_48px"] == (run / "global_fused.pt").resolve()
    _save(run / "models" / "site-9_deployed.pt", 99, 32, "site-9")  # not the run's: not in its index
    names = [m["name"] for m in list_run_models(run, "largest", log=said.append)]
    assert "site-9_deployed" not in names and names[-2:] == ["global_48px", "fused_48px"] and len(said) == 1
    grouped = _run(tmp_path / "g", groups=True)
    names = [m["name"] for m in list_run_models(grouped, "all")]
    assert names[4:] == ["global-g0_32px", "fused-g0_32px", "global-g1_48px", "fused-g1_48px"]


@pytest.mark.parametrize("change", ["bytes", "missing", "outside"])
def test_evaluate_refuses_a_file_that_differs_from_its_entry_in_one_line(tmp_path, change):
    from nvflare_jobs.models_index import ModelIndexError, read_models_index

    run = _run(tmp_path)
    read_models_index(run)  # writes the index
    victim = run / "models" / "site-2_local.pt"
    if change == "bytes":
        _save(victim, 77, 48, "site-2")  # a valid model file, other weights
    elif change == "missing":
        victim.unlink()
    else:
        idx = json.loads((run / "models.json").read_text())
        idx["models"][3]["file"] = "../elsewhere.pt"
        (run / "models.json").write_text(json.dumps(idx))
    with pytest.raises(ModelIndexError, match="site-2_local|elsewhere"):
        read_models_index(run)
    data = tmp_path / "ext"
    data.mkdir()
    r = run_cli("evaluate", "--run", str(run), "--data", str(data), "--no-audit", timeout=300)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "Traceback" not in r.stderr, r.stderr
    assert ("site-2_local.pt" if change != "outside" else "elsewhere.pt") in err[0]
    assert {"bytes": "SHA-256 differs", "missing": "missing", "outside": "not a file inside"}[change] in err[0]
    assert not (run / "external").exists()


def test_cross_site_export_checks_indexed_files_and_the_server_checks_the_job_copy(tmp_path, monkeypatch):
    from hfl_components.flare.controllers.crosssite import CrossSiteEvalController
    from nvflare_jobs.models_index import read_models_index

    run = _run(tmp_path)
    read_models_index(run)
    other = _save(tmp_path / "mine" / "my_model.pt", 5)  # a model file of no indexed run: taken as it is
    profile = tiny_profile({s: tmp_path / f"{s}.csv" for s in SITES}, tmp_path / "profile")
    r = run_cli("export-eval", "--profile", str(profile), "--model", str(run / "models" / "site-1_deployed.pt"),
                "--model", str(other), "--out", str(tmp_path / "jobs"))
    assert r.returncode == 0, r.stderr
    job = tmp_path / "jobs" / "cxr_hfl_cross_site"
    models = json.loads((job / "app_server" / "config" / "config_fed_server.json").read_text())["workflows"][0][
        "args"]["models"]
    a, b = models
    assert (a["name"], a["run"], a["kind"], a["site"], a["method"], a["seed"]) == (
        "run.site-1_deployed", "run", "deployed", "site-1", "ohfl", 4)  # <run folder>.<file>
    assert a["sha256"] == hashlib.sha256((run / "models" / "site-1_deployed.pt").read_bytes()).hexdigest()
    assert b == {"name": "my_model", "file": "models/my_model.pt",
                 "sha256": hashlib.sha256(other.read_bytes()).hexdigest()}
    monkeypatch.chdir(job / "app_server")  # outside a job the controller reads relative files from here
    CrossSiteEvalController(models=models).check_server_inputs()
    _save(job / "app_server" / "models" / "my_model.pt", 6)  # the job's copy replaced after export
    with pytest.raises(ValueError, match="my_model.*SHA-256 differs"):
        CrossSiteEvalController(models=models).check_server_inputs()
    _save(run / "models" / "site-1_deployed.pt", 8, 32, "site-1")  # the run's file changed after its index
    r = run_cli("export-eval", "--profile", str(profile), "--model", str(run / "models" / "site-1_deployed.pt"),
                "--out", str(tmp_path / "jobs2"))
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "site-1_deployed.pt" in err[0] and "SHA-256" in err[0], r.stderr
    assert not (tmp_path / "jobs2").exists()
