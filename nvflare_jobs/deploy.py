"""Real deployment: NVFlare provisioning, POC mode, job export/submission and result download.

Everything here drives NVFlare's own command line (``nvflare provision``, ``nvflare poc``, ``nvflare job``) as
subprocesses, with an environment that keeps NVFlare's state out of the user's home:

* ``NVFLARE_POC_WORKSPACE`` = ``<poc dir>/nvflare_poc`` (the POC participants' workspaces),
* ``HOME`` = ``<poc dir>/home`` (NVFlare keeps its startup-kit registry in ``~/.nvflare/config.conf``),
* ``PATH`` starts with this interpreter's ``bin`` folder (the POC start scripts run ``python3``, which must be the
  interpreter that has ``cxr-hfl`` and NVFlare installed),
* ``CXR_HFL_SITE_CONFIG_DIR`` removed, so POC sites find their config the production way:
  ``<site workspace>/local/cxr_hfl/<site>.yaml`` (see :mod:`hfl_components.flare.site_config`).

The POC consortium is provisioned from the same ``site_configs/project.yml`` as production (its coordinator admin
and role), with the hospitals renamed to the profile's site names, the server on localhost, and the one
``project_admin`` that ``nvflare poc`` requires. Jobs are submitted with the coordinator's startup kit, so a POC run
shows that the provisioned coordinator role may submit (and download) this platform's jobs.

State of a POC folder is kept in ``<poc dir>/cxr_hfl_poc.json``.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PROJECT = REPO / "site_configs" / "project.yml"
STATE_FILE = "cxr_hfl_poc.json"
POC_ADMIN = "poc-admin@cxr-consortium.example.org"  # nvflare poc needs exactly one project_admin; never used to submit
SERVER_PORTS = (8002, 8003)  # POC fed_learn and admin ports
SITE_SCRIPT_NAME = "site_script.py"


class DeployError(RuntimeError):
    """A provisioning / POC / submission step failed; the message says which and where its log is."""


# ------------------------------------------------------------------------------------------------ environment
def nvflare_exe() -> str:
    """The ``nvflare`` command of this interpreter's environment (else the first on PATH)."""
    cand = Path(sys.executable).parent / "nvflare"
    if cand.is_file():
        return str(cand)
    found = shutil.which("nvflare")
    if not found:
        raise DeployError("the nvflare command is not installed in this environment (pip install nvflare)")
    return found


def nvflare_env(poc_dir: str | os.PathLike | None = None, home: str | os.PathLike | None = None) -> dict:
    """Environment for NVFlare subprocesses (see the module docstring)."""
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.pop("CXR_HFL_SITE_CONFIG_DIR", None)
    env.pop("NVFL_WORKSPACE", None)
    env["PYTHONUNBUFFERED"] = "1"
    if poc_dir is not None:
        poc_dir = Path(poc_dir).resolve()
        env["NVFLARE_POC_WORKSPACE"] = str(poc_dir / "nvflare_poc")
        home = home or poc_dir / "home"
    if home is not None:
        Path(home).mkdir(parents=True, exist_ok=True)
        env["HOME"] = str(Path(home).resolve())
    return env


def run_nvflare(args: list[str], env: dict, *, timeout: float = 300, log: Path | None = None,
                json_out: bool = False, check: bool = True):
    """Run ``nvflare ARGS``; output goes to ``log`` (a file, so NVFlare's daemons never hold our pipe open).

    Returns the parsed JSON ``data`` when ``json_out`` (``nvflare --format json``), else the output text.
    Raises DeployError on a non-zero exit (when ``check``) or a timeout.
    """
    cmd = [nvflare_exe(), *(["--format", "json"] if json_out else []), *args]
    own_log = log is None
    if own_log:
        import tempfile

        fd, name = tempfile.mkstemp(prefix="nvflare_", suffix=".log")
        os.close(fd)
        log = Path(name)
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(log, "w") as f:
            try:
                rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    timeout=timeout, cwd=env.get("HOME")).returncode
            except subprocess.TimeoutExpired:
                raise DeployError(f"`nvflare {' '.join(args)}` timed out after {timeout:.0f} s (log: {log})") from None
        text = log.read_text(errors="replace")
    finally:
        if own_log:
            log.unlink(missing_ok=True)
    if check and rc != 0:
        raise DeployError(f"`nvflare {' '.join(args)}` failed (exit {rc}):\n{text[-3000:]}")
    if not json_out:
        return text
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                doc = json.loads(line)
            except json.JSONDecodeError:
                continue
            if check and doc.get("status") not in (None, "ok"):
                raise DeployError(f"`nvflare {' '.join(args)}`: {doc}")
            return doc.get("data", doc)
    raise DeployError(f"`nvflare {' '.join(args)}` printed no JSON result:\n{text[-3000:]}")


