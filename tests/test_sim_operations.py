"""Operations in the NVFlare simulator: a killed site worker is excluded at the next task without waiting out the
late wait, a run left with fewer than min_sites fails with a non-zero exit code, SIGTERM stops the whole process
tree, and a rerun into the interrupted folder says how to replace it."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from tests.sim_helpers import REPO_ROOT, load_metrics, make_partition, make_profile, read_status, run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def partition3(data_root, tmp_path_factory):
    return make_partition(data_root, tmp_path_factory.mktemp("ops_p3"), 3)


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "nvflare_jobs.cli", *args], cwd=REPO_ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for(pred, proc, timeout=300.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.5)
    return False


def _run_processes(run: Path) -> list[psutil.Process]:
    """Every live process whose command line names this run's folder (the simulator's site workers carry their
    workspace path), whoever their parent is now."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and any(str(run) in a for a in p.info["cmdline"] or []):
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def _worker(proc: subprocess.Popen, site: str) -> psutil.Process | None:
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            cmd = p.cmdline()
        except psutil.NoSuchProcess:
            continue
        if "nvflare.private.fed.app.simulator.simulator_worker" in cmd and site in cmd:
            return p
    return None


def test_killed_site_is_excluded_at_the_next_task_not_after_the_late_wait(partition3, tmp_path):
    """FedAvg, 3 sites, 3 rounds, a fixed --late-wait of 900 s: site-2's worker is killed after its first task.
    The run ends with exit 0; site-2 is excluded from every later task for being down (never for the late wait
    running out), named in metrics.json and on the console."""
    profile = make_profile(partition3, tmp_path / "profile", "fedavg")
    run = tmp_path / "run"
    proc = _start("simulate", "--method", "fedavg", "--profile", str(profile), "--rounds", "3", "--min-sites", "2",
                  "--late-wait", "900", "--out", str(run))
    try:
        assert _wait_for(lambda: (read_status(run).get("round") or 0) >= 1, proc), proc.communicate()
        w = _worker(proc, "site-2")
        assert w is not None, "site-2's simulator worker not found"
        w.kill()
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    m = load_metrics(run)
    assert sorted(m["sites"]) == ["site-1", "site-3"]
    events = m["excluded_sites"]["site-2"]
    assert [e["round"] for e in events] == [1, 2, 3]  # rounds 1, 2 and the final evaluation (round 3)
    for e in events:
        assert "late wait" not in e["reason"], e
        assert "not running" in e["reason"] or "site down" in e["reason"] or "silent" in e["reason"], e
    assert "site site-2 excluded" in err
    assert "site-2" in out and "excluded" in out.lower()  # the final summary names it


def test_fewer_than_min_sites_exits_non_zero_and_names_the_site(partition3, tmp_path):
    profile = make_profile(partition3, tmp_path / "profile", "local")
    bad = yaml.safe_load((profile / "site-3.yaml").read_text())
    bad["data"]["manifest"] = str(tmp_path / "gone" / "site.csv")
    (profile / "site-3.yaml").write_text(yaml.safe_dump(bad))
    run = tmp_path / "run"
    r = run_cli("simulate", "--method", "local", "--profile", str(profile), "--rounds", "1", "--min-sites", "3",
                "--out", str(run))
    assert r.returncode == 3, r.stdout[-2000:] + r.stderr[-2000:]
    assert "the run failed" in r.stderr and "min_sites=3" in r.stderr
    rec = json.loads(next(run.glob("workspace/server/*/cxr_hfl_results/server_results.json")).read_text())
    assert "site-3" in rec["excluded"] and "data.manifest" in rec["excluded"]["site-3"][0]["reason"]


def test_sigterm_stops_the_whole_tree_and_a_rerun_says_how_to_replace(partition3, tmp_path):
    # enough epochs that the run cannot finish before every site has reported progress (with 50, an idle machine
    # once finished the whole 2-round run between two polls of status.json); SIGTERM ends it long before that
    profile = make_profile(partition3, tmp_path / "profile", "local", local_epochs=2000)
    run = tmp_path / "run"
    proc = _start("simulate", "--method", "local", "--profile", str(profile), "--rounds", "2", "--out", str(run))
    try:
        # wait until the server is up and every site worker has fetched its first task
        assert _wait_for(lambda: len((read_status(run).get("sites") or {})) == 3, proc), proc.communicate()
        tree = psutil.Process(proc.pid).children(recursive=True)
        workers = [p for p in tree if "simulator_worker" in " ".join(p.cmdline())]
        assert len(workers) == 3 and len(_run_processes(run)) >= 3
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-3000:]
    assert "interrupted" in err and "--overwrite" in err
    gone, alive = psutil.wait_procs(tree, timeout=10)
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [p.cmdline() for p in alive]
    assert not _run_processes(run)
    r = run_cli("simulate", "--method", "local", "--profile", str(profile), "--rounds", "2", "--out", str(run))
    assert r.returncode == 2 and "unfinished" in r.stderr and "--overwrite" in r.stderr


def test_sigterm_on_compare_stops_every_run_process_and_a_rerun_resumes(data_root, tmp_path):
    out = tmp_path / "cmp"
    proc = _start("compare", "--methods", "local", "--data", str(data_root / "chest_xray_original"), "--sites", "3",
                  "--max-images", "90", "--max-train-images", "16", "--local-epochs", "2000", "--out", str(out))
    # 2000 epochs: the run must still be training when every site has reported (50 could finish between two polls
    # on an idle machine); SIGTERM ends it, and the rerun below is a dry run
    run = out / "seed0" / "local"
    try:
        assert _wait_for(lambda: len((read_status(run).get("sites") or {})) == 3, proc, timeout=400), proc.communicate()
        tree = psutil.Process(proc.pid).children(recursive=True)
        assert sum("simulator_worker" in " ".join(p.cmdline()) for p in tree) == 3
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-3000:]
    assert "rerun the same command to resume" in err
    _, alive = psutil.wait_procs(tree, timeout=10)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not _run_processes(out)
    r = run_cli("compare", "--methods", "local", "--data", str(data_root / "chest_xray_original"), "--sites", "3",
                "--max-images", "90", "--out", str(out), "--dry-run")
    assert r.returncode == 0 and "resuming" in r.stdout and "0 finished run(s)" in r.stdout
