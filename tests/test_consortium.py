"""A consortium can run it for real (fast part, no POC): what provisioning writes into the kits (no log streaming,
a job store outside the temp folder, short client timeouts, private keys and CA state mode 600), the repository
ignoring CA material, the OHFL probe as a server path checked at job start, an edited job checked before it is
deployed, tracking scalars and receivers, the status view, a failed job's console reason, and the model card."""
from __future__ import annotations

import json
import stat
import subprocess
from pathlib import Path

import pytest

from tests.deploy_helpers import REPO_ROOT, run_cli, tiny_profile

PROJECT = REPO_ROOT / "site_configs" / "project.yml"
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def kits(tmp_path_factory):
    from nvflare_jobs.deploy import provision

    out = tmp_path_factory.mktemp("prov")
    res = provision(PROJECT, out, job_store="/srv/cxr-hfl/store")
    return out, res


def test_hospital_kits_do_not_stream_logs_to_the_server(kits):
    from nvflare.app_common.logging.site_log_streamer import SiteLogStreamer

    _, res = kits
    hospitals = [k for k in res["kits"] if k["type"] == "client"]
    assert len(hospitals) == 6
    for k in hospitals:
        default = json.loads((k["kit"] / "local" / "resources.json.default").read_text())
        # NVFlare's own default streams the job error log; the effective file a site reads turns it off
        assert default["allow_log_streaming"] is True
        eff = json.loads((k["kit"] / "local" / "resources.json").read_text())
        assert eff["allow_log_streaming"] is False
        paths = [c.get("path") for c in eff["components"]]
        assert f"{SiteLogStreamer.__module__}.{SiteLogStreamer.__name__}" not in paths
        assert any("ClientProcessJobLauncher" in p for p in paths), "the rest of NVFlare's resources is kept"


def test_server_kit_keeps_jobs_in_the_chosen_store_with_short_client_timeouts(kits, tmp_path):
    from nvflare.apis.fl_constant import ConfigVarName

    from nvflare_jobs.deploy import DeployError, provision, server_store
    from nvflare_jobs.deploy._kits import CLIENT_OUTCOME_WAIT_S, HEARTBEAT_TIMEOUT_S

    _, res = kits
    server = next(k for k in res["kits"] if k["type"] == "server")["kit"]
    assert server_store(server) == {"jobs": "/srv/cxr-hfl/store/jobs", "snapshots": "/srv/cxr-hfl/store/snapshots"}
    doc = json.loads((server / "local" / "resources.json").read_text())
    assert "/tmp" not in json.dumps({k: v for k, v in doc.items() if k != "class_allow_list"})
    assert doc["servers"][0]["heart_beat_timeout"] == HEARTBEAT_TIMEOUT_S < 600
    assert doc[ConfigVarName.CLIENT_OUTCOME_WAIT_TIMEOUT] == CLIENT_OUTCOME_WAIT_S < 900  # NVFlare's var name
    assert "hfl_components.flare.controllers" in doc["class_allow_list"]
    # the default is a persistent folder, never the system temp folder; a relative store is refused by name
    with pytest.raises(DeployError, match="--job-store.*absolute"):
        provision(PROJECT, tmp_path / "p2", job_store="relative/store")


def test_private_keys_and_ca_state_are_owner_only(kits):
    out, res = kits
    state = res["state_dir"]
    assert (state / "cert.json").is_file()
    keys = list(out.rglob("*.key"))
    assert len(keys) >= 8  # server, six hospitals, coordinator
    for f in keys + [state / "cert.json"]:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    ca = json.loads((state / "cert.json").read_text())
    assert "root_pri_key" in ca, "cert.json holds the root CA's private key"


def test_repository_ignores_ca_material_and_docs_say_how_to_keep_and_renew_it():
    for path in ("provision/cxr_hfl_consortium/state/cert.json", "provision/x/prod_00/hospital-a/startup/client.key",
                 "elsewhere/state/cert.json", "kits/server.key"):
        r = subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO_ROOT)
        assert r.returncode == 0, f"{path} is not ignored by .gitignore"
    doc = (REPO_ROOT / "docs" / "DEPLOYMENT.md").read_text()
    sec = doc.split("### Certificates and the CA state", 1)[1].split("\n## ", 1)[0].lower()
    for needle in ("state/", "offline", "360 days", "renew", "add a hospital", "--job-store", "mode 600"):
        assert needle in sec, needle