# ------------------------------------------------------------------------------------------------ provisioning
def load_project(path: str | os.PathLike | None = None) -> dict:
    """Parse and check a project.yml: api_version 3, one server, >= 1 client, >= 1 admin allowed to submit jobs."""
    p = Path(path or DEFAULT_PROJECT)
    try:
        proj = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise DeployError(f"project file {p} does not exist") from None
    if not isinstance(proj, dict) or proj.get("api_version") != 3:
        raise DeployError(f"project file {p}: needs api_version: 3")
    parts = proj.get("participants") or []
    for i, q in enumerate(parts):
        if not isinstance(q, dict) or not q.get("name") or q.get("type") not in ("server", "client", "admin", "relay"):
            raise DeployError(f"project file {p}: participants[{i}] needs a name and a type server|client|admin")
        if q["type"] in ("client", "admin", "server") and not q.get("org"):
            raise DeployError(f"project file {p}: participant {q['name']} has no org")
    if sum(q["type"] == "server" for q in parts) != 1:
        raise DeployError(f"project file {p}: needs exactly one server")
    if not any(q["type"] == "client" for q in parts):
        raise DeployError(f"project file {p}: needs at least one client (hospital)")
    if not submitters(proj):
        raise DeployError(f"project file {p}: needs an admin whose role may submit jobs (project_admin or lead)")
    return proj


def submitters(project: dict) -> list[dict]:
    """Admins whose role may submit jobs with custom code under NVFlare's default authorization policy."""
    return [q for q in project.get("participants", [])
            if q.get("type") == "admin" and q.get("role") in ("project_admin", "lead")]


def coordinator(project: dict) -> dict:
    """The admin who submits jobs: the first ``lead`` (least privilege), else the project_admin."""
    subs = submitters(project)
    leads = [q for q in subs if q["role"] == "lead"]
    return (leads or subs)[0]


def _latest_prod(root: Path, name: str) -> Path:
    prods = sorted((root / name).glob("prod_*"), key=lambda d: int(d.name.split("_")[-1]))
    if not prods:
        raise DeployError(f"no {root / name}/prod_* folder: provisioning wrote nothing")
    return prods[-1]


KIT_CERT = {"server": "server.crt", "client": "client.crt", "admin": "client.crt"}


