"""Offline provisioning of the consortium's startup kits from a project.yml."""
from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from nvflare_jobs.deploy._env import DEFAULT_PROJECT, DeployError, nvflare_env, run_nvflare


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
    from nvflare_jobs.site_config import LOCAL_SUBDIR, write_sample_config

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
