"""A finished job's truth, one per site: took part (final metrics, gate or acceptance decision, rounds left out of),
excluded (round and reason), never deployed to (reason), or missing; recorded at the server (the job meta's
expected sites against the sites NVFlare deployed it to), kept in metrics.json, and shown alike by `status` on the
run folder, `status` / `poc status` of the job through the admin API, and `results`."""
from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from hfl_components.flare.participation import EXPECTED_SITES_KEY, expected_sites, not_deployed
from nvflare_jobs.status import admin_view, format_view, job_view, run_folder_view, site_truth

SITES = ["hospital-a", "hospital-b", "hospital-c", "hospital-d"]
DOWN = "not connected to the server when the job started: NVFlare deployed it to the 3 connected sites only"


def _test(acc):
    return {"n": 10, "accuracy": acc, "balanced_accuracy": acc - 0.05, "auc": acc + 0.1,
            "confusion_matrix": [[4, 1], [1, 4]]}


def server_record() -> dict:
    """hospital-a took part (gate adopted), hospital-b took part but was left out of round 1, hospital-c was
    excluded in every round, hospital-d was never deployed to."""
    spec = {"family": "cnn", "depth": "shallow", "num_classes": 2}
    return {
        "method": "fedavg", "labels": "binary", "task_config": {"seed": 0}, "rounds": [],
        "sites": {"hospital-a": {"model": spec, "input_size": 32, "n_train": 8, "n_test": 10, "test": _test(0.8),
                                 "gate": {"adopted": True, "reason": "beats local"}},
                  "hospital-b": {"model": spec, "input_size": 32, "n_train": 8, "n_test": 10, "test": _test(0.7),
                                 "gate": {"adopted": False, "reason": "local is better"}}},
        "excluded": {"hospital-b": [{"round": 1, "task": "fedavg_train", "reason": "silent for 60 s"}],
                     "hospital-c": [{"round": 1, "task": "fedavg_train", "reason": "error: out of memory"},
                                    {"round": 2, "task": "evaluate", "reason": "error: out of memory"}]},
        "expected_sites": SITES, "not_deployed": {"hospital-d": DOWN},
        "gate": {"adopted": 1, "sites": 2, "adopted_sites": ["hospital-a"], "kept_local": ["hospital-b"]}}


def test_expected_sites_come_from_the_job_meta_else_its_deploy_map():
    assert expected_sites({EXPECTED_SITES_KEY: ["b", "a"], "deploy_map": {"app": ["x"]}}) == ["a", "b"]
    dm = {"app_server": ["server"], "app_a": ["hospital-a"], "app_b": [{"sites": ["hospital-b"]}], "app": ["@ALL"]}
    assert expected_sites({"deploy_map": dm}) == ["hospital-a", "hospital-b"]
    assert expected_sites(None) == []
    why = not_deployed(["a", "b", "c"], ["a", "c"], 2)
    assert list(why) == ["b"] and "2 connected sites" in why["b"] and "min_clients 2" in why["b"]


def test_site_truth_names_every_sites_part_round_and_reason():
    t = site_truth(server_record())
    assert [t[s]["state"] for s in SITES] == ["took part", "took part", "excluded", "not deployed"]
    assert t["hospital-a"]["decision"] == "gate: adopted the federated model"
    assert t["hospital-b"]["decision"] == "gate: kept its local model (local is better)"
    assert t["hospital-a"]["test"] == {"balanced_accuracy": pytest.approx(0.75), "auc": pytest.approx(0.9),
                                       "accuracy": 0.8}
    assert t["hospital-b"]["exclusions"] == [{"round": 1, "task": "fedavg_train", "reason": "silent for 60 s"}]
    assert t["hospital-c"]["reason"] == "error: out of memory" and [e["round"] for e in
                                                                   t["hospital-c"]["exclusions"]] == [1, 2]
    assert t["hospital-d"]["reason"] == DOWN and t["hospital-d"]["test"] is None
    # an expected site the record names nowhere (a record from before the server kept not_deployed)
    rec = {**server_record(), "not_deployed": {}}
    assert site_truth(rec)["hospital-d"]["state"] == "missing"