def provision(project_file: str | os.PathLike | None, out: str | os.PathLike) -> dict:
    """Run ``nvflare provision`` offline into ``out``.

    Returns:
        ``{"project": name, "prod_dir": Path, "kits": [{"name", "type", "org", "role", "kit", "cert",
        "start"}...]}``; ``start`` is the one command that participant runs (servers and hospitals: their
        ``startup/start.sh``; the coordinator: nvflare job commands with ``--startup-kit``).
    """
    project_file = Path(project_file or DEFAULT_PROJECT).resolve()
    proj = load_project(project_file)
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = nvflare_env(home=out / ".home")
    run_nvflare(["provision", "-p", str(project_file), "-w", str(out), "--force"], env, timeout=300,
                log=out / "provision.log")
    prod = _latest_prod(out, proj["name"])
    kits = []
    from hfl_components.flare.site_config import LOCAL_SUBDIR, write_sample_config

    for q in proj["participants"]:
        if q["type"] == "server":
            allow_controllers(prod / q["name"])
        elif q["type"] == "client":  # the hospital writes local/cxr_hfl/<site>.yaml from this template
            write_sample_config(prod / q["name"] / LOCAL_SUBDIR, q["name"])
    for q in proj["participants"]:
        if q["type"] not in KIT_CERT:
            continue
        kit = prod / q["name"]
        cert = kit / "startup" / KIT_CERT[q["type"]]
        if q["type"] == "admin":
            start = f"nvflare job list --startup-kit {kit}"
        else:
            start = f"bash {kit}/startup/start.sh"
        kits.append({"name": q["name"], "type": q["type"], "org": q.get("org"), "role": q.get("role"),
                     "kit": kit, "cert": cert, "start": start})
    return {"project": proj["name"], "prod_dir": prod, "kits": kits}


# ------------------------------------------------------------------------------------------------ job export
def export_portable(job, out: str | os.PathLike) -> Path:
    """``job.export_job(out)``, then :func:`make_portable`. Returns the job folder (``out/<job name>``), ready for
    ``nvflare job submit -j``."""
    out = Path(out).resolve()
    job.export_job(str(out))
    folder = out / job.name
    make_portable(folder)
    return folder


def make_portable(job_folder: str | os.PathLike) -> None:
    """Make an exported job carry only what the platform decision allows: the site script.

    ``FedJob.export_job`` copies the site script *and* every repository module it imports into each app's
    ``custom/`` (under a layout that depends on ``sys.path`` at export time) and writes this machine's absolute
    script path. Copies in ``custom/`` shadow the reviewed, pinned ``cxr-hfl`` package installed at the site, so:

    * site apps keep exactly ``custom/site_script.py`` and ``task_script_path: "site_script.py"``;
    * the server app keeps no custom code: its controller comes from the installed package, which the server's
      ``local/resources.json`` allow-lists (``cxr-hfl provision`` and ``cxr-hfl poc prepare`` write it).
    """
    folder = Path(job_folder)
    for app in sorted(folder.glob("app_*")):
        custom = app / "custom"
        cfg = app / "config" / "config_fed_client.json"
        if not cfg.is_file():  # the server app
            if custom.is_dir() and (app / "config" / "config_fed_server.json").is_file():
                shutil.rmtree(custom)
            continue
        doc = json.loads(cfg.read_text())
        for ex in doc.get("executors", []):
            args = (ex.get("executor") or {}).get("args") or {}
            tsp = args.get("task_script_path")
            if not tsp:
                continue
            name = Path(tsp).name
            hits = sorted(custom.rglob(name), key=lambda q: len(q.parts)) if custom.is_dir() else []
            if not hits:
                raise DeployError(f"{cfg}: the site script {name} is not in the app's custom folder")
            script = hits[0].read_bytes()
            shutil.rmtree(custom)
            custom.mkdir()
            (custom / SITE_SCRIPT_NAME).write_bytes(script)
            args["task_script_path"] = SITE_SCRIPT_NAME
        cfg.write_text(json.dumps(doc, indent=4))


SERVER_ALLOW = "hfl_components.flare.controllers"


def allow_controllers(server_kit: str | os.PathLike) -> Path:
    """Write the server's ``local/resources.json``: NVFlare's default resources with this platform's controllers
    (from the installed ``cxr-hfl`` package) added to ``class_allow_list``. Returns the file."""
    local = Path(server_kit) / "local"
    dst = local / "resources.json"
    src = dst if dst.is_file() else local / "resources.json.default"
    doc = json.loads(src.read_text()) if src.is_file() else {"format_version": 2}
    if "class_allow_list" not in doc:
        from nvflare.app_common.default_component_policy import DEFAULT_CLASS_ALLOW_LIST

        doc["class_allow_list"] = list(DEFAULT_CLASS_ALLOW_LIST)
    if "*" not in doc["class_allow_list"] and SERVER_ALLOW not in doc["class_allow_list"]:
        doc["class_allow_list"].append(SERVER_ALLOW)
    dst.write_text(json.dumps(doc, indent=4))
    return dst


