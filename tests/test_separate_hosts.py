"""A consortium on separate hosts: the server, two hospitals and the coordinator each run in their own network
namespace (``ip netns``) on this machine, with their own address and host name as in the provisioned kits (the
server's name resolves through the namespace's own ``/etc/netns/<ns>/hosts``), joined by a bridge. Provisioned kits
(mTLS), the platform's `cxr-hfl submit` (connected-site check) from the coordinator's host, one small job that
completes at both hospitals, and two jobs submitted at once that each run or queue with `status` saying which.

Needs root (CI runs as root) for ``ip netns`` and a bridge; it skips with the reason where they are not allowed.
Everything it creates (namespaces, veth pairs, the bridge, ``/etc/netns/<ns>``, processes) is removed at the end.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from tests.deploy_helpers import REPO_ROOT, tiny_manifests, tiny_profile

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
TAG = f"h{os.getpid() % 10000}"  # unique interface / namespace names for this run
SUBNET = f"10.{77 + os.getpid() % 100}.44"
SERVER = "server.cxr.test"
COORD = "coordinator@cxr.test"
HOSTS = {SERVER: 10, "hospital-a": 11, "hospital-b": 12, "coordinator": 13}  # host name -> last octet


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _skip_reason() -> str | None:
    if sys.platform != "linux" or shutil.which("ip") is None or shutil.which("unshare") is None:
        return "needs Linux with iproute2 (ip) and util-linux (unshare)"
    probe = f"{TAG}probe"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"network namespaces are not allowed here (ip netns add: {r.stderr.strip()})"
    _ip("netns", "del", probe, check=False)
    r = _ip("link", "add", f"{TAG}pb", "type", "bridge", check=False)
    if r.returncode != 0:
        return f"a bridge cannot be created here (ip link add: {r.stderr.strip()})"
    _ip("link", "del", f"{TAG}pb", check=False)
    return None


def _ns(host: str) -> str:
    return f"{TAG}{HOSTS[host]}"


@contextmanager
def network():
    """One namespace per host on a bridge, each with ``/etc/netns/<ns>/hosts`` naming every host; removed after
    (and every process still inside a namespace ended)."""
    br = f"{TAG}br"
    made = []
    try:
        _ip("link", "add", br, "type", "bridge")
        _ip("link", "set", br, "up")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{SUBNET}.{o} {h}\n" for h, o in HOSTS.items())
        for host, octet in HOSTS.items():
            ns, veth = _ns(host), f"{TAG}v{octet}"
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", br)
            _ip("link", "set", veth, "up")
            _ip("-n", ns, "addr", "add", f"{SUBNET}.{octet}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)
        yield
    finally:
        for ns in made:
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for sig in (signal.SIGTERM, signal.SIGKILL):
                for pid in pids:
                    try:
                        os.kill(int(pid), sig)
                    except (ProcessLookupError, ValueError):
                        pass
                time.sleep(2 if sig == signal.SIGTERM and pids else 0)
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        _ip("link", "del", br, check=False)


def _env(home: Path) -> dict:
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["HOME"] = str(home)
    env.pop("CXR_HFL_SITE_CONFIG_DIR", None)
    return env


def _on(host: str, cmd: list[str]) -> list[str]:
    """``cmd`` run on ``host``: in its namespace, with its own host name (a UTS namespace)."""
    return ["ip", "netns", "exec", _ns(host), "unshare", "--uts", "--", "sh", "-c",
            f'hostname "{host}" && exec "$@"', "sh", *cmd]


def _cli(host: str, env: dict, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(_on(host, [sys.executable, "-m", "nvflare_jobs.cli", *args]), capture_output=True,
                          text=True, env=env, timeout=timeout)


def _project(path: Path) -> Path:
    base = yaml.safe_load((REPO_ROOT / "site_configs" / "project.yml").read_text())
    proj = {"api_version": 3, "name": "cxr_hosts", "description": "separate-hosts test",
            "participants": [{"name": SERVER, "type": "server", "org": "consortium", "fed_learn_port": 8002,
                              "admin_port": 8003},
                             {"name": "hospital-a", "type": "client", "org": "org_a"},
                             {"name": "hospital-b", "type": "client", "org": "org_b"},
                             {"name": COORD, "type": "admin", "org": "consortium", "role": "lead"}],
            "builders": base["builders"]}
    path.write_text(yaml.safe_dump(proj, sort_keys=False))
    return path


def test_a_consortium_on_separate_hosts_runs_a_job_and_two_at_once(tmp_path, data_root):
    why = _skip_reason()
    if why:
        pytest.skip(why)
    env = _env(tmp_path / "home")
    (tmp_path / "home").mkdir()
    out = tmp_path / "prov"
    r = subprocess.run([sys.executable, "-m", "nvflare_jobs.cli", "provision", "--project",
                        str(_project(tmp_path / "project.yml")), "--out", str(out), "--job-store",
                        str(tmp_path / "store")], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr + r.stdout
    prod = out / "cxr_hosts" / "prod_00"
    assert json.loads((prod / "hospital-a" / "startup" / "fed_client.json").read_text())["client"][
        "connection_security"] == "mtls"
    sites = ["hospital-a", "hospital-b"]
    profile = tiny_profile(tiny_manifests(data_root, tmp_path / "data", sites), tmp_path / "profile", "local")
    for s in sites:  # each hospital's config in its own kit, where a provisioned site looks
        (prod / s / "local" / "cxr_hfl").mkdir(parents=True, exist_ok=True)
        shutil.copy2(profile / f"{s}.yaml", prod / s / "local" / "cxr_hfl" / f"{s}.yaml")
    r = subprocess.run([sys.executable, "-m", "nvflare_jobs.cli", "export-job", "--method", "local", "--profile",
                        str(profile), "--rounds", "1", "--local-epochs", "1", "--out", str(tmp_path / "jobs")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    job = tmp_path / "jobs" / "cxr_hfl_local"
    kit = str(prod / COORD)
    logs = []
    with network():
        for host in (SERVER, *sites):  # each participant starts its own kit on its own host
            log = open(tmp_path / f"{host}.log", "w")
            logs.append(log)
            subprocess.Popen(_on(host, ["bash", str(prod / host / "startup" / "sub_start.sh"), "--once"]),
                             stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                             start_new_session=True)
            if host == SERVER:
                time.sleep(10)
        deadline, r = time.time() + 240, None
        while time.time() < deadline:  # until both hospitals are connected (the submit's own check)
            r = _cli("coordinator", env, "submit", "--job", str(job), "--startup-kit", kit, timeout=300)
            if r.returncode == 0:
                break
            time.sleep(10)
        assert r is not None and r.returncode == 0, r.stderr + r.stdout + _tail(tmp_path)
        ids = [r.stdout.split("job id ")[1].split()[0]]
        r = _cli("coordinator", env, "submit", "--job", str(job), "--startup-kit", kit, timeout=300)
        assert r.returncode == 0, r.stderr + r.stdout
        ids.append(r.stdout.split("job id ")[1].split()[0])
        for j in ids:  # two jobs at once: each runs or is queued, and status says which
            r = _cli("coordinator", env, "status", j, "--startup-kit", kit, "--json", timeout=300)
            v = json.loads(r.stdout)
            assert v["job_state"].split(":")[0] in ("SUBMITTED", "DISPATCHED", "RUNNING", "FINISHED"), v
            assert v["schedule"] is None or v["schedule"] == "running" or \
                v["schedule"].startswith(("queued", "starting")), v
        for j in ids:
            r = _cli("coordinator", env, "results", j, "--startup-kit", kit, "--out", str(tmp_path / "runs" / j),
                     "--wait", "900", timeout=1000)
            assert r.returncode == 0, r.stderr + r.stdout + _tail(tmp_path)
            m = json.loads((tmp_path / "runs" / j / "metrics.json").read_text())
            assert m["job_status"] == "FINISHED:COMPLETED" and sorted(m["sites"]) == sites
            assert m["expected_sites"] == sites and m["not_deployed"] == {}
            r = _cli("coordinator", env, "status", j, "--startup-kit", kit, "--json", timeout=300)
            assert {s: d["state"] for s, d in json.loads(r.stdout)["sites"].items()} == dict.fromkeys(sites,
                                                                                                      "took part")
    for log in logs:
        log.close()


def _tail(tmp_path: Path) -> str:
    return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-12:])
                     for p in sorted(tmp_path.glob("*.log")))
