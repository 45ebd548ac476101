"""Before and around a job on a real deployment (no NVFlare processes: the admin calls are faked): submit refuses a
job whose expected sites are not all connected (connected = heard within twice the heartbeat interval) unless
overridden, `abort` stops a job, `poc status --json` finds a job not sent through `poc submit`, Ctrl-C of `poc stop`
never claims what it did not do, the POC job store is private, hints name `cxr-hfl submit`, cross-site model names
tell runs apart, models.json fills model / input size / test, site check's exit codes are documented as they are,
and a run names its MLflow store."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hfl_components.flare.participation import (CLIENT_HEARTBEAT_INTERVAL_S, CONNECTED_WITHIN_S,
                                                EXPECTED_SITES_KEY, heard_from_status, unreachable)
from nvflare_jobs.deploy import OVERRIDE_FLAG, DeployError, check_connected

SITES = ["hospital-a", "hospital-b", "hospital-c"]
META = {EXPECTED_SITES_KEY: SITES, "min_clients": 2,
        "deploy_map": {**{f"app_{s}": [s] for s in SITES}, "app_server": ["server"]}}


def test_connected_means_heard_within_twice_the_heartbeat_interval():
    assert CONNECTED_WITHIN_S == 2 * CLIENT_HEARTBEAT_INTERVAL_S == 20
    now = 1000.0
    heard = heard_from_status({"clients": [{"client_name": "hospital-a", "client_last_conn_time": now - 19},
                                           {"client_name": "hospital-b", "client_last_conn_time": now - 21},
                                           {"client_name": "hospital-c"}]}, now)
    assert heard == {"hospital-a": 19.0, "hospital-b": 21.0, "hospital-c": None}
    missing = unreachable(SITES + ["hospital-d"], heard)
    assert list(missing) == ["hospital-b", "hospital-d"]  # a listed site without a time counts as connected
    assert "last heard 21 s ago" in missing["hospital-b"] and "not connected" in missing["hospital-d"]


def test_submit_check_refuses_names_each_site_and_the_override_warns():
    heard = {"hospital-a": 2.0, "hospital-b": 45.0}  # b stopped 45 s ago and is still listed; c is gone
    with pytest.raises(DeployError) as e:
        check_connected("job", META, heard)
    msg = str(e.value)
    assert "hospital-b: last heard 45 s ago" in msg and "hospital-c: not connected" in msg
    assert OVERRIDE_FLAG in msg and "nothing was submitted" in msg and "hospital-a" not in msg.split("\n", 1)[1]
    warn = check_connected("job", META, heard, allow_missing=True)
    assert [w.split(": ")[1] for w in warn[:2]] == ["hospital-b", "hospital-c"]
    assert any("fewer than the job's min_clients 2" in w for w in warn)
    assert check_connected("job", META, {s: 1.0 for s in SITES}) == []
    with pytest.raises(DeployError, match="did not say which sites are connected"):
        check_connected("job", META, None)


class FakeSession:
    def __init__(self, heard_ago: dict[str, float]):
        self.heard_ago, self.submitted, self.aborted = heard_ago, [], []

    def check_status(self, target):
        now = time.time()
        return {"clients": [{"client_name": s, "client_last_conn_time": now - a} for s, a in self.heard_ago.items()]}

    def submit_job(self, folder):
        self.submitted.append(folder)
        return "job-42"

    def abort_job(self, job_id):
        self.aborted.append(job_id)
        return "Abort signal has been sent to the server app."

    def get_job_meta(self, job_id):
        return {"status": "FINISHED:ABORTED" if self.aborted else "RUNNING"}

    def close(self):
        pass


@pytest.fixture
def job_folder(tmp_path, monkeypatch):
    import nvflare_jobs.deploy as deploy

    folder = tmp_path / "cxr_hfl_fedavg"
    folder.mkdir()
    (folder / "meta.json").write_text(json.dumps(META))
    monkeypatch.setattr(deploy, "check_job_folder", lambda f: json.loads((Path(f) / "meta.json").read_text()))
    return folder


def _cli(monkeypatch, sess, *argv):
    import nvflare_jobs.commands.status as cmd
    from nvflare_jobs.cli import main

    monkeypatch.setattr(cmd, "_session", lambda args: sess)
    return main(list(argv))


def test_production_submit_refuses_a_missing_site_and_submits_with_the_override(job_folder, monkeypatch, capsys):
    sess = FakeSession({"hospital-a": 1.0, "hospital-b": 3.0, "hospital-c": 95.0})
    rc = _cli(monkeypatch, sess, "submit", "--job", str(job_folder), "--startup-kit", "kit")
    err = capsys.readouterr().err
    assert rc == 1 and sess.submitted == [] and "hospital-c: last heard 95 s ago" in err
    rc = _cli(monkeypatch, sess, "submit", "--job", str(job_folder), "--startup-kit", "kit", OVERRIDE_FLAG)
    out = capsys.readouterr()
    assert rc == 0 and len(sess.submitted) == 1 and "job id job-42" in out.out
    assert "WARNING (--allow-missing-sites): hospital-c" in out.err


def test_abort_stops_a_job(monkeypatch, capsys):
    sess = FakeSession({})
    rc = _cli(monkeypatch, sess, "abort", "job-42", "--startup-kit", "kit")
    assert rc == 0 and sess.aborted == ["job-42"]
    assert "its status now: FINISHED:ABORTED" in capsys.readouterr().out


def _poc_folder(tmp_path) -> Path:
    from nvflare_jobs.deploy import STATE_FILE

    ws = tmp_path / "poc"
    prod = ws / "nvflare_poc" / "proj" / "prod_00"
    (prod / "server").mkdir(parents=True)
    (ws / STATE_FILE).write_text(json.dumps({"prod_dir": str(prod), "sites": SITES, "coordinator": "lead@x",
                                             "admin_kit": str(prod / "lead@x"), "jobs": [], "labels": "binary"}))
    return ws


def test_poc_status_json_shows_a_job_not_sent_through_poc_submit(tmp_path, monkeypatch, capsys):
    """No job in the POC folder's state (it was sent with `cxr-hfl submit`): `poc status --json` prints the view
    of the newest job on the server, one JSON object on stdout."""
    from nvflare_jobs.deploy import Poc
    import nvflare_jobs.commands.status as cmd
    from nvflare_jobs.cli import main
    from tests.test_status_truth import FakeSession as AdminSession, server_record

    ws = _poc_folder(tmp_path)
    monkeypatch.setattr(Poc, "server_up", lambda self: True)
    monkeypatch.setattr(Poc, "own_pids", lambda self: [1, 2])
    monkeypatch.setattr(Poc, "list_jobs", lambda self: [
        {"job_id": "old", "name": "a", "status": "FINISHED:COMPLETED", "submit_time_iso": "2026-01-01T10:00:00"},
        {"job_id": "new", "name": "b", "status": "FINISHED:COMPLETED", "submit_time_iso": "2026-01-02T10:00:00"}])
    monkeypatch.setattr(cmd, "open_session", lambda *a, **k: AdminSession(tmp_path / "dl", server_record()))
    rc = main(["poc", "status", "--workspace", str(ws), "--json"])
    out = capsys.readouterr().out
    v = json.loads(out)
    assert rc == 0 and v["job_id"] == "new" and v["sites"]["hospital-d"]["state"] == "not deployed"
    monkeypatch.setattr(Poc, "list_jobs", lambda self: [])
    rc = main(["poc", "status", "--workspace", str(ws), "--json"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["jobs"] == []


def test_ctrl_c_of_poc_stop_ends_the_start_loops_and_says_only_what_is_true(tmp_path, monkeypatch, capsys):
    """A start script's restart loop ignores SIGTERM (as NVFlare's sub_start.sh loops keep going): an interrupted
    `poc stop` ends it (TERM, then KILL) and reports what still runs, never a blanket 'all stopped'."""
    from nvflare_jobs.deploy import Poc
    from nvflare_jobs.cli import main

    ws = _poc_folder(tmp_path)
    prod = str(ws / "nvflare_poc" / "proj" / "prod_00")
    loop = subprocess.Popen(["sh", "-c", 'trap "" TERM; while :; do sleep 0.2; done', prod],
                            start_new_session=True)
    try:
        def interrupted(self, timeout=60):
            raise KeyboardInterrupt
        monkeypatch.setattr(Poc, "stop", interrupted)
        import time

        until = time.monotonic() + 10  # /proc shows the loop's command line once the child has exec'd
        while loop.pid not in Poc(ws).own_pids() and time.monotonic() < until:
            time.sleep(0.05)
        assert loop.pid in Poc(ws).own_pids()
        rc = main(["poc", "stop", "--workspace", str(ws)])
        err = capsys.readouterr().err
        assert rc == 130 and loop.wait(timeout=10) is not None
        assert "interrupted; every process of the POC ended" in err and "all its processes stopped" not in err
        assert Poc(ws).own_pids() == []
        # a process that would not end is named, with what to do
        monkeypatch.setattr(Poc, "end_now", lambda self: [4242])
        monkeypatch.setattr(Poc, "own_pids", lambda self: [4242])
        rc = main(["poc", "stop", "--workspace", str(ws)])
        err = capsys.readouterr().err
        assert rc == 130 and "STILL RUNNING: [4242]" in err and "poc stop --workspace" in err
    finally:
        if loop.poll() is None:
            loop.kill()


def test_poc_job_store_is_private(tmp_path, monkeypatch):
    """`poc start` makes the job store 700 and starts NVFlare with umask 077, so what the server writes there is
    600 / 700 (not 755 / 644)."""
    import nvflare_jobs.deploy._poc as pocmod
    from nvflare_jobs.deploy import Poc

    ws = _poc_folder(tmp_path)
    (ws / "store").mkdir()
    os.chmod(ws / "store", 0o755)
    seen = {}

    def fake_run(args, env, **kw):  # the server process writing a job into its store
        seen.update(kw)
        subprocess.run(["sh", "-c", f"mkdir -p {ws}/store/jobs/j1 && echo x > {ws}/store/jobs/j1/meta.json"],
                       umask=kw["umask"], check=True)
        return ""
    monkeypatch.setattr(pocmod, "run_nvflare", fake_run)
    monkeypatch.setattr(pocmod, "port_in_use", lambda port, host="127.0.0.1": False)
    monkeypatch.setattr(Poc, "server_up", lambda self: False)
    Poc(ws).start(timeout=1)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert seen["umask"] == 0o077
    assert [mode(ws / "store" / p) for p in ("", "jobs", "snapshots", "jobs/j1")] == [0o700] * 4
    assert mode(ws / "store" / "jobs" / "j1" / "meta.json") == 0o600


def test_every_submit_hint_names_cxr_hfl_submit(tmp_path):
    from nvflare_jobs.deploy import Poc

    assert Poc(_poc_folder(tmp_path)).submit_hint().startswith("cxr-hfl submit --job ")
    src = (Path(__file__).resolve().parents[1] / "nvflare_jobs" / "commands" / "deploy.py").read_text()
    assert "nvflare job submit" not in src
    doc = (Path(__file__).resolve().parents[1] / "docs" / "DEPLOYMENT.md").read_text()
    assert "nvflare job submit" not in doc.replace("`nvflare job submit` does not", "")


def test_cross_site_model_names_tell_runs_apart(tmp_path):
    from nvflare_jobs.crosssite import model_names

    a, b = tmp_path / "seed0" / "ohfl", tmp_path / "seed1" / "ohfl"
    names = model_names([(a, a / "models" / "site-1_deployed.pt"), (b, b / "models" / "site-1_deployed.pt"),
                         (tmp_path / "fedavg", tmp_path / "fedavg" / "global_model.pt"),
                         (tmp_path / "fedavg", tmp_path / "fedavg" / "global_model.pt"),
                         (None, tmp_path / "x" / "mine.pt"), (None, tmp_path / "y" / "mine.pt")])
    assert names == ["seed0.ohfl.site-1_deployed", "seed1.ohfl.site-1_deployed", "fedavg.global_model",
                     "fedavg.global_model-2", "x.mine", "y.mine"]
    assert model_names([(None, tmp_path / "x" / "mine.pt")]) == ["mine"]  # a file of no run: its name


def test_models_index_fills_model_input_size_and_test(tmp_path):
    """A FedAvg run's global model gets its spec and (one size at every site) its input size; an OHFL local model
    its own test metrics; a model never scored on the test split says why instead of a bare null."""
    from nvflare_jobs.models_index import write_models_index

    spec = {"family": "cnn", "depth": "deep", "num_classes": 2}
    test = {"n": 10, "accuracy": 0.8}
    run = tmp_path / "run"
    (run / "models").mkdir(parents=True)
    for name in ("global_model.pt", "models/site-1_local.pt", "models/site-1_federated.pt",
                 "models/site-1_deployed.pt"):
        (run / name).write_bytes(b"not a model file")  # the index falls back on metrics, not the header
    metrics = {"method": "ohfl", "global_spec": spec, "gate": {"adopted_sites": [], "kept_local": ["site-1"]},
               "sites": {"site-1": {"model": spec, "input_size": 64, "test": test, "local": {**test, "n": 9}}}}
    e = {x["name"]: x for x in json.loads(write_models_index(run, metrics).read_text())["models"]}
    assert e["global_model"]["model"] == spec and e["global_model"]["input_size"] == 64
    assert "deployed models" in e["global_model"]["test_note"]
    assert e["site-1_local"]["test"]["n"] == 9 and e["site-1_deployed"]["test"] == test
    assert e["site-1_federated"]["test"] is None and "kept its local model" in e["site-1_federated"]["test_note"]


def test_site_check_exit_codes_are_documented_as_they_are(tmp_path):
    """The exit codes in site check's --help and docs/DEPLOYMENT.md are one wording, and an invalid config exits
    2 as it says."""
    from nvflare_jobs.cli import main
    from nvflare_jobs.commands.site import CHECK_EXIT

    doc = " ".join((Path(__file__).resolve().parents[1] / "docs" / "DEPLOYMENT.md").read_text().split())
    assert CHECK_EXIT in doc
    bad = tmp_path / "hospital-a.yaml"
    bad.write_text("site: [unclosed\n")
    assert main(["site", "check", "--config", str(bad)]) == 2


def test_a_run_names_its_mlflow_store(tmp_path):
    from nvflare_jobs.results import assemble_run
    from nvflare_jobs.status import format_view, run_folder_view

    res = tmp_path / "ws" / "server" / "job" / "cxr_hfl_results"
    res.mkdir(parents=True)
    (res.parent / "mlflow.db").write_bytes(b"")
    (res / "server_results.json").write_text(json.dumps({"method": "local", "sites": {}, "rounds": []}))
    m = assemble_run(res / "server_results.json", tmp_path / "run", labels="binary", seed=0, wall_time_s=1.0,
                     class_names=["NORMAL", "PNEUMONIA"])
    want = f"sqlite:///{(res.parent / 'mlflow.db').resolve()}"
    assert m["mlflow"] == want and f"MLflow store: {want}" in format_view(run_folder_view(tmp_path / "run"))