def check_job_folder(job_folder: str | os.PathLike) -> dict:
    """Check an exported job folder is self-contained: meta.json with a deploy_map, each app's config, the site
    script inside each site app, and no absolute script paths. Returns meta.json."""
    folder = Path(job_folder)
    meta_p = folder / "meta.json"
    if not meta_p.is_file():
        raise DeployError(f"{folder}: no meta.json (not an exported NVFlare job)")
    meta = json.loads(meta_p.read_text())
    for app, targets in meta.get("deploy_map", {}).items():
        if not (folder / app / "config").is_dir():
            raise DeployError(f"{folder}: deploy_map names {app} but {app}/config is missing")
        for cfg in (folder / app / "config").glob("config_fed_client.json"):
            for ex in json.loads(cfg.read_text()).get("executors", []):
                tsp = ((ex.get("executor") or {}).get("args") or {}).get("task_script_path")
                if tsp and os.path.isabs(tsp):
                    raise DeployError(f"{cfg}: task_script_path {tsp} is a path on the exporting machine")
                if tsp and not (folder / app / "custom" / tsp).is_file():
                    raise DeployError(f"{cfg}: the site script {tsp} is not in {app}/custom")
        extra = [q for q in (folder / app / "custom").rglob("*") if q.is_file() and q.name != SITE_SCRIPT_NAME
                 and not q.name.startswith(".")] if (folder / app / "custom").is_dir() else []
        if extra:
            raise DeployError(f"{folder}/{app}/custom ships {extra[0].name}: a job may ship only {SITE_SCRIPT_NAME} "
                              "(the sites run their installed cxr-hfl package)")
    return meta


# ------------------------------------------------------------------------------------------------ POC
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
        prod = _latest_prod(Path(self.env["NVFLARE_POC_WORKSPACE"]), poc_proj["name"])
        allow_controllers(prod / "server")
        from hfl_components.flare.site_config import LOCAL_SUBDIR, write_sample_config

        for site, cfg in profile.items():
            dst = prod / site / LOCAL_SUBDIR
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copy2(cfg["config_path"], dst / f"{site}.yaml")
            write_sample_config(dst, site)
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
        """The command that submits a job to this POC with NVFlare's own CLI (the coordinator's startup kit)."""
        return f"nvflare job submit -j <job_folder> --startup-kit {self.state()['admin_kit']}"

    def connected_sites(self) -> list[str]:
        """Names of the sites connected to the server now (``nvflare system status``)."""
        data = run_nvflare(["system", "status", *self._kit_args()], self.env, timeout=120,
                           log=self.logs / "system_status.log", json_out=True)
        return sorted(c.get("client_name") for c in (data or {}).get("clients", []) if c.get("client_name"))

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
        text = run_nvflare(["poc", "start", "--timeout", str(timeout)], self.env, timeout=timeout + 60,
                           log=self.logs / "poc_start.log")
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

    # jobs
    def _kit_args(self) -> list[str]:
        return ["--startup-kit", self.state()["admin_kit"]]

    def submit(self, job_folder: str | os.PathLike) -> str:
        """Submit an exported job folder with the coordinator's startup kit; returns the job id."""
        folder = Path(job_folder).resolve()
        meta = check_job_folder(folder)
        self.require_running()
        wanted = sorted({s for targets in meta.get("deploy_map", {}).values() for s in targets
                         if s != "server" and not str(s).startswith("@")})
        connected = self.connected_sites()
        missing = [s for s in wanted if s not in connected]
        if missing:
            raise DeployError(f"job {folder.name} is for sites {', '.join(wanted)}, but {', '.join(missing)} "
                              f"{'is' if len(missing) == 1 else 'are'} not connected to the server (connected: "
                              f"{', '.join(connected) or 'none'}); the job would wait and fail. Start those sites, "
                              "or export the job with a profile of the connected sites")
        data = run_nvflare(["job", "submit", "-j", str(folder), *self._kit_args()], self.env, timeout=300,
                           log=self.logs / "job_submit.log", json_out=True)
        job_id = data["job_id"]
        st = self.state()
        st["jobs"].append({"job_id": job_id, "folder": str(folder), "submitted": time.time()})
        self._save(st)
        return job_id

    def last_job(self) -> str:
        jobs = self.state().get("jobs") or []
        if not jobs:
            raise DeployError(f"no job was submitted from {self.dir}; pass a job id")
        return jobs[-1]["job_id"]

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

    def download(self, job_id: str, out: str | os.PathLike | None = None) -> tuple[Path, dict]:
        """Download the job's server workspace and assemble ``metrics.json`` / plots into ``out`` (default
        ``<poc dir>/runs/<job id>``), exactly as ``cxr-hfl simulate`` does. Returns (run dir, metrics)."""
        self.require_running()
        dl = self.dir / "downloads"
        data = run_nvflare(["job", "download", job_id, "-o", str(dl), "--force", *self._kit_args()], self.env,
                           timeout=300, log=self.logs / "job_download.log", json_out=True)
        path = Path(data.get("download_path") or dl / job_id)
        run_dir = Path(out).resolve() if out else self.dir / "runs" / job_id
        meta = {}
        try:
            meta = self.meta(job_id)
        except DeployError:
            pass
        metrics = assemble_downloaded(path, run_dir, labels_hint=self.state().get("labels"), job_meta=meta)
        return run_dir, metrics