class FakeSession:
    """The admin API calls admin_view makes, for a finished job whose results download holds ``rec``."""

    def __init__(self, root: Path, rec: dict, status: str = "FINISHED:COMPLETED"):
        self.root, self.rec, self.status = root, rec, status

    def get_job_meta(self, job_id):
        return {"status": self.status, "submitter_name": "lead@x", "min_clients": 3,
                "deploy_map": {f"app_{s}": [s] for s in SITES} | {"app_server": ["server"]},
                EXPECTED_SITES_KEY: SITES}

    def download_job_result(self, job_id):
        d = self.root / "transfer" / job_id / "workspace" / "cxr_hfl_results"
        d.mkdir(parents=True, exist_ok=True)
        (d / "server_results.json").write_text(json.dumps(self.rec))
        return str(self.root / "transfer" / job_id)

    def check_status(self, target):
        now = time.time()
        return {"clients": [{"client_name": s, "client_last_conn_time": now - 3} for s in SITES[:3]]}

    def show_stats(self, job_id, target):
        raise AssertionError("a finished job has no live stats")

    def close(self):
        pass


def _parts(view):
    return {s: (d["state"], d["reason"], d.get("test"), d.get("decision"), d.get("exclusions"))
            for s, d in view["sites"].items()}


def test_status_of_a_finished_job_agrees_with_the_run_folder_for_every_site(tmp_path, capsys):
    """`status JOB --startup-kit` (the downloaded server record) and `status RUN` (metrics.json written by
    `results` from the same download) give every site the same part, reason, metrics and decision; `results`
    names the run folder (never `None/metrics.json`) and the site that was not part of the job."""
    from nvflare_jobs.commands.status import report_downloaded
    from nvflare_jobs.deploy import assemble_downloaded

    sess = FakeSession(tmp_path, server_record())
    live = admin_view(sess, "job-1")
    assert not (tmp_path / "transfer" / "job-1").exists(), "status removes what it downloaded"
    assert [live["sites"][s]["state"] for s in SITES] == ["took part", "took part", "excluded", "not deployed"]
    text = format_view(live)
    assert "done" not in text.split()
    assert "left out of round 1 (fedavg_train): silent for 60 s" in text and DOWN in text

    dl = Path(sess.download_job_result("job-1"))
    run = tmp_path / "runs" / "job-1"
    meta = {**sess.get_job_meta("job-1"), "job_id": "job-1"}
    rc = report_downloaded(dl, meta, lambda: assemble_downloaded(dl, run, job_meta=meta))
    out = capsys.readouterr().out
    assert rc == 0 and f"-> {run / 'metrics.json'}" in out and "None/metrics.json" not in out
    assert "hospital-d" in out and "NOT part of the job" in out
    m = json.loads((run / "metrics.json").read_text())
    assert m["expected_sites"] == SITES and m["not_deployed"] == {"hospital-d": DOWN}
    assert _parts(run_folder_view(run)) == _parts(live)


def test_a_record_without_expected_sites_gets_them_from_the_job_meta(tmp_path):
    """A server record of an older job names no expected sites: `results` takes them from the job meta, so a
    site NVFlare never deployed to still reads `missing`, not absent."""
    from nvflare_jobs.deploy import assemble_downloaded

    rec = {k: v for k, v in server_record().items() if k not in ("expected_sites", "not_deployed")}
    sess = FakeSession(tmp_path, rec)
    dl = Path(sess.download_job_result("job-2"))
    m = assemble_downloaded(dl, tmp_path / "run", job_meta=sess.get_job_meta("job-2"))
    assert m["expected_sites"] == SITES
    assert run_folder_view(tmp_path / "run")["sites"]["hospital-d"]["state"] == "missing"
    assert admin_view(FakeSession(tmp_path / "b", rec), "job-2")["sites"]["hospital-d"]["state"] == "missing"


