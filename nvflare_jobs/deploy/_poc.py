"""A local POC consortium (``nvflare poc``) named after a profile, and job submission/download through it."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import time
from pathlib import Path

import yaml

from nvflare_jobs.deploy._env import POC_ADMIN, SERVER_PORTS, STATE_FILE, DeployError, nvflare_env, run_nvflare
from nvflare_jobs.deploy._connect import check_connected
from nvflare_jobs.deploy._export import check_job_folder
from nvflare_jobs.deploy._kits import configure_server_kit, make_private, no_log_streaming, protect_keys
from nvflare_jobs.deploy._provision import coordinator, latest_prod, load_project
from nvflare_jobs.deploy._results import assemble_downloaded


# ------------------------------------------------------------------------------------------------ POC
POC_HEARTBEAT_TIMEOUT_S = 30
POC_CLIENT_OUTCOME_WAIT_S = 15
PRIVATE_UMASK = 0o077  # the POC's processes create files 600 and folders 700 (job store, workspaces, logs)


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


class Poc:
    """One POC consortium in a folder of the user's choosing (``poc_dir``)."""

    def __init__(self, poc_dir: str | os.PathLike):
        self.dir = Path(poc_dir).expanduser().resolve()
        self.state_path = self.dir / STATE_FILE
        self.env = nvflare_env(self.dir)
        self.logs = self.dir / "logs"

    # state
    def state(self) -> dict:
        if not self.state_path.is_file():
            raise DeployError(f"{self.dir} is not a prepared POC folder (run `cxr-hfl poc prepare --workspace "
                              f"{self.dir} --profile DIR` first)")
        return json.loads(self.state_path.read_text())

    def _save(self, st: dict) -> None:
        self.state_path.write_text(json.dumps(st, indent=1, default=str))

    @property
    def prod_dir(self) -> Path:
        return Path(self.state()["prod_dir"])

    def site_workspace(self, site: str) -> Path:
        return self.prod_dir / site

    # prepare
    def prepare(self, profile_dir: str | os.PathLike, project_file: str | os.PathLike | None = None,
                site_check: bool = True, allow_site_errors: bool = False, report=None) -> dict:
        """Provision a local POC consortium whose hospitals are the profile's sites and copy each site's
        ``<site>.yaml`` into that site's ``local/cxr_hfl/`` (where a provisioned site looks).

        Before anything is provisioned, every site config is validated and (``site_check``) every site is checked
        as ``cxr-hfl site check`` does (its images read); ``report(site, result)`` receives each site's
        :func:`~nvflare_jobs.site_check.check_site` result.

        Raises:
            DeployError: listing every problem of every site at once (unless ``allow_site_errors``, which goes on
                with broken sites, e.g. to rehearse how a failing site is reported).
        """
        from nvflare_jobs.site_check import check_site
        from hfl_components.flare.site_config import check_profile

        profile_dir = Path(profile_dir).resolve()
        profile, problems = check_profile(profile_dir, check_files=False)
        if not profile:
            raise DeployError("cannot prepare the POC:\n  " + "\n  ".join(problems))
        if site_check:
            for site, cfg in profile.items():
                rep_ = check_site(cfg["config_path"], site)
                if report is not None:
                    report(site, rep_)
                problems += [f"site {site}: {e}" if not e.startswith(f"site {site!r}") else e
                             for e in rep_["errors"]]
        problems = list(dict.fromkeys(problems))
        if problems and not allow_site_errors:
            raise DeployError(f"{len(problems)} problem(s) in the profile {profile_dir}; fix them (or pass "
                              "--allow-site-errors to rehearse with broken sites):\n  " + "\n  ".join(problems))
        self.problems = problems
        proj = load_project(project_file)
        coord = coordinator(proj)
        orgs = [q["org"] for q in proj["participants"] if q["type"] == "client"]
        server = next(q for q in proj["participants"] if q["type"] == "server")
        parts = [{"name": "server", "type": "server", "org": server["org"], "fed_learn_port": SERVER_PORTS[0],
                  "admin_port": SERVER_PORTS[1], "default_host": "localhost"}]
        parts += [{"name": site, "type": "client", "org": orgs[i % len(orgs)]} for i, site in enumerate(profile)]
        parts += [{"name": coord["name"], "type": "admin", "org": coord["org"], "role": coord["role"]}]
        if coord["role"] != "project_admin":
            parts += [{"name": POC_ADMIN, "type": "admin", "org": server["org"], "role": "project_admin"}]
        poc_proj = {"api_version": 3, "name": proj["name"] + "_poc", "description": "POC of " + proj["name"],
                    "participants": parts, "builders": proj["builders"]}
        self.dir.mkdir(parents=True, exist_ok=True)
        proj_file = self.dir / "poc_project.yml"
        proj_file.write_text(yaml.safe_dump(poc_proj, sort_keys=False))
        if self.state_path.is_file() and self.is_running():
            raise DeployError(f"the POC in {self.dir} is running; `cxr-hfl poc stop --workspace {self.dir}` first")
        run_nvflare(["poc", "prepare", "-i", str(proj_file), "--force"], self.env, timeout=300,
                    log=self.logs / "poc_prepare.log")
        prod = latest_prod(Path(self.env["NVFLARE_POC_WORKSPACE"]), poc_proj["name"])
        # POC timeouts are short: every site runs on this machine, and a test kills sites on purpose
        configure_server_kit(prod / "server", self.dir / "store", heartbeat_timeout_s=POC_HEARTBEAT_TIMEOUT_S,
                             client_outcome_wait_s=POC_CLIENT_OUTCOME_WAIT_S)
        protect_keys(Path(self.env["NVFLARE_POC_WORKSPACE"]))
        from hfl_components.flare.site_config import LOCAL_SUBDIR, write_sample_config

        for site, cfg in profile.items():
            dst = prod / site / LOCAL_SUBDIR
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copy2(cfg["config_path"], dst / f"{site}.yaml")
            write_sample_config(dst, site)
            no_log_streaming(prod / site)
        labels = next(iter(profile.values()))["data"]["labels"]
        st = {"poc_dir": str(self.dir), "nvflare_poc_workspace": self.env["NVFLARE_POC_WORKSPACE"],
              "home": self.env["HOME"], "project": poc_proj["name"], "prod_dir": str(prod),
              "profile": str(profile_dir), "labels": labels, "sites": list(profile),
              "coordinator": coord["name"], "coordinator_role": coord["role"],
              "admin_kit": str(prod / coord["name"]), "jobs": []}
        self._save(st)
        return st

    # start / stop
    def is_running(self) -> bool:
        """True when any process of this POC is alive (server, sites, job workers)."""
        return bool(self.own_pids())

    def server_pid(self) -> int | None:
        """PID of this POC's server process (``nvflare ... server_train -m <prod>/server``), or None."""
        try:
            server = str(self.prod_dir / "server")
        except DeployError:
            return None
        for pid in self.own_pids():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            args = [c.decode(errors="replace") for c in cmd]
            if any(a.endswith("server_train") for a in args) and server in args:
                return pid
        return None

    def server_up(self) -> bool:
        """This POC's server process is alive and its admin port answers."""
        return self.server_pid() is not None and port_in_use(SERVER_PORTS[1])

    def require_running(self) -> None:
        """Raise a one-line DeployError unless this POC's server is up (so no raw nvflare error reaches the user)."""
        self.state()
        if not self.server_up():
            raise DeployError(f"the POC in {self.dir} is not running: {self.server_state()}")

    def server_state(self) -> str:
        """One line on this POC's server: up, restarting, or down (and what to do)."""
        if self.server_up():
            return "its server is up"
        if self.server_pid() is not None:
            return ("its server process is alive but does not answer on the admin port (starting or restarting "
                    "after a crash; try again in a minute)")
        left = self.own_pids()
        more = (f"; {len(left)} of its processes are still alive (`cxr-hfl poc stop --workspace {self.dir}` "
                "ends them)") if left else ""
        return f"its server is down{more}; start it with `cxr-hfl poc start --workspace {self.dir}`"

    def submit_hint(self) -> str:
        """The production command that submits a job with the coordinator's startup kit (``cxr-hfl submit``: the
        same checks as ``poc submit``)."""
        return f"cxr-hfl submit --job <job_folder> --startup-kit {self.state()['admin_kit']}"

    def heard(self) -> dict[str, float | None]:
        """{site: seconds since the server last heard from it} of the sites the server lists (``nvflare system
        status server``; ``participation.heard_from_status``). A stopped site stays listed until its heartbeat
        times out; ``participation.unreachable`` tells the live ones."""
        from hfl_components.flare.participation import heard_from_status

        data = run_nvflare(["system", "status", "server", *self._kit_args()], self.env, timeout=120,
                           log=self.logs / "system_status.log", json_out=True)
        return heard_from_status(data if isinstance(data, dict) else {}, time.time())

    def connected_sites(self) -> list[str]:
        """Names of the sites connected to the server now: listed, and heard within twice the heartbeat
        interval (``participation.CONNECTED_WITHIN_S``)."""
        from hfl_components.flare.participation import unreachable

        heard = self.heard()
        return sorted(s for s in heard if s not in unreachable([s], heard))

    def own_pids(self) -> list[int]:
        """PIDs of processes whose command line names this POC's workspace (server, sites, job workers, daemons)."""
        try:
            prod = str(self.prod_dir)
        except DeployError:
            return []
        pids = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if prod in cmd:
                pids.append(int(d.name))
        return sorted(pids)

    def start(self, timeout: int = 120) -> str:
        st = self.state()
        if self.server_up():
            raise DeployError(f"this POC ({self.dir}) is already running; `cxr-hfl poc stop --workspace {self.dir}` "
                              "first to restart it")
        busy = [p for p in SERVER_PORTS if port_in_use(p)]
        if busy:
            raise DeployError(f"port(s) {busy} already in use by another NVFlare server/POC on this machine (not "
                              f"the one in {self.dir}); stop it first")
        for sub in ("jobs", "snapshots"):
            (self.dir / "store" / sub).mkdir(parents=True, exist_ok=True)
        make_private(self.dir / "store")  # the job store: owner only (umask 077 for what the server adds)
        try:
            text = run_nvflare(["poc", "start", "--timeout", str(timeout)], self.env, timeout=timeout + 60,
                               log=self.logs / "poc_start.log", umask=PRIVATE_UMASK)
        except (KeyboardInterrupt, DeployError):
            # NVFlare's start scripts daemonise the server and sites (they are not our child processes): end
            # every process of this POC, by PID, before reporting the interrupt or the failure
            self.stop()
            raise
        st["started"] = time.time()
        self._save(st)
        return text

    def stop(self, timeout: float = 60) -> list[int]:
        """``nvflare poc stop``, then end any of this POC's processes still alive (TERM, then KILL) and wait for
        the server ports to close. Returns the PIDs that had to be killed."""
        try:
            run_nvflare(["poc", "stop"], self.env, timeout=timeout, log=self.logs / "poc_stop.log", check=False)
        except DeployError:
            pass
        killed = []
        deadline = time.time() + 15
        while time.time() < deadline and self.own_pids():
            time.sleep(1)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            left = self.own_pids()
            for pid in left:
                try:
                    os.kill(pid, sig)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
            t_end = time.time() + 10
            while left and time.time() < t_end and self.own_pids():
                time.sleep(0.5)
        t_end = time.time() + 20
        while time.time() < t_end and any(port_in_use(p) for p in SERVER_PORTS):
            time.sleep(0.5)
        return sorted(set(killed))

    def end_now(self) -> list[int]:
        """After an interrupted :meth:`stop`: SIGTERM every process of this POC at once (the start scripts' restart
        loops included), a short wait, SIGKILL what is left. Returns the PIDs still alive after that (honest
        reporting: ``poc stop`` must never claim all stopped while some run)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in self.own_pids():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            t_end = time.time() + 3
            while self.own_pids() and time.time() < t_end:
                time.sleep(0.2)
        return self.own_pids()

    # jobs
    def _kit_args(self) -> list[str]:
        return ["--startup-kit", self.state()["admin_kit"]]

    def submit(self, job_folder: str | os.PathLike, allow_missing: bool = False) -> str:
        """Submit an exported job folder with the coordinator's startup kit; returns the job id. First every site
        the job expects must be connected (:func:`~nvflare_jobs.deploy._connect.check_connected`); with
        ``allow_missing`` its warning lines go to ``self.warnings`` and the job is submitted.

        Raises:
            DeployError: a bad job folder, the POC not running, or an expected site not connected (unless
                ``allow_missing``).
        """
        folder = Path(job_folder).resolve()
        meta = check_job_folder(folder)
        self.require_running()
        self.warnings = check_connected(folder.name, meta, self.heard(), allow_missing)
        data = run_nvflare(["job", "submit", "-j", str(folder), *self._kit_args()], self.env, timeout=300,
                           log=self.logs / "job_submit.log", json_out=True)
        job_id = data["job_id"]
        st = self.state()
        st["jobs"].append({"job_id": job_id, "folder": str(folder), "submitted": time.time()})
        self._save(st)
        return job_id

    def last_job(self) -> str:
        """The job last submitted from this POC folder, else the newest job on the server (one submitted with
        ``cxr-hfl submit`` or NVFlare's own CLI). Raises DeployError when there is none."""
        jobs = self.state().get("jobs") or []
        if jobs:
            return jobs[-1]["job_id"]
        listed = [j for j in (self.list_jobs() if self.server_up() else []) if isinstance(j, dict) and j.get("job_id")]
        if not listed:
            raise DeployError(f"no job was submitted to the POC in {self.dir}; pass a job id")
        newest = max(enumerate(listed), key=lambda ij: (str(ij[1].get("submit_time_iso") or ij[1].get("submit_time")
                                                             or ""), ij[0]))
        return newest[1]["job_id"]

    def abort(self, job_id: str) -> str:
        """Abort a job (``nvflare job abort``, the coordinator's kit): a running job stops, a queued one is never
        scheduled. Returns NVFlare's answer as text."""
        self.require_running()
        data = run_nvflare(["job", "abort", job_id, "--force", *self._kit_args()], self.env, timeout=120,
                           log=self.logs / "job_abort.log", json_out=True)
        return str(data.get("message") or data) if isinstance(data, dict) else str(data)

    def wait(self, job_id: str, timeout: int = 600) -> dict:
        self.require_running()
        data = run_nvflare(["job", "wait", job_id, "--timeout", str(timeout), *self._kit_args()], self.env,
                           timeout=timeout + 60, log=self.logs / "job_wait.log", json_out=True, check=False)
        return data

    def meta(self, job_id: str) -> dict:
        self.require_running()
        return run_nvflare(["job", "meta", job_id, *self._kit_args()], self.env, timeout=120,
                           log=self.logs / "job_meta.log", json_out=True)

    def list_jobs(self) -> list:
        self.require_running()
        data = run_nvflare(["job", "list", *self._kit_args()], self.env, timeout=120,
                           log=self.logs / "job_list.log", json_out=True)
        return data.get("jobs", data) if isinstance(data, dict) else data

    def download_raw(self, job_id: str) -> tuple[Path, dict]:
        """``nvflare job download`` into ``<poc dir>/downloads``; returns (the job's folder, its meta or {})."""
        self.require_running()
        dl = self.dir / "downloads"
        data = run_nvflare(["job", "download", job_id, "-o", str(dl), "--force", *self._kit_args()], self.env,
                           timeout=300, log=self.logs / "job_download.log", json_out=True)
        path = Path(data.get("download_path") or dl / job_id)
        meta = {}
        try:
            meta = self.meta(job_id)
        except DeployError:
            pass
        return path, meta

    def assemble(self, job_id: str, path: Path, out=None, meta: dict | None = None) -> tuple[Path, dict]:
        """Write a downloaded job's run folder (default ``<poc dir>/runs/<job id>``). Returns (run dir, metrics)."""
        run_dir = Path(out).resolve() if out else self.dir / "runs" / job_id
        metrics = assemble_downloaded(path, run_dir, labels_hint=self.state().get("labels"), job_meta=meta or {})
        metrics["run_dir"] = str(run_dir)
        return run_dir, metrics

    def download(self, job_id: str, out: str | os.PathLike | None = None) -> tuple[Path, dict]:
        """Download the job's server workspace and assemble ``metrics.json`` / plots into ``out`` (default
        ``<poc dir>/runs/<job id>``), exactly as ``cxr-hfl simulate`` does. Returns (run dir, metrics)."""
        path, meta = self.download_raw(job_id)
        return self.assemble(job_id, path, out, meta)