def test_export_keeps_the_probe_as_a_server_path_and_the_server_checks_it_at_start(tmp_path):
    from hfl_components.flare.controllers.ohfl import OHFLController

    man = {s: tmp_path / f"{s}.csv" for s in ("hospital-a", "hospital-b")}
    profile = tiny_profile(man, tmp_path / "profile", "ohfl")
    absent = "/data/public_probe_on_the_server"
    assert not Path(absent).exists()
    r = run_cli("export-job", "--method", "ohfl", "--profile", str(profile), "--probe", absent,
                "--out", str(tmp_path / "jobs"))
    assert r.returncode == 0, r.stderr
    srv = json.loads((tmp_path / "jobs" / "cxr_hfl_ohfl" / "app_server" / "config" / "config_fed_server.json")
                     .read_text())
    ctl_args = srv["workflows"][0]["args"]
    assert ctl_args["probe"] == absent, "the path as given, not resolved on the coordinator's machine"
    r = run_cli("export-job", "--method", "ohfl", "--profile", str(profile), "--probe", "probe_dir",
                "--out", str(tmp_path / "jobs2"))
    assert r.returncode == 2 and "absolute path on the server machine" in r.stderr
    # the server's job-start check (before any task is sent) names the missing probe
    ctl = OHFLController(**ctl_args)
    with pytest.raises(FileNotFoundError, match="public_probe_on_the_server"):
        ctl.check_server_inputs()
    probe = tmp_path / "probe"
    probe.mkdir()
    OHFLController(**{**ctl_args, "probe": "generated"}).check_server_inputs()
    with pytest.raises(FileNotFoundError, match="lists no images"):
        OHFLController(**{**ctl_args, "probe": str(probe)}).check_server_inputs()


def test_an_edited_job_is_checked_before_it_is_deployed(tmp_path):
    from nvflare_jobs.deploy import DeployError, check_job_folder

    man = {s: tmp_path / f"{s}.csv" for s in ("hospital-a", "hospital-b")}
    profile = tiny_profile(man, tmp_path / "profile", "fedavg")
    r = run_cli("export-job", "--method", "fedavg", "--profile", str(profile), "--out", str(tmp_path / "jobs"))
    assert r.returncode == 0, r.stderr
    job = tmp_path / "jobs" / "cxr_hfl_fedavg"
    check_job_folder(job)
    cfg = job / "app_server" / "config" / "config_fed_server.json"
    good = cfg.read_text()
    doc = json.loads(good)
    doc["workflows"][0]["args"]["num_rounds"] = 0
    cfg.write_text(json.dumps(doc))
    with pytest.raises(DeployError, match="config_fed_server.json: workflow .*num_rounds"):
        check_job_folder(job)
    doc["workflows"][0]["args"] = {**json.loads(good)["workflows"][0]["args"], "no_such_option": 1}
    cfg.write_text(json.dumps(doc))
    with pytest.raises(DeployError, match="no_such_option"):
        check_job_folder(job)
    cfg.write_text(good[:-5])
    with pytest.raises(DeployError, match="not valid JSON"):
        check_job_folder(job)
    # the production submit command refuses it before contacting any server
    r = run_cli("submit", "--job", str(job), "--startup-kit", str(tmp_path))
    assert r.returncode == 2 and "not valid JSON" in r.stderr and "nothing was submitted" in r.stderr


def test_tracking_scalars_are_losses_per_epoch_and_numeric_validation_metrics():
    from hfl_components.flare.tracking import tracking_scalars

    metrics = {"loss": [0.9, 0.7, float("nan")], "val": {"accuracy": 0.5, "auc": 0.75, "confusion_matrix": [[1, 0]],
                                                          "n": 4, "path": "/data/x.jpeg", "bad name/x": 1.0},
               "finetune_loss": [0.4]}
    out, step = tracking_scalars(metrics, rnd=3, epoch_step=10)
    assert step == 14  # three training epochs and one fine-tuning epoch
    assert out == [("train/loss", 0.9, 11), ("train/loss", 0.7, 12), ("finetune/loss", 0.4, 14),
                   ("val/accuracy", 0.5, 3), ("val/auc", 0.75, 3), ("val/n", 4.0, 3)]
    assert tracking_scalars({}, 0, 5) == ([], 5)


