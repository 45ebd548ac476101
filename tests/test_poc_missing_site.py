"""In NVFlare POC mode, a hospital stopped before a job starts: `poc submit` refuses the job naming it; with
`--allow-missing-sites` the job runs at the others and ends with that hospital named as not part of the job in
`poc status` (and `--json`), in `results` and in metrics.json, where `status RUN` agrees for every site. Two jobs
submitted at once either run or queue, and `status` says which; `poc abort` stops one. Whatever happens, the POC is
stopped and none of its processes or ports are left behind."""
from __future__ import annotations

import json
import time

import pytest

from tests.deploy_helpers import run_cli, tiny_manifests, tiny_profile

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
SITES = ["site-1", "site-2", "site-3"]


def _job_ids(ws) -> list[str]:
    return [j["job_id"] for j in json.loads((ws / "cxr_hfl_poc.json").read_text())["jobs"]]


def test_a_site_down_at_the_start_is_named_as_not_part_of_the_job(tmp_path, data_root):
    from nvflare_jobs.deploy import SERVER_PORTS, Poc, port_in_use, run_nvflare

    busy = [p for p in SERVER_PORTS if port_in_use(p)]
    if busy:
        pytest.skip(f"ports {busy} in use: another NVFlare server/POC runs on this machine")
    man = tiny_manifests(data_root, tmp_path / "data", SITES)
    profile = tiny_profile(man, tmp_path / "profile", "local")
    r = run_cli("export-job", "--method", "local", "--profile", str(profile), "--rounds", "1", "--local-epochs", "1",
                "--out", str(tmp_path / "jobs"))
    assert r.returncode == 0, r.stderr
    job = tmp_path / "jobs" / "cxr_hfl_local"
    assert json.loads((job / "meta.json").read_text())["cxr_hfl_expected_sites"] == SITES
    ws = tmp_path / "poc"
    poc = Poc(ws)
    try:
        r = run_cli("poc", "prepare", "--workspace", str(ws), "--profile", str(profile), "--no-site-check",
                    timeout=300)
        assert r.returncode == 0, r.stderr + r.stdout
        r = run_cli("poc", "start", "--workspace", str(ws), timeout=400)
        assert r.returncode == 0, r.stderr + r.stdout
        run_nvflare(["poc", "stop", "-p", "site-3"], poc.env, timeout=120, log=ws / "logs" / "stop_site3.log")
        deadline = time.time() + 120  # connected = heard within 20 s: site-3 drops out of it
        while "site-3" in poc.connected_sites() and time.time() < deadline:
            time.sleep(5)

        r = run_cli("poc", "submit", "--workspace", str(ws), "--job", str(job), timeout=300)
        assert r.returncode == 1 and "site-3:" in r.stderr and "--allow-missing-sites" in r.stderr, r.stderr
        assert _job_ids(ws) == [], "nothing was submitted"

        r = run_cli("poc", "submit", "--workspace", str(ws), "--job", str(job), "--allow-missing-sites",
                    "--wait", "600", timeout=900)
        assert r.returncode == 0, r.stderr + r.stdout
        assert "WARNING (--allow-missing-sites): site-3" in r.stderr
        assert "site site-3 was NOT part of the job" in r.stdout and "None/metrics.json" not in r.stdout
        jid = _job_ids(ws)[-1]
        run = ws / "runs" / jid
        m = json.loads((run / "metrics.json").read_text())
        assert m["expected_sites"] == SITES and list(m["not_deployed"]) == ["site-3"]
        assert sorted(m["sites"]) == ["site-1", "site-2"] and m["excluded_sites"] == {}

        r = run_cli("poc", "status", "--workspace", str(ws), jid, "--json", timeout=300)
        live = json.loads(r.stdout)
        assert r.returncode == 0 and live["job_state"] == "FINISHED:COMPLETED", r.stderr
        assert {s: d["state"] for s, d in live["sites"].items()} == {
            "site-1": "took part", "site-2": "took part", "site-3": "not deployed"}
        r = run_cli("status", str(run), "--json")
        folder = json.loads(r.stdout)
        for s in SITES:  # the job's view agrees with the run folder's for every site
            assert [live["sites"][s][k] for k in ("state", "reason", "test", "decision", "exclusions")] == \
                [folder["sites"][s][k] for k in ("state", "reason", "test", "decision", "exclusions")], s
        r = run_cli("poc", "status", "--workspace", str(ws), jid, timeout=300)
        assert "site-3" in r.stdout and "not deployed" in r.stdout and "done" not in r.stdout.split(), r.stdout

        # two jobs at once: each runs or is queued, and status says which; abort stops one
        ids = []
        for _ in range(2):
            r = run_cli("poc", "submit", "--workspace", str(ws), "--job", str(job), "--allow-missing-sites",
                        timeout=300)
            assert r.returncode == 0, r.stderr
            ids.append(_job_ids(ws)[-1])
        for j in ids:
            r = run_cli("poc", "status", "--workspace", str(ws), j, "--json", timeout=300)
            v = json.loads(r.stdout)
            assert v["job_state"].split(":")[0] in ("SUBMITTED", "DISPATCHED", "RUNNING", "FINISHED"), v
            assert v["schedule"] in ("running", None) or v["schedule"].startswith(("queued", "starting")), v
        r = run_cli("poc", "abort", "--workspace", str(ws), ids[1], timeout=300)
        assert r.returncode == 0, r.stderr + r.stdout
        first = poc.wait(ids[0], timeout=600)
        assert str(first.get("status", "")).startswith("FINISHED"), first
        second = poc.wait(ids[1], timeout=300)
        assert str(second.get("status", "")).startswith("FINISHED"), second  # aborted (or done before the abort)
    finally:
        run_cli("poc", "stop", "--workspace", str(ws), timeout=300)
        if poc.own_pids() or any(port_in_use(p) for p in SERVER_PORTS):
            poc.stop()
        assert not poc.own_pids(), f"POC processes left behind: {poc.own_pids()}"
        assert not [p for p in SERVER_PORTS if port_in_use(p)], "POC ports left open"
