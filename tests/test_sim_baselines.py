"""Local and FedAvg in the NVFlare simulator on a small real subset, plus FedAvg's aggregation on real uploads."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import yaml

from tests.sim_helpers import assert_canonical, load_metrics, make_partition, make_profile, run_cli

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def partition3(data_root, tmp_path_factory):
    return make_partition(data_root, tmp_path_factory.mktemp("p3"), 3)


@pytest.mark.slow
def test_local_round_survives_a_site_with_missing_data(partition3, tmp_path):
    profile = make_profile(partition3, tmp_path / "profile", "local")
    broken = yaml.safe_load((profile / "site-1.yaml").read_text())
    broken["data"]["manifest"] = str(tmp_path / "no_such_folder" / "site.csv")
    (profile / "site-9.yaml").write_text(yaml.safe_dump(broken))
    run = tmp_path / "run"
    r = run_cli("simulate", "--method", "local", "--profile", str(profile), "--rounds", "1", "--out", str(run))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "site-9" in r.stderr and "data.manifest" in r.stderr  # warned up front, by name and key
    m = load_metrics(run)
    assert_canonical(m, ["site-1", "site-2", "site-3"])
    reasons = [e["reason"] for e in m["excluded_sites"]["site-9"]]
    assert reasons and all("site-9" in x and "data.manifest" in x for x in reasons)
    assert m["bytes_uploaded"] == 0 and m["bytes_downloaded"] == 0  # Local exchanges metrics only
    assert (run / "site_accuracy.png").stat().st_size > 1000
    for s in ("site-1", "site-2", "site-3"):  # each site's deployed model was collected from its own workspace
        from hfl_components.models import load_model_file

        _, blob = load_model_file(run / "models" / f"{s}_deployed.pt")
        assert blob["spec"]["family"] == "cnn"
        assert blob["site"] == s and blob["kind"] == "deployed" and blob["labels"] == "binary"
        prov = blob["provenance"]
        assert prov["method"] == "local" and prov["seed"] == 0 and len(prov["manifest_sha256"]) == 64


@pytest.mark.slow
def test_fedavg_simulation_uses_deepest_architecture_and_counts_bytes(partition3, tmp_path):
    from hfl_components.models import build_model

    profile = make_profile(partition3, tmp_path / "profile", "fedavg")
    run = tmp_path / "run"
    r = run_cli("simulate", "--method", "fedavg", "--profile", str(profile), "--rounds", "2", "--out", str(run))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    m = load_metrics(run)
    sites = ["site-1", "site-2", "site-3"]
    assert_canonical(m, sites)
    for s in sites:
        assert m["sites"][s]["model"]["depth"] == "deep"  # every site forced onto the deepest spec
    spec = m["global_spec"]
    n_bytes = 4 * sum(p.numel() for p in build_model(spec).state_dict().values())
    # 2 rounds of (global down, site model up) + the final global model down for evaluation
    assert m["bytes_uploaded"] == 2 * 3 * n_bytes
    assert m["bytes_downloaded"] == 3 * 3 * n_bytes
    from hfl_components.models import load_model_file

    glob, header = load_model_file(run / "global_model.pt")  # the server's global model carries the sites' scheme
    assert header["spec"] == spec and header["kind"] == "global" and header["labels"] == "binary"
    assert header["provenance"]["method"] == "fedavg" and header["input_size"] is None


def test_fedavg_aggregate_is_sample_weighted_mean_of_real_site_uploads(partition3, tmp_path):
    """The server's FedAvg aggregation path, fed with uploads that two real sites produced by training."""
    from hfl_components.aggregation import weighted_average
    from hfl_components.flare.controllers.baselines import fedavg_train
    from hfl_components.flare.messages import GLOBAL_PREFIX, to_numpy_state
    from hfl_components.flare.site_tasks import SiteRuntime
    from hfl_components.models import build_model
    from hfl_components.flare.site_config import load_profile

    profile = load_profile(make_profile(partition3, tmp_path / "profile", "fedavg", max_train_images=16))
    spec = {"family": "cnn", "depth": "shallow", "width": 0.5, "in_channels": 1, "num_classes": 2}
    torch.manual_seed(0)
    glob = {GLOBAL_PREFIX + k: v for k, v in to_numpy_state(build_model(spec).state_dict()).items()}
    uploads, counts = [], []
    for site in ("site-1", "site-3"):
        rt = SiteRuntime(profile[site], tmp_path / site)
        params, _, meta = fedavg_train(rt, glob, {"global_spec": spec, "round": 0, "task_config": {"local_epochs": 1}})
        uploads.append(params)
        counts.append(meta["NUM_STEPS_CURRENT_ROUND"])
    assert counts == [16, 16] or all(c > 0 for c in counts)
    counts[1] = 3 * counts[1]  # make the weights unequal so a plain mean would fail
    agg = weighted_average(uploads, counts)
    w = np.asarray(counts, dtype=np.float64) / sum(counts)
    for k in uploads[0]:
        expect = w[0] * uploads[0][k].astype(np.float64) + w[1] * uploads[1][k].astype(np.float64)
        np.testing.assert_allclose(agg[k], expect, rtol=1e-6, atol=1e-7)
        plain = 0.5 * (uploads[0][k] + uploads[1][k])
        if np.abs(uploads[0][k] - uploads[1][k]).max() > 1e-4:
            assert np.abs(agg[k] - plain).max() > 1e-6
    with pytest.raises(ValueError, match="shape"):
        bad = dict(uploads[1])
        bad["classifier.weight"] = bad["classifier.weight"][:, :3]
        weighted_average([uploads[0], bad], [1, 1])