def test_tracking_receivers_default_tensorboard_and_mlflow_needs_its_extra(monkeypatch):
    import importlib.util

    from nvflare_jobs.jobs import tracking_receivers

    (tb,) = tracking_receivers()
    assert type(tb).__name__ == "TBAnalyticsReceiver"
    assert tracking_receivers("none") == []
    with pytest.raises(ValueError, match="--tracking mlflow"):
        tracking_receivers("tensorboard", "http://mlflow.example.org")
    names = [type(r).__name__ for r in tracking_receivers("mlflow")]
    assert names == ["TBAnalyticsReceiver", "MLflowReceiver"]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "mlflow" else real(n, *a))
    with pytest.raises(ValueError, match=r"pip install 'cxr-hfl\[mlflow\]'"):
        tracking_receivers("mlflow")


def test_status_view_names_every_site_with_its_state():
    from nvflare_jobs.status import format_view, job_view

    snap = {"phase": "waiting", "task": "fedavg_train", "round": 2, "method": "fedavg",
            "waiting_for": ["site-2", "site-3"], "answered": ["site-1"], "dropped_now": {},
            "late_wait_ends_in_s": 40.0,
            "sites": {"site-1": {"task": "fedavg_train", "round": 2, "epoch": 3, "epochs": 3, "loss": 0.5,
                                 "heard_s_ago": 1.0},
                      "site-2": {"task": "fedavg_train", "round": 2, "epoch": 1, "epochs": 3, "loss": 0.9,
                                 "heard_s_ago": 2.0}},
            "excluded": {"site-4": "silent for 31 s while working on the task"},
            "latest_val": {"site-1": {"round": 1, "balanced_accuracy": 0.625}}}
    v = job_view(snap, job_state="RUNNING", sites=["site-1", "site-2", "site-3", "site-4", "site-5"],
                 connected={"site-1": 3.0, "site-2": 4.0, "site-3": 1.0, "site-4": 50.0})
    st = {s: d["state"] for s, d in v["sites"].items()}
    assert st == {"site-1": "answered", "site-2": "late", "site-3": "late", "site-4": "excluded",
                  "site-5": "not connected"}
    assert v["sites"]["site-4"]["reason"].startswith("silent for 31 s")
    assert v["sites"]["site-3"]["heard_s_ago"] == 1.0  # from the server's client list when no progress yet
    text = format_view(v)
    assert "site-1" in text and "val balanced_accuracy 0.625 (round 1)" in text and "excluded: silent" in text
    # before the late wait every waited-for site is training; once finished every kept site is done
    v = job_view({**snap, "late_wait_ends_in_s": None}, job_state="RUNNING")
    assert v["sites"]["site-2"]["state"] == "training" and v["sites"]["site-4"]["state"] == "excluded"
    v = job_view({**snap, "phase": "done", "gate": {"adopted": 1}}, job_state="FINISHED:COMPLETED")
    assert v["sites"]["site-1"]["state"] == "done" and v["gate"] == {"adopted": 1}


def test_a_failed_job_prints_its_reason_and_writes_no_empty_metrics(tmp_path, capsys):
    from nvflare_jobs.commands.status import report_downloaded

    dl = tmp_path / "dl" / "job1" / "workspace" / "cxr_hfl_results"
    dl.mkdir(parents=True)
    (dl / "server_results.json").write_text(json.dumps(
        {"method": "ohfl", "failed": "invalid job configuration: OHFL probe set '/data/p' does not exist",
         "sites": {}, "rounds": [], "excluded": {}}))
    called = []
    rc = report_downloaded(tmp_path / "dl" / "job1", {"job_id": "job1", "status": "FINISHED:EXECUTION_EXCEPTION"},
                           lambda: called.append(1))
    err = capsys.readouterr().err
    assert rc == 1 and not called, "no run folder (metrics.json, plots) for a job no site finished"
    assert "job1: FINISHED:EXECUTION_EXCEPTION: invalid job configuration: OHFL probe set '/data/p'" in err


