"""Deployment: project.yml, offline provisioning, portable job export for every method, site-config lookup in a
startup kit, the share_predictions switch, and redaction of paths from what a site sends. Fast (no POC)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.deploy_helpers import JOB_METHODS, REPO_ROOT, run_cli, tiny_profile

PROJECT = REPO_ROOT / "site_configs" / "project.yml"


def test_project_yml_has_server_six_hospitals_and_a_coordinator():
    from nvflare_jobs.deploy import coordinator, load_project

    proj = load_project(PROJECT)
    assert proj["api_version"] == 3
    parts = proj["participants"]
    assert [p["type"] for p in parts].count("server") == 1
    hospitals = [p for p in parts if p["type"] == "client"]
    assert len(hospitals) == 6
    assert len({h["org"] for h in hospitals}) == 6, "each hospital has its own organisation"
    coord = coordinator(proj)
    assert coord["type"] == "admin" and coord["role"] == "lead"


def test_provision_offline_writes_every_kit_with_its_certificate(tmp_path):
    from hfl_components.flare.site_config import validate_site_config

    out = tmp_path / "prov"
    r = run_cli("provision", "--project", str(PROJECT), "--out", str(out), timeout=300)
    assert r.returncode == 0, r.stderr + r.stdout
    proj = yaml.safe_load(PROJECT.read_text())
    prod = out / proj["name"] / "prod_00"
    for p in proj["participants"]:
        kit = prod / p["name"]
        cert = {"server": "server.crt", "client": "client.crt", "admin": "client.crt"}[p["type"]]
        assert (kit / "startup" / cert).is_file(), f"{p['name']}: no {cert}"
        assert (kit / "startup" / "rootCA.pem").is_file()
        if p["type"] in ("server", "client"):
            assert (kit / "startup" / "start.sh").is_file()
        else:
            assert (kit / "startup" / "fed_admin.json").is_file()
        if p["type"] == "server":  # the installed package's controllers are allow-listed on the server
            res = json.loads((kit / "local" / "resources.json").read_text())
            assert "hfl_components.flare.controllers" in res["class_allow_list"]
        assert p["name"] in r.stdout  # the printout says which kit goes to whom
        if p["type"] == "client":
            assert f"hospital {p['name']} ({p['org']})" in r.stdout
            # the default site authorization policy lets the coordinator's role submit jobs with custom code
            auth = json.loads((kit / "local" / "authorization.json.default").read_text())["permissions"]["lead"]
            assert auth["submit_job"] == "any" and auth["byoc"] == "any"
            assert auth["download_job"] in ("n:submitter", "any")
            assert f"bash {p['name']}/startup/start.sh" in r.stdout  # the one command the hospital runs
            # the kit ships a commented site-config template where the site looks for its config
            sample = kit / "local" / "cxr_hfl" / f"{p['name']}.yaml.sample"
            cfg = validate_site_config(yaml.safe_load(sample.read_text()), p["name"], sample, check_files=False)
            assert cfg["device"] == "auto" and cfg["share_predictions"] is False
            assert f"cxr-hfl site check --config local/cxr_hfl/{p['name']}.yaml" in sample.read_text()


def test_provision_rejects_a_project_without_a_submitter(tmp_path):
    from nvflare_jobs.deploy import DeployError, load_project

    proj = yaml.safe_load(PROJECT.read_text())
    proj["participants"] = [p for p in proj["participants"] if p["type"] != "admin"]
    f = tmp_path / "p.yml"
    f.write_text(yaml.safe_dump(proj))
    with pytest.raises(DeployError, match="role may submit"):
        load_project(f)


@pytest.mark.parametrize("method", JOB_METHODS)
def test_export_job_is_portable_for_every_method(tmp_path, method):
    from nvflare_jobs.deploy import check_job_folder

    man = {s: tmp_path / "data" / f"{s}.csv" for s in ("hospital-a", "hospital-b")}  # not read by the export
    profile = tiny_profile(man, tmp_path / "profile", method)
    args = ["export-job", "--method", method, "--profile", str(profile), "--rounds", "2", "--out", str(tmp_path / "jobs")]
    if method == "ohfl":
        args += ["--probe", "generated"]
    r = run_cli(*args, timeout=300)
    assert r.returncode == 0, r.stderr + r.stdout
    folder = tmp_path / "jobs" / f"cxr_hfl_{method}"
    meta = check_job_folder(folder)
    assert meta["deploy_map"] == {"app_server": ["server"], "app_hospital-a": ["hospital-a"],
                                  "app_hospital-b": ["hospital-b"]}
    blob = "\n".join(p.read_text(errors="replace") for p in folder.rglob("*") if p.is_file())
    assert str(tmp_path / "data") not in blob, "no hospital's data path may travel in a job"
    assert str(REPO_ROOT) not in blob, "the job must not name paths on the exporting machine"
    for site in ("hospital-a", "hospital-b"):
        cfg = json.loads((folder / f"app_{site}" / "config" / "config_fed_client.json").read_text())
        assert cfg["executors"][0]["executor"]["args"]["task_script_path"] == "site_script.py"
        # the job ships only the site script; the site runs its installed, pinned cxr-hfl package
        assert [q.name for q in (folder / f"app_{site}" / "custom").rglob("*")] == ["site_script.py"]
    assert not (folder / "app_server" / "custom").exists()
    # every controller setting is written, defaults included: a server with other defaults runs the same job
    import inspect

    from hfl_components.flare.catalogue import entry
    from hfl_components.flare.options import resolve

    srv = json.loads((folder / "app_server" / "config" / "config_fed_server.json").read_text())
    ctl_args = srv["workflows"][0]["args"]
    ctl_cls = resolve(entry(method).controller)
    params = [p for p in inspect.signature(ctl_cls.__init__).parameters if p != "self"]
    assert sorted(ctl_args) == sorted(params), (sorted(ctl_args), sorted(params))
    if method == "ohfl":
        assert ctl_args["repair"] == "channel" and ctl_args["probe_at"] == "own" and ctl_args["strategy"] == "cid"


def test_check_job_folder_rejects_machine_paths(tmp_path):
    from nvflare_jobs.deploy import DeployError, check_job_folder, make_portable

    app = tmp_path / "job" / "app_x"
    (app / "config").mkdir(parents=True)
    (app / "custom").mkdir()
    (app / "custom" / "site_script.py").write_text("")
    (tmp_path / "job" / "meta.json").write_text(json.dumps({"name": "j", "deploy_map": {"app_x": ["x"]}}))
    cfg = {"executors": [{"tasks": ["*"], "executor": {"path": "E", "args": {"task_script_path": "/abs/site_script.py"}}}]}
    (app / "config" / "config_fed_client.json").write_text(json.dumps(cfg))
    with pytest.raises(DeployError, match="path on the exporting machine"):
        check_job_folder(tmp_path / "job")
    make_portable(tmp_path / "job")
    check_job_folder(tmp_path / "job")


def test_site_finds_its_config_in_its_own_kit_local_folder(tmp_path, monkeypatch):
    """A POC/provisioned site job runs with cwd = the site's workspace (the kit: startup/, local/); the lookup
    also works from deeper folders (the job's run folder) and stops at the kit."""
    from hfl_components.flare.site_config import ENV_DIR, SiteConfigError, find_site_config

    monkeypatch.delenv(ENV_DIR, raising=False)
    kit = tmp_path / "hospital-a"
    (kit / "startup").mkdir(parents=True)
    cfg = kit / "local" / "cxr_hfl" / "hospital-a.yaml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text("data: {manifest: x.csv}\nmodel: {family: cnn}\n")
    deep = kit / "0b1c-job" / "app_hospital-a" / "custom"
    deep.mkdir(parents=True)
    assert find_site_config("hospital-a", start=kit) == cfg
    assert find_site_config("hospital-a", start=deep) == cfg
    # another hospital's file above the kit is never picked up
    other = tmp_path / "local" / "cxr_hfl" / "hospital-b.yaml"
    other.parent.mkdir(parents=True)
    other.write_text("x: 1\n")
    with pytest.raises(SiteConfigError, match="hospital-b"):
        find_site_config("hospital-b", start=deep)
    # a folder the operator passes when starting the site wins
    alt = tmp_path / "operator_cfg"
    alt.mkdir()
    (alt / "hospital-a.yaml").write_text("x: 1\n")
    monkeypatch.setenv(ENV_DIR, str(alt))
    assert find_site_config("hospital-a", start=deep) == alt / "hospital-a.yaml"


def test_share_predictions_switch_is_validated_and_off_by_default(tmp_path):
    from hfl_components.flare.site_config import SiteConfigError, validate_site_config

    base = {"data": {"manifest": "x.csv"}, "model": {"family": "cnn", "depth": "shallow"}}
    # a real site keeps its per-image predictions unless it opts in
    assert validate_site_config(base, "s", check_files=False)["share_predictions"] is False
    assert validate_site_config({**base, "share_predictions": True}, "s", check_files=False)["share_predictions"] is True
    with pytest.raises(SiteConfigError, match="share_predictions"):
        validate_site_config({**base, "share_predictions": "no"}, "s", check_files=False)


def test_error_reasons_sent_to_the_server_carry_no_paths():
    from hfl_components.flare.privacy import redact_paths

    msg = ("site hospital-a: task local_train failed: ImageReadError: cannot decode "
           "/data/pacs/CompressedSamples^RG1/RG1_UNCR.dcm (truncated); manifest /data/site.csv")
    out = redact_paths(msg)
    assert "CompressedSamples" not in out and "RG1_UNCR" not in out and "/data" not in out
    assert out.startswith("site hospital-a: task local_train failed: ImageReadError: cannot decode <path>")
    assert redact_paths("file person3_virus_1.jpeg broken") == "file <file> broken"
    assert redact_paths("ratio 3/4 at lr 0.01") == "ratio 3/4 at lr 0.01"


def test_cli_lists_deploy_commands_and_needs_a_poc_folder(monkeypatch):
    monkeypatch.delenv("CXR_HFL_POC_DIR", raising=False)
    r = run_cli("--help")
    assert "provision" in r.stdout and "poc" in r.stdout
    r = run_cli("poc", "--help")
    for action in ("prepare", "start", "submit", "status", "download", "stop"):
        assert action in r.stdout
    r = run_cli("poc", "start")
    assert r.returncode == 2 and "--workspace" in r.stderr


def test_provision_and_poc_reject_a_file_where_a_folder_is_needed(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("x")
    r = run_cli("provision", "--out", str(f))
    assert r.returncode == 2 and "is a file, not a folder" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("poc", "status", "--workspace", str(f))
    assert r.returncode == 2 and "is a file, not a folder" in r.stderr and "Traceback" not in r.stderr
    assert f.read_text() == "x"
