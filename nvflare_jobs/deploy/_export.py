"""Portable job folders: only the site script travels; checks of an exported (or edited) job folder."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from hfl_components.flare import catalogue
from nvflare_jobs.deploy._env import SITE_SCRIPT_NAME, DeployError

SERVER_PACKAGE = "hfl_components.flare.controllers"


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


def not_a_job(method: str) -> str:
    """The one line that refuses to export or submit ``method``, a method that is no federated job (the pooled-data
    reference, :func:`hfl_components.flare.catalogue.deployable`)."""
    return (f"method {method!r} is the pooled-data reference (every site's training images in one place), not a "
            f"federated job: it runs only in the simulator, beside the methods it is the ceiling of, e.g. "
            f"cxr-hfl compare --methods {method},fedavg,ohfl")


def check_job_folder(job_folder: str | os.PathLike) -> dict:
    """Check an exported (or hand-edited) job folder before it is deployed: meta.json with a deploy_map, each
    app's config readable JSON, the site script inside each site app, no absolute script paths, and the server's
    workflow settings as the server will check them (:func:`check_server_app`). Returns meta.json.

    Raises:
        DeployError: naming the file and what is wrong.
    """
    folder = Path(job_folder)
    meta_p = folder / "meta.json"
    if not meta_p.is_file():
        raise DeployError(f"{folder}: no meta.json (not an exported NVFlare job)")
    meta = _json(meta_p)
    for cfg in sorted(folder.glob("app_*/config/config_fed_*.json")):
        _json(cfg)
    check_server_app(folder)
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


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise DeployError(f"{path}: not valid JSON ({e})") from None


def check_server_app(job_folder: str | os.PathLike) -> None:
    """Build each of this platform's server workflows of a job folder from its ``config_fed_server.json`` args and
    run its option check (``HFLController.check_options``), as the server does at job start; files the method
    reads on the server (the OHFL probe) are checked there, not here. A workflow of a method that is no federated
    job (the pooled-data reference ``central``, :func:`hfl_components.flare.catalogue.deployable`) is refused.

    Raises:
        DeployError: naming the config file, the workflow and the bad argument or option, or the method that is
            no federated job.
    """
    import importlib

    for cfg in sorted(Path(job_folder).glob("app_*/config/config_fed_server.json")):
        for wf in _json(cfg).get("workflows", []):
            path = str(wf.get("path") or wf.get("name") or "")
            if not path.startswith(SERVER_PACKAGE):
                continue
            mod, _, cls_name = path.rpartition(".")
            try:
                cls = getattr(importlib.import_module(mod), cls_name)
            except (ImportError, AttributeError):
                raise DeployError(f"{cfg}: workflow {path} is not in the installed cxr-hfl package") from None
            method = getattr(cls, "method", None)
            if method in catalogue.CATALOGUE and not catalogue.deployable(method):
                raise DeployError(f"{cfg}: workflow {cls_name}: {not_a_job(method)}")
            try:
                cls(**(wf.get("args") or {})).check_options()
            except (TypeError, ValueError) as e:
                raise DeployError(f"{cfg}: workflow {cls_name}: {e}") from None