def test_the_server_records_a_site_it_never_deployed_to_and_the_final_snapshot_says_so():
    """The controller compares the job meta's expected sites with the sites NVFlare deployed the job to; its
    final snapshot (the simulator console's last view, `status` before metrics.json exists) gives the truth."""
    from hfl_components.flare.controllers.base import HFLController

    c = HFLController()
    c.engine = NS(get_clients=lambda: [NS(name=s) for s in SITES[:3]])
    c.note_participation(NS(get_prop=lambda k, d=None: {EXPECTED_SITES_KEY: SITES, "min_clients": 3}))
    assert list(c.record["not_deployed"]) == ["hospital-d"] and c.record["expected_sites"] == SITES
    rec = server_record()
    c.record.update(sites=rec["sites"], excluded=rec["excluded"])
    c._status["phase"] = "done"
    snap = json.loads(json.dumps(c.status_snapshot()))
    v = job_view(snap, job_state="FINISHED:COMPLETED")
    assert [v["sites"][s]["state"] for s in SITES] == ["took part", "took part", "excluded", "not deployed"]
    assert "not connected to the server when the job started" in v["sites"]["hospital-d"]["reason"]
    # while the job runs, the site never deployed to reads so too
    c._status["phase"] = "waiting"
    v = job_view(json.loads(json.dumps(c.status_snapshot())), job_state="RUNNING")
    assert v["sites"]["hospital-d"]["state"] == "not deployed"


def test_server_stage_reports_steps_and_an_eta_and_answered_sites_are_not_stale():
    """During OHFL's server stage the view shows the stage's step, total and ETA; a site that answered reads as
    waiting for the server, not as heard minutes ago."""
    from hfl_components.flare.controllers.base import HFLController
    from nvflare_jobs.progress import describe_server

    c = HFLController()
    c.set_phase("distilling")
    log = c.stage_log("distillation")
    log("OHFL [g0]: distillation step 20/300: train loss 0.5000")
    time.sleep(0.3)
    log("OHFL [g0]: distillation step 60/300: train loss 0.4000, held-aside loss 0.4 (best 0.4 at step 40)")
    sp = c.status_snapshot()["server_progress"]
    assert (sp["stage"], sp["step"], sp["total"]) == ("distillation [g0]", 60, 300)
    # 60 steps took elapsed_s; the remaining 240 at the same rate take 4x that
    assert sp["eta_s"] == pytest.approx(4 * sp["elapsed_s"], abs=0.2) and sp["elapsed_s"] >= 0.3
    snap = {**c.status_snapshot(), "answered": ["site-1"], "sites": {"site-1": {"task": "ohfl_train", "round": 0,
                                                                                "heard_s_ago": 250.0}}}
    v = job_view(snap, job_state="RUNNING")
    text = format_view(v)
    assert "server: distillation [g0] step 60 of 300" in text and "s left" in text
    assert "heard 250 s ago" not in text and "the server is working" in text
    assert "step 60 of 300" in describe_server(snap)
    c.set_phase("saving")  # a new phase ends the stage's progress
    assert c.status_snapshot()["server_progress"] is None


def test_fusion_reports_each_pairwise_fusion():
    """aggregate_models calls progress(done, n - 1) after each pairwise fusion: 2 of 2 for three sites."""
    import torch

    from hfl_components.fusion import aggregate_models
    from hfl_components.models.fusable import build_fusable

    models = []
    for i, depth in enumerate(("shallow", "shallow", "medium")):
        torch.manual_seed(i)
        spec = {"family": "cnn", "width": 0.1, "in_channels": 1, "num_classes": 2, "depth": depth}
        models.append({"name": f"s{i}", "spec": spec, "state_dict": build_fusable(spec).state_dict(),
                       "n_samples": 10 + i, "val_acc": 0.5})
    seen = []
    aggregate_models(models, "cid", probe=torch.rand(8, 1, 16, 16, generator=torch.Generator().manual_seed(0)),
                     progress=lambda k, n: seen.append((k, n)))
    assert seen == [(1, 2), (2, 2)]


def test_status_says_whether_a_job_runs_or_is_queued():
    from nvflare_jobs.status import schedule_note

    assert schedule_note("SUBMITTED").startswith("queued")
    assert schedule_note("DISPATCHED").startswith("starting")
    assert schedule_note("RUNNING") == "running" and schedule_note("FINISHED:COMPLETED") is None
    assert format_view(job_view(None, job_state="SUBMITTED", sites=["a"], job_id="j2")).startswith(
        "job j2: SUBMITTED (queued: ")