def _metrics(**kw):
    test = {"n": 10, "accuracy": 0.8, "auc": 0.9, "confusion_matrix": [[4, 1], [1, 4]]}
    sites = {s: {"model": {"family": "cnn", "depth": "shallow"}, "input_size": 64, "n_train": 40, "n_test": 10,
                 "test": test} for s in ("hospital-a", "hospital-b", "hospital-c")}
    return {"method": "fedavg", "labels": "binary", "sites": sites, "excluded_sites": {}, **kw}


def test_model_card_describes_the_actual_run():
    from nvflare_jobs.report import model_card

    card = model_card(_metrics(job_id="4f1c", job_status="FINISHED:COMPLETED", pooled_sites=["hospital-a"],
                               excluded_sites={"hospital-d": [{"round": 0, "task": "t", "reason": "r"}]}))
    assert "Kermany" not in card and "simulated" not in card
    assert "job 4f1c" in card and "120 training and 30 test images" in card and "left out: hospital-d" in card
    assert "from 1 of 3 sites with results (hospital-a); hospital-b, hospital-c kept their predictions" in card
    sim = model_card(_metrics(command="cxr-hfl simulate ...", pooled_sites=["hospital-a", "hospital-b", "hospital-c"]))
    assert "Kermany" in sim and "simulated partitions" in sim and "from 3 of 3 sites" in sim
    none = model_card(_metrics(job_id="x", pooled_sites=[]))
    assert "none: no site shared per-image predictions" in none


def test_cli_lists_status_results_and_submit():
    r = run_cli("--help")
    for cmd in ("status", "results", "submit"):
        assert cmd in r.stdout
    r = run_cli("status", "no-such-run-or-job")
    assert r.returncode == 2 and "--startup-kit" in r.stderr
    r = run_cli("results", "abc", "--out", "x", "--startup-kit", "/nonexistent")
    assert r.returncode == 2 and "not an admin startup kit" in r.stderr


def test_adding_a_hospital_later_keeps_the_ca_and_existing_kits(kits, tmp_path):
    """Re-provisioning into the same folder with the CA state present (DEPLOYMENT.md, Certificates) reuses the
    root CA and every certificate already handed out; only the new hospital needs its kit."""
    import yaml

    from nvflare_jobs.deploy import provision

    out, res = kits
    proj = yaml.safe_load(PROJECT.read_text())
    proj["participants"].append({"name": "hospital-g", "type": "client", "org": "new_hospital_org"})
    f = tmp_path / "project.yml"
    f.write_text(yaml.safe_dump(proj, sort_keys=False))
    res2 = provision(f, out, job_store="/srv/cxr-hfl/store")
    assert res2["prod_dir"] != res["prod_dir"]
    old, new = res["prod_dir"], res2["prod_dir"]
    assert (new / "hospital-g" / "startup" / "rootCA.pem").read_bytes() == (old / "hospital-a" / "startup" /
                                                                             "rootCA.pem").read_bytes()
    for k in ("hospital-a", "hospital-f"):
        assert (new / k / "startup" / "client.crt").read_bytes() == (old / k / "startup" / "client.crt").read_bytes()


def test_models_index_lists_every_model_file_with_hash_metrics_and_gate(tmp_path):
    import hashlib

    from nvflare_jobs.models_index import write_models_index
    from nvflare_jobs.status import run_folder_view

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "site-1_deployed.pt").write_bytes(b"weights one")
    (tmp_path / "models" / "site-1_local.pt").write_bytes(b"weights two")
    (tmp_path / "global_model.pt").write_bytes(b"global")
    m = _metrics(method="ohfl", seed=3, gate={"adopted_sites": ["hospital-a"], "kept_local": ["site-1"]},
                 global_model={"family": "cnn", "depth": "deep"})
    m["sites"]["site-1"] = dict(m["sites"]["hospital-a"], input_size=96)
    idx = json.loads(write_models_index(tmp_path, m).read_text())
    by = {e["name"]: e for e in idx["models"]}
    assert sorted(by) == ["global_model", "site-1_deployed", "site-1_local"]
    d = by["site-1_deployed"]
    assert d["sha256"] == hashlib.sha256(b"weights one").hexdigest() and d["bytes"] == len(b"weights one")
    assert (d["kind"], d["site"], d["method"], d["seed"], d["input_size"]) == ("deployed", "site-1", "ohfl", 3, 96)
    assert d["test"]["accuracy"] == 0.8 and d["gate"] == "kept its local model"
    assert by["site-1_local"]["test"] is None
    assert by["global_model"]["kind"] == "global" and by["global_model"]["model"] == {"family": "cnn", "depth": "deep"}
    (tmp_path / "metrics.json").write_text(json.dumps(m))
    v = run_folder_view(tmp_path)
    assert [e["name"] for e in v["models"]] == ["site-1_deployed", "site-1_local", "global_model"]
    assert v["job_state"] == "FINISHED:COMPLETED" and "hospital-a" in v["sites"]


