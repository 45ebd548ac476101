"""A consortium can rely on it (POC mode, one POC for the module, 3 sites, tiny real data):

* Ctrl-C of ``cxr-hfl poc start`` stops every process it started;
* a site whose training process is killed (kill -9) is left out, the job still ends ``FINISHED:COMPLETED``, and
  ``cxr-hfl poc status --json`` names the site as excluded (with the reason) while the job runs;
* nothing from a site's log reaches the server (NVFlare streams a site's job error log by default);
* a cross-site evaluation job of 2 indexed model files over the 3 sites gives the 3 x 2 matrix, equal to local
  scoring;
* a site that goes away entirely does not hold the job's end for NVFlare's 600 s heartbeat timeout.

The POC uses its own short client heartbeat and client-outcome timeouts (``nvflare_jobs.deploy._poc``). Skipped
when the POC's fixed ports are taken by another NVFlare server on this machine."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.deploy_helpers import REPO_ROOT, run_cli, tiny_manifests, tiny_profile

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
SITES = ["site-1", "site-2", "site-3"]
LONG_EPOCHS = 5000  # site-2 trains long enough to be killed mid-task


@pytest.fixture(scope="module")
def consortium(tmp_path_factory, data_root):
    from nvflare_jobs.deploy import SERVER_PORTS, Poc, port_in_use

    busy = [p for p in SERVER_PORTS if port_in_use(p)]
    if busy:
        pytest.skip(f"ports {busy} in use: another NVFlare server/POC runs on this machine")
    tmp = tmp_path_factory.mktemp("consortium")
    man = tiny_manifests(data_root, tmp / "data", SITES)
    profile = tiny_profile(man, tmp / "profile", "local", **{"site-2": {"local_epochs": LONG_EPOCHS}})
    ws = tmp / "poc"
    r = run_cli("poc", "prepare", "--workspace", str(ws), "--profile", str(profile), "--no-site-check", timeout=300)
    assert r.returncode == 0, r.stderr + r.stdout
    poc = Poc(ws)
    c = {"poc": poc, "ws": ws, "tmp": tmp, "man": man, "profile": profile, "data_root": data_root, "session": None}
    try:
        yield c
    finally:
        if c["session"] is not None:
            c["session"].close()
        run_cli("poc", "stop", "--workspace", str(ws), timeout=300)
        if poc.own_pids() or any(port_in_use(p) for p in SERVER_PORTS):
            poc.stop()
        assert not poc.own_pids(), f"POC processes left behind: {poc.own_pids()}"


def _export(c, name: str, profile: Path, *extra: str) -> Path:
    r = run_cli("export-job", "--method", "local", "--profile", str(profile), "--rounds", "1",
                "--out", str(c["tmp"] / name), *extra)
    assert r.returncode == 0, r.stderr
    return c["tmp"] / name / "cxr_hfl_local"


def _status(c, job_id: str) -> dict:
    r = run_cli("poc", "status", "--workspace", str(c["ws"]), job_id, "--json", timeout=120)
    assert r.returncode == 0, r.stderr + r.stdout
    return json.loads(r.stdout)  # --json: stdout is the view's JSON alone


def _api_status(c, job_id: str) -> dict:
    """The same view in-process (one admin session for the module, as the coordinator)."""
    from nvflare.fuel.flare_api.flare_api import new_secure_session

    from nvflare_jobs.status import admin_view

    if c.get("session") is None:
        st = c["poc"].state()
        c["session"] = new_secure_session(st["coordinator"], st["admin_kit"], timeout=60)
    return admin_view(c["session"], job_id)


def _site_job_pids(poc, site: str, job_id: str) -> list[int]:
    kit = str(poc.site_workspace(site))
    out = []
    for pid in poc.own_pids():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if kit in cmd and job_id in cmd:
            out.append(pid)
    return out


def _wait_training(c, job_id: str, site: str, timeout: float = 240) -> dict:
    end = time.time() + timeout
    while time.time() < end:
        v = _status(c, job_id)
        s = v["sites"].get(site) or {}
        if s.get("state") in ("training", "late") and (s.get("epoch") or 0) >= 1:
            return v
        time.sleep(3)
    raise AssertionError(f"{site} never reported training epochs: {v}")


def test_ctrl_c_of_poc_start_stops_what_it_started(consortium):
    poc = consortium["poc"]
    p = subprocess.Popen([sys.executable, "-m", "nvflare_jobs.cli", "poc", "start", "--workspace",
                          str(consortium["ws"])], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        end = time.time() + 120
        while time.time() < end and poc.server_pid() is None:  # the server process is up: start is under way
            time.sleep(0.5)
        assert poc.server_pid() is not None, "poc start never started the server"
        time.sleep(2)
        os.killpg(p.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends to the foreground process group
        out, err = p.communicate(timeout=180)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, (p.returncode, err)
    assert "interrupted" in err
    assert not poc.own_pids(), f"Ctrl-C left POC processes running: {poc.own_pids()}"


def test_a_killed_site_process_is_left_out_and_the_job_completes(consortium):
    c, poc = consortium, consortium["poc"]
    r = run_cli("poc", "start", "--workspace", str(c["ws"]), timeout=300)
    assert r.returncode == 0, r.stderr + r.stdout
    job = _export(c, "jobs_crash", c["profile"])
    job_id = poc.submit(job)
    _wait_training(c, job_id, "site-2")
    victims = _site_job_pids(poc, "site-2", job_id)
    assert victims, "site-2's job process not found"
    killed_at = time.time()
    for pid in victims:
        os.kill(pid, signal.SIGKILL)  # as the kernel's OOM killer does
    seen_excluded = None
    while time.time() - killed_at < 240:
        v = _api_status(c, job_id)
        if v["sites"].get("site-2", {}).get("state") == "excluded" and seen_excluded is None:
            seen_excluded = v
        if str(v["job_state"]).startswith("FINISHED"):
            break
        time.sleep(2)
    assert v["job_state"] == "FINISHED:COMPLETED", v
    assert time.time() - killed_at < 200, "the job's end waited for NVFlare's long client timeouts"
    assert seen_excluded is not None and seen_excluded["job_state"] == "RUNNING", \
        "status marks the killed site as excluded while the job runs"
    assert seen_excluded["sites"]["site-2"]["reason"], seen_excluded
    run = c["tmp"] / "run_crash"
    r = run_cli("poc", "download", "--workspace", str(c["ws"]), job_id, "--out", str(run), timeout=300)
    assert r.returncode == 0, r.stderr + r.stdout
    m = json.loads((run / "metrics.json").read_text())
    assert m["job_status"] == "FINISHED:COMPLETED" and sorted(m["sites"]) == ["site-1", "site-3"]
    ev = m["excluded_sites"]["site-2"]
    assert ev and ev[0]["reason"] and ev[0]["task"] == "local_train", ev
    assert "site site-2 left out of round 0 (local_train)" in r.stdout
    # tracking: the server's TensorBoard receiver wrote site-1's scalars; the report points to them
    assert m.get("tensorboard") and (Path(m["tensorboard"]) / "site-1").is_dir()


def test_nothing_from_a_site_log_reaches_the_server(consortium):
    c, poc = consortium, consortium["poc"]
    # site-2's image folder is gone: its job log names the files; the server must get only the redacted reason
    kit_cfg = poc.site_workspace("site-2") / "local" / "cxr_hfl" / "site-2.yaml"
    rows = c["man"]["site-2"].read_text().splitlines()
    broken = c["tmp"] / "data" / "site-2-broken.csv"
    broken.write_text("\n".join([rows[0]] + [r_.replace("/train/", "/train_gone/") for r_ in rows[1:]]) + "\n")
    text = kit_cfg.read_text()
    kit_cfg.write_text(text.replace(str(c["man"]["site-2"]), str(broken)).replace(f"local_epochs: {LONG_EPOCHS}",
                                                                                   "local_epochs: 1"))
    job = _export(c, "jobs_log", c["profile"])
    job_id = poc.submit(job)
    data = poc.wait(job_id, timeout=300)
    assert str(data.get("status")) == "FINISHED:COMPLETED", data
    site_logs = " ".join(p.read_text(errors="replace") for p in (poc.site_workspace("site-2") / job_id).rglob("*.txt"))
    assert "train_gone" in site_logs and "ImageReadError" in site_logs, "the site's own log has the paths"
    poc.download_raw(job_id)
    leaks = []
    roots = [poc.prod_dir / "server", c["ws"] / "store", c["ws"] / "downloads"]
    for root in roots:
        for p in root.rglob("*"):
            if p.is_file() and p.stat().st_size < 50_000_000:
                blob = p.read_bytes()
                for s in ("train_gone", str(c["data_root"]), str(broken)):
                    if s.encode() in blob:
                        leaks.append(f"{p}: {s}")
    assert not leaks, "a site's log reached the server:\n" + "\n".join(leaks[:10])
    kit_cfg.write_text(text)


def test_cross_site_evaluation_job_gives_the_sites_x_models_matrix(consortium):
    """2 model files of a run's models.json x the POC's 3 sites: the model files travel in the job's server app
    (read there by a path relative to the app, checked against the hash the index gave), and the 3 x 2 matrix
    equals each file scored locally on each site's test split."""
    from tests.test_crosssite import _model_files

    from nvflare_jobs.crosssite import score_locally
    from nvflare_jobs.models_index import write_models_index

    c, poc = consortium, consortium["poc"]
    files = _model_files(c["tmp"] / "run_models")
    write_models_index(c["tmp"] / "run_models", {"method": "local", "seed": 0})
    r = run_cli("export-eval", "--profile", str(c["profile"]), "--model", str(files[0]), "--model", str(files[1]),
                "--out", str(c["tmp"] / "jobs_eval"))
    assert r.returncode == 0, r.stderr
    run = c["tmp"] / "run_eval"
    job_id = poc.submit(c["tmp"] / "jobs_eval" / "cxr_hfl_cross_site")
    assert str(poc.wait(job_id, timeout=300).get("status")) == "FINISHED:COMPLETED"
    r = run_cli("poc", "download", "--workspace", str(c["ws"]), job_id, "--out", str(run), timeout=300)
    assert r.returncode == 0, r.stderr + r.stdout
    res = json.loads((run / "cross_site.json").read_text())
    # indexed files are named by their run folder and file: run_models.model_a
    assert res["sites"] == SITES and res["models"] == ["run_models.model_a", "run_models.model_b"]
    assert (run / "cross_site.png").is_file()
    for site in SITES:
        local = score_locally(c["profile"] / f"{site}.yaml", site, files)
        for name in res["models"]:
            got, want = res["matrix"][site][name], local[name]
            assert got["confusion_matrix"] == want["confusion_matrix"], (site, name)
            assert got["balanced_accuracy"] == pytest.approx(want["balanced_accuracy"], abs=1e-6)
    assert "model_a: bal. acc." in r.stdout


def test_a_site_that_goes_away_does_not_hold_the_job(consortium):
    c, poc = consortium, consortium["poc"]
    job = _export(c, "jobs_gone", c["profile"])
    job_id = poc.submit(job)
    _wait_training(c, job_id, "site-2")
    t0 = time.time()
    kit = str(poc.site_workspace("site-2"))
    for sig in (signal.SIGKILL,):  # the whole site: its start loop, client and job process
        for pid in poc.own_pids():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if kit in cmd:
                os.kill(pid, sig)
    data = poc.wait(job_id, timeout=300)
    assert str(data.get("status")) == "FINISHED:COMPLETED", data
    assert time.time() - t0 < 200, f"the job's end was held {time.time() - t0:.0f} s by the site that went away"
