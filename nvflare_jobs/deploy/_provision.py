"""Offline provisioning of the consortium's startup kits from a project.yml."""
from __future__ import annotations

import os
from pathlib import Path

import yaml

from nvflare_jobs.deploy._env import DEFAULT_PROJECT, DeployError, nvflare_env, run_nvflare
from nvflare_jobs.deploy._kits import configure_server_kit, no_log_streaming, protect_keys


# ------------------------------------------------------------------------------------------------ provisioning
def load_project(path: str | os.PathLike | None = None) -> dict:
    """Parse and check a project.yml: api_version 3, one server, >= 1 client, >= 1 admin allowed to submit jobs.

    Raises:
        DeployError: one line naming the file: missing, not YAML, or not such a project.
    """
    p = Path(path or DEFAULT_PROJECT)
    try:
        proj = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise DeployError(f"project file {p} does not exist") from None
    except IsADirectoryError:
        raise DeployError(f"project file {p} is a folder; give its project.yml") from None
    except UnicodeDecodeError:
        raise DeployError(f"project file {p} is not a text (UTF-8) YAML file") from None
    except yaml.YAMLError as e:  # one line, as a site config's (hfl_components.flare.site_config)
        mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise DeployError(f"project file {p} is not valid YAML ({where}{' '.join(str(problem or e).split())})") \
            from None
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


def latest_prod(root: Path, name: str) -> Path:
    """The newest ``<root>/<name>/prod_N`` folder ``nvflare provision`` wrote. Raises DeployError when none."""
    prods = sorted((root / name).glob("prod_*"), key=lambda d: int(d.name.split("_")[-1]))
    if not prods:
        raise DeployError(f"no {root / name}/prod_* folder: provisioning wrote nothing")
    return prods[-1]


KIT_CERT = {"server": "server.crt", "client": "client.crt", "admin": "client.crt"}


DEFAULT_STORE = "/var/lib/cxr-hfl"


def provision(project_file: str | os.PathLike | None, out: str | os.PathLike,
              job_store: str | os.PathLike | None = None) -> dict:
    """Run ``nvflare provision`` offline into ``out``, then set up each kit's ``local/`` (``nvflare_jobs.deploy._kits``):
    hospitals without log streaming, the server's job store in ``job_store`` (an absolute folder on the server
    machine; default ``/var/lib/cxr-hfl/<project>``) with short client timeouts, and every private key and the CA
    state (``out/<project>/state/``) readable by their owner only.

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
    prod = latest_prod(out, proj["name"])
    kits = []
    from hfl_components.flare.site_config import LOCAL_SUBDIR, write_sample_config

    for q in proj["participants"]:
        if q["type"] == "server":
            store = job_store or f"{DEFAULT_STORE}/{proj['name']}"
            try:
                configure_server_kit(prod / q["name"], store)
            except ValueError as e:
                raise DeployError(f"--job-store: {e}") from None
        elif q["type"] == "client":  # the hospital writes local/cxr_hfl/<site>.yaml from this template
            write_sample_config(prod / q["name"] / LOCAL_SUBDIR, q["name"])
            no_log_streaming(prod / q["name"])
    protect_keys(out / proj["name"])
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
    return {"project": proj["name"], "prod_dir": prod, "kits": kits, "state_dir": out / proj["name"] / "state",
            "job_store": store}