def test_a_dead_site_process_reads_to_nvflare_as_unknown_not_a_job_failure(tmp_path):
    """The contract of ``site_script.crash_leaves_site_out`` with the installed NVFlare (its private parts: this
    test fails loudly if a new NVFlare reads the return-code file another way or fails jobs on the code): while a
    site's job process runs, a kill -9 reads as JobReturnCode.UNKNOWN through NVFlare's own reader, the client does
    not report it, and the server's job-failure handler does not fail a job on it; after a normal end the file is
    gone, so NVFlare's own exit code counts."""
    import inspect
    import logging

    from nvflare.apis.job_launcher_spec import JobReturnCode
    from nvflare.private.fed.client.client_executor import REPORTABLE_JOB_FAILURES
    from nvflare.private.fed.server.fed_server import FederatedServer
    from nvflare.private.fed.utils.fed_utils import get_return_code

    from hfl_components.flare.site_script import crash_leaves_site_out

    class Killed:  # a job handle whose process died of SIGKILL
        @staticmethod
        def poll():
            return -9

    run_dir = tmp_path / "job-1"
    run_dir.mkdir()
    with crash_leaves_site_out(str(run_dir)) as rc_file:
        assert Path(rc_file).parent == run_dir and Path(rc_file).is_file()
        rc = get_return_code(Killed(), "job-1", str(tmp_path), logging.getLogger("test"))  # NVFlare's client reads
    assert rc == JobReturnCode.UNKNOWN == 127, f"NVFlare read {rc} from the return-code file"
    assert rc not in REPORTABLE_JOB_FAILURES, "NVFlare's client now reports an unknown exit as a job failure"
    src = inspect.getsource(FederatedServer.process_job_failure)
    assert "fail_run" in src and "UNKNOWN" not in src, "NVFlare's server now fails a job on another exit code"
    assert not list(run_dir.iterdir()), "the return-code file outlived the block"
    with crash_leaves_site_out(str(run_dir)):
        pass
    assert not list(run_dir.iterdir())
    assert get_return_code(Killed(), "job-1", str(tmp_path), logging.getLogger("test")) == -9
    with crash_leaves_site_out(None) as none:  # the simulator: nothing written
        assert none is None


def test_status_json_keeps_nvflare_messages_off_stdout(monkeypatch, capsys):
    """NVFlare's admin session prints `Connecting to FLARE ...` on stdout (its print_human); `status --json` and
    `poc status --json` must print only the view's JSON there (the POC module parses it)."""
    from nvflare.fuel.flare_api import flare_api
    from nvflare.tool.cli_output import print_human

    from nvflare_jobs.commands.status import open_session, show

    def fake_session(user, kit, timeout):
        print_human("Connecting to FLARE ...")
        return (user, kit)

    monkeypatch.setattr(flare_api, "new_secure_session", fake_session)
    assert open_session("coordinator", "/kits/c", 5, quiet=True) == ("coordinator", "/kits/c")

    def view():
        print_human("polling ...")
        return {"job_id": "j1", "job_state": "FINISHED:COMPLETED", "sites": {}}

    show(view, True, None)
    out, err = capsys.readouterr()
    assert json.loads(out) == view() and "Connecting to FLARE" in err and "polling" in err
    capsys.readouterr()
    open_session("coordinator", "/kits/c", 5)  # the console view keeps NVFlare's line where NVFlare puts it
    assert "Connecting to FLARE" in capsys.readouterr().out
