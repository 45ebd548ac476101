"""End to end in NVFlare POC mode: prepare (with every site checked) -> start -> submit (as the provisioned
coordinator) -> wait -> download -> stop, with 2 sites, the `local` method and a tiny real data subset; a job for a
site that is not connected is refused by name; the job is run again with one site's image folder gone, and the
site is reported as left out with the ImageReadError; then every other method's exported job is submitted (the
first one with the command `poc start` prints) to check the server accepts it. Whatever happens, the POC is
stopped and none of its processes or ports are left behind."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from tests.deploy_helpers import JOB_METHODS, run_cli, tiny_manifests, tiny_profile

assert JOB_METHODS[0] == "local"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
SITES = ["site-1", "site-2"]


def test_poc_end_to_end(tmp_path, data_root):
    from nvflare_jobs.deploy import SERVER_PORTS, Poc, port_in_use

    busy = [p for p in SERVER_PORTS if port_in_use(p)]
    if busy:
        pytest.skip(f"ports {busy} in use: another NVFlare server/POC runs on this machine")
    man = tiny_manifests(data_root, tmp_path / "data", SITES)
    # site-1 opts in to sharing its per-image predictions; site-2 keeps the default (false: they stay at home)
    profile = tiny_profile(man, tmp_path / "profile", "local", **{"site-1": {"share_predictions": True}})
    r = run_cli("export-job", "--method", "local", "--profile", str(profile), "--rounds", "1", "--local-epochs", "1",
                "--out", str(tmp_path / "jobs"))
    assert r.returncode == 0, r.stderr
    job = tmp_path / "jobs" / "cxr_hfl_local"
    ws = tmp_path / "poc"
    poc = Poc(ws)
    try:
        r = run_cli("poc", "prepare", "--workspace", str(ws), "--profile", str(profile), timeout=300)
        assert r.returncode == 0, r.stderr + r.stdout
        assert r.stdout.count("OK     18 images, 0 unreadable") == 2, r.stdout  # every site was checked
        st = json.loads((ws / "cxr_hfl_poc.json").read_text())
        assert st["sites"] == SITES and st["coordinator_role"] == "lead"
        assert (ws / "home" / ".nvflare").is_dir(), "NVFlare's state must live in the POC folder, not in ~"
        for site in SITES:  # the production place, inside the site's own workspace
            assert (poc.site_workspace(site) / "local" / "cxr_hfl" / f"{site}.yaml").is_file()
            assert (poc.site_workspace(site) / "startup").is_dir()

        r = run_cli("poc", "start", "--workspace", str(ws), timeout=300)
        assert r.returncode == 0, r.stderr + r.stdout
        hint = next(line.split("or as in production:", 1)[1].strip() for line in r.stdout.splitlines()
                    if "or as in production:" in line)
        assert hint.startswith("cxr-hfl submit --job <job_folder> --startup-kit ")
        r = run_cli("poc", "start", "--workspace", str(ws), timeout=120)
        assert r.returncode == 1 and "is already running" in r.stderr, r.stderr

        # a job for a site that is not connected is refused, naming the site
        other = tiny_profile({"site-1": man["site-1"], "site-9": man["site-2"]}, tmp_path / "profile_other", "local")
        r = run_cli("export-job", "--method", "local", "--profile", str(other), "--out", str(tmp_path / "jobs_other"))
        assert r.returncode == 0, r.stderr
        r = run_cli("poc", "submit", "--workspace", str(ws), "--job", str(tmp_path / "jobs_other" / "cxr_hfl_local"))
        assert r.returncode == 1 and "site-9: not connected" in r.stderr, r.stderr + r.stdout
        r = run_cli("poc", "submit", "--workspace", str(ws), "--job", str(job), "--wait", "240", timeout=400)
        assert r.returncode == 0, r.stderr + r.stdout + _logs(poc)
        job_id = json.loads((ws / "cxr_hfl_poc.json").read_text())["jobs"][-1]["job_id"]
        r = run_cli("poc", "status", "--workspace", str(ws), timeout=120)
        assert r.returncode == 0 and "running" in r.stdout and job_id in r.stdout, r.stderr + r.stdout

        run = tmp_path / "run"
        r = run_cli("poc", "download", "--workspace", str(ws), "--out", str(run), timeout=300)
        assert r.returncode == 0, r.stderr + r.stdout
        m = json.loads((run / "metrics.json").read_text())
        assert m["method"] == "local" and sorted(m["sites"]) == SITES
        assert m["job_status"] == "FINISHED:COMPLETED"
        assert m["submitter_role"] == "lead", "the provisioned coordinator (role lead) submitted the job"
        for site in SITES:
            assert m["sites"][site]["n_test"] == 6 and m["sites"][site]["test"]["confusion_matrix"]
            # each site found its own config in its own workspace and kept this job's state in the job folder
            assert (poc.site_workspace(site) / job_id / "cxr_hfl_state" / "deployed_model.pt").is_file()
        assert (run / "sites.csv").is_file() and list(run.glob("*.png"))
        server_rec = json.loads(next((ws / "downloads").rglob("server_results.json")).read_text())
        assert "_probs" in server_rec["sites"]["site-1"]["test"]
        assert "_probs" not in server_rec["sites"]["site-2"]["test"], "share_predictions defaults to false"

        # site-2's image folder is gone: it is left out with the ImageReadError, shown by `poc submit --wait`
        kit_cfg = poc.site_workspace("site-2") / "local" / "cxr_hfl" / "site-2.yaml"
        rows = man["site-2"].read_text().splitlines()
        broken = tmp_path / "data" / "site-2-broken.csv"
        broken.write_text("\n".join([rows[0]] + [r_.replace("/train/NORMAL/", "/train/NORMAL_gone/") for r_ in rows[1:]])
                          + "\n")
        kit_cfg.write_text(kit_cfg.read_text().replace(str(man["site-2"]), str(broken)))
        r = run_cli("poc", "submit", "--workspace", str(ws), "--job", str(job), "--wait", "240", timeout=500)
        assert r.returncode == 0, r.stderr + r.stdout
        assert "site site-2 left out of round 0 (local_train): site site-2: task local_train failed: " \
               "ImageReadError: <path>: cannot open file" in r.stdout, r.stdout
        jid2 = json.loads((ws / "cxr_hfl_poc.json").read_text())["jobs"][-1]["job_id"]
        m2 = json.loads((ws / "runs" / jid2 / "metrics.json").read_text())
        assert sorted(m2["sites"]) == ["site-1"] and "NORMAL_gone" not in json.dumps(m2)
        site_log = (poc.site_workspace("site-2") / jid2 / "log.txt").read_text()
        assert "ImageReadError: " + str(data_root) in site_log and "NORMAL_gone" in site_log
        assert "applying transform" not in site_log

        # every method's exported job is accepted by the server as is (one coordinator session; each job is
        # aborted right away: only acceptance is checked here, the methods themselves are tested in the simulator)
        from nvflare.fuel.flare_api.flare_api import new_secure_session

        from nvflare_jobs.deploy import check_job_folder, export_portable
        from nvflare_jobs.jobs import build_job
        from hfl_components.flare.site_config import load_profile

        sess = new_secure_session(st["coordinator"], st["admin_kit"], timeout=60)
        try:
            for method in JOB_METHODS[1:]:
                prof = load_profile(tiny_profile(man, tmp_path / f"profile_{method}", method))
                opts = {"rounds": 1, "probe": "generated"} if method == "ohfl" else {"rounds": 1}
                folder = export_portable(build_job(method, prof, opts), tmp_path / "jobs")
                check_job_folder(folder)
                if method == JOB_METHODS[1]:  # the command `poc start` printed works as printed (own HOME, no registry)
                    home = tmp_path / "fresh_home"
                    home.mkdir()
                    cmd = shlex.split(hint.replace("<job_folder>", str(folder)))
                    assert cmd[:2] == ["cxr-hfl", "submit"], cmd
                    cmd = [sys.executable, "-m", "nvflare_jobs.cli", *cmd[1:]]
                    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=home,
                                       env={**os.environ, "HOME": str(home)})
                    assert p.returncode == 0 and "job id " in p.stdout, p.stdout + p.stderr
                    jid = p.stdout.split("job id ")[-1].split()[0]
                else:
                    jid = sess.submit_job(str(folder))
                assert jid, method
                try:
                    sess.abort_job(jid)
                except Exception:  # noqa: BLE001 - it may not have been scheduled yet / already ended
                    pass
        finally:
            sess.close()
    finally:
        r = run_cli("poc", "stop", "--workspace", str(ws), timeout=300)
        if poc.own_pids() or any(port_in_use(p) for p in SERVER_PORTS):
            poc.stop()  # the CLI could not finish: end every leftover of this POC by PID
        assert not poc.own_pids(), f"POC processes left behind: {poc.own_pids()}"
        assert not [p for p in SERVER_PORTS if port_in_use(p)], "POC ports left open"


def _logs(poc) -> str:
    out = []
    for f in sorted(poc.prod_dir.rglob("log.txt"))[:6]:
        out.append(f"--- {f}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-15:]))
    return "\n".join(out)