def test_site_config_errors_name_site_file_and_key(tmp_path, monkeypatch):
    from hfl_components.flare.site_config import ENV_DIR, SiteConfigError, find_site_config, load_site_config

    manifest = tmp_path / "m.csv"
    manifest.write_text("path,label,split\n")
    good = {"data": {"manifest": str(manifest)}, "model": {"family": "cnn", "depth": "shallow"}}
    p = tmp_path / "hospital-a.yaml"
    p.write_text(yaml.safe_dump(good))
    assert load_site_config("hospital-a", p)["input_size"] == 64
    cases = [({**good, "inputsize": 64}, "inputsize"), ({**good, "input_size": 4}, "input_size"),
             ({**good, "data": {"manifest": str(tmp_path / "gone.csv")}}, "data.manifest"),
             ({**good, "model": {"family": "nope"}}, "model"), ({"model": good["model"]}, "data"),
             ({**good, "model": {"family": "cnn", "depht": "deep"}}, "model")]  # nested typo, not a silent default
    for raw, key in cases:
        p.write_text(yaml.safe_dump(raw))
        with pytest.raises(SiteConfigError) as e:
            load_site_config("hospital-a", p)
        assert "hospital-a" in str(e.value) and str(p) in str(e.value) and repr(key) in str(e.value)
    p.write_text("data: [unclosed")
    with pytest.raises(SiteConfigError, match="not valid YAML"):
        load_site_config("hospital-a", p)
    # lookup: the env folder keyed by site name, else local/cxr_hfl/<site>.yaml above the working directory
    monkeypatch.delenv(ENV_DIR, raising=False)
    kit = tmp_path / "kit"
    (kit / "startup").mkdir(parents=True)
    (kit / "local" / "cxr_hfl").mkdir(parents=True)
    (kit / "local" / "cxr_hfl" / "hospital-b.yaml").write_text(yaml.safe_dump(good))
    (kit / "run" / "app").mkdir(parents=True)
    assert find_site_config("hospital-b", kit / "run" / "app") == kit / "local" / "cxr_hfl" / "hospital-b.yaml"
    with pytest.raises(SiteConfigError, match="hospital-c"):
        find_site_config("hospital-c", kit / "run" / "app")
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    shutil.copy(kit / "local" / "cxr_hfl" / "hospital-b.yaml", tmp_path / "hospital-b.yaml")
    assert find_site_config("hospital-b", kit) == tmp_path / "hospital-b.yaml"


def test_simulate_refuses_to_mix_runs_and_reports_bad_arguments_in_one_line(tmp_path, data_root):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.json").write_text("{}")
    r = run_cli("simulate", "--method", "local", "--data", str(data_root / "chest_xray_original"), "--out", str(run))
    assert r.returncode == 2 and "already holds a run" in r.stderr and "--overwrite" in r.stderr
    assert "Traceback" not in r.stderr
    r = run_cli("simulate", "--method", "local", "--sites", "0", "--out", str(tmp_path / "r0"))
    assert r.returncode == 2 and "--sites: must be an integer >= 1" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("export-job", "--method", "local", "--profile", str(tmp_path / "nope"), "--out", str(tmp_path / "j"))
    assert r.returncode == 2 and "no <site>.yaml files found" in r.stderr and "Traceback" not in r.stderr


def test_overwrite_keeps_a_profile_that_lives_in_the_run_folder(tmp_path):
    from nvflare_jobs.runner import _prepare_run_dir

    run = tmp_path / "run"
    (run / "site_configs").mkdir(parents=True)
    (run / "site_configs" / "site-1.yaml").write_text("x: 1\n")
    (run / "models").mkdir()
    (run / "metrics.json").write_text("{}")
    (run / "site_accuracy.png").write_bytes(b"png")
    _prepare_run_dir(run, overwrite=True, keep=(run / "site_configs").resolve())
    assert (run / "site_configs" / "site-1.yaml").is_file()
    assert not (run / "models").exists() and not (run / "metrics.json").exists()
    assert not (run / "site_accuracy.png").exists()
    with pytest.raises(FileExistsError):
        (run / "metrics.json").write_text("{}")
        _prepare_run_dir(run, overwrite=False)