def run_findings(metrics: dict) -> list[str]:
    """What a coordinator must see besides the metrics of a finished run: the sites left out (task, round,
    reason) and the sites whose deployed model predicts a single class for every test image."""
    out = []
    for site, events in (metrics.get("excluded_sites") or {}).items():
        for ev in events:
            out.append(f"site {site} left out of round {ev.get('round')} ({ev.get('task')}): {ev.get('reason')}")
    for site, b in (metrics.get("sites") or {}).items():
        cm = (b.get("test") or {}).get("confusion_matrix")
        if cm and sum(1 for col in zip(*cm) if sum(col) > 0) == 1:
            out.append(f"WARNING: {site}'s deployed model predicts a single class for every test image (confusion "
                       f"matrix {cm}); it has not learned a usable decision rule")
    return out


def _duration_s(meta: dict) -> float:
    d = str(meta.get("duration") or "")
    try:
        h, m, s = d.split(":")
        return int(h) * 3600 + int(m) * 60 + float(s)
    except ValueError:
        return 0.0


def assemble_downloaded(download_dir: str | os.PathLike, run_dir: str | os.PathLike, *, labels_hint: str | None = None,
                        job_meta: dict | None = None) -> dict:
    """Turn a downloaded job (``nvflare job download``) into the simulator's run layout via ``assemble_run``."""
    from chest_xray import CLASS_NAMES, scheme_for_num_classes
    from nvflare_jobs.results import assemble_run, find_server_results

    src = find_server_results(download_dir)
    rec = json.loads(src.read_text())
    ncls = {((s.get("model") or {}).get("num_classes")) for s in rec.get("sites", {}).values()} - {None}
    labels = rec.get("labels") or (scheme_for_num_classes(ncls.pop()) if len(ncls) == 1 else None)
    labels = labels or labels_hint or "binary"
    job_meta = job_meta or {}
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    seed = int((rec.get("task_config") or {}).get("seed", 0) or 0)
    return assemble_run(src, run_dir, labels=labels, seed=seed, wall_time_s=_duration_s(job_meta),
                        class_names=CLASS_NAMES[labels],
                        extra={"job_id": job_meta.get("job_id"), "job_status": job_meta.get("status"),
                               "submitter": job_meta.get("submitter_name"),
                               "submitter_role": job_meta.get("submitter_role"),
                               "downloaded_from": str(Path(download_dir).resolve())})
