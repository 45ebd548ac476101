"""What ``cxr-hfl provision`` and ``cxr-hfl poc prepare`` change in NVFlare's startup kits after ``nvflare
provision``: only files under each kit's ``local/`` (NVFlare verifies the signed ``startup/`` folder at start).

* Hospitals: ``local/resources.json`` with ``allow_log_streaming: false`` and NVFlare's ``SiteLogStreamer`` removed,
  so a site's job logs (which name image files and the manifest) never reach the server.
* Server: the platform's controllers allow-listed, the job store and snapshot store in a folder of the
  coordinator's choosing (never the system temp folder), a client heartbeat timeout and NVFlare's
  ``client_outcome_wait_timeout``, so a site that went away does not hold a finished job for NVFlare's defaults
  (600 s / 900 s).
* The CA material (``<out>/<project>/state/cert.json``: the root CA's private key and every participant's) and each
  ``*.key`` get mode 600, their folders 700.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

SERVER_ALLOW = "hfl_components.flare.controllers"
# NVFlare's server defaults are a 600 s client heartbeat timeout and a 900 s wait for every client's job outcome
# after the server side of a job ended; a site that disconnected kept a finished job RUNNING that long. A client
# sends a heartbeat every 10 s (NVFlare 2.9's client_train default, participation.CLIENT_HEARTBEAT_INTERVAL_S), so
# 180 s is many missed heartbeats; `submit` calls a site connected only when heard within 20 s.
HEARTBEAT_TIMEOUT_S = 180
CLIENT_OUTCOME_WAIT_S = 60
LOG_STREAMER = "nvflare.app_common.logging.site_log_streamer.SiteLogStreamer"


def _resources(kit: str | os.PathLike) -> tuple[Path, dict]:
    local = Path(kit) / "local"
    dst = local / "resources.json"
    src = dst if dst.is_file() else local / "resources.json.default"
    return dst, (json.loads(src.read_text()) if src.is_file() else {"format_version": 2})


def allow_controllers(server_kit: str | os.PathLike) -> Path:
    """Write the server's ``local/resources.json``: NVFlare's default resources with this platform's controllers
    (from the installed ``cxr-hfl`` package) added to ``class_allow_list``. Returns the file."""
    dst, doc = _resources(server_kit)
    if "class_allow_list" not in doc:
        from nvflare.app_common.default_component_policy import DEFAULT_CLASS_ALLOW_LIST

        doc["class_allow_list"] = list(DEFAULT_CLASS_ALLOW_LIST)
    if "*" not in doc["class_allow_list"] and SERVER_ALLOW not in doc["class_allow_list"]:
        doc["class_allow_list"].append(SERVER_ALLOW)
    dst.write_text(json.dumps(doc, indent=4))
    return dst


def configure_server_kit(server_kit: str | os.PathLike, store: str | os.PathLike, *,
                         heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
                         client_outcome_wait_s: float = CLIENT_OUTCOME_WAIT_S) -> Path:
    """Allow-list the controllers (:func:`allow_controllers`) and set, in the server kit's ``local/resources.json``:
    the job store (``<store>/jobs``) and snapshot store (``<store>/snapshots``), ``servers[0].heart_beat_timeout``
    (seconds) and ``client_outcome_wait_timeout`` (seconds).

    Args:
        store: absolute folder on the server machine (NVFlare's ``FilesystemStorage`` needs an absolute path; it
            creates it at start when the server account may).
    Raises:
        ValueError: ``store`` is not absolute, or a timeout is not positive.
    """
    if not os.path.isabs(str(store)):
        raise ValueError(f"the server's job store {store} must be an absolute path on the server machine")
    if heartbeat_timeout_s <= 0 or client_outcome_wait_s <= 0:
        raise ValueError("heartbeat and client-outcome timeouts must be positive seconds")
    dst = allow_controllers(server_kit)
    doc = json.loads(dst.read_text())
    store = str(store).rstrip("/") or "/"
    servers = doc.setdefault("servers", [{}])
    servers[0]["heart_beat_timeout"] = heartbeat_timeout_s
    doc["client_outcome_wait_timeout"] = client_outcome_wait_s
    snap = doc.setdefault("snapshot_persistor", {}).setdefault("args", {}).setdefault("storage", {})
    snap.setdefault("args", {})["root_dir"] = f"{store}/snapshots"
    for comp in doc.get("components", []):
        if comp.get("id") == "job_manager":
            comp.setdefault("args", {})["uri_root"] = f"{store}/jobs"
    dst.write_text(json.dumps(doc, indent=4))
    return dst


def server_store(server_kit: str | os.PathLike) -> dict:
    """The job store and snapshot folders a server kit is configured with (``{"jobs": .., "snapshots": ..}``)."""
    _, doc = _resources(server_kit)
    jobs = next((c.get("args", {}).get("uri_root") for c in doc.get("components", []) if c.get("id") == "job_manager"),
                None)
    snaps = (((doc.get("snapshot_persistor") or {}).get("args") or {}).get("storage") or {}).get("args", {})
    return {"jobs": jobs, "snapshots": snaps.get("root_dir")}


def no_log_streaming(client_kit: str | os.PathLike) -> Path:
    """Write a hospital kit's ``local/resources.json`` with ``allow_log_streaming: false`` and without NVFlare's
    ``SiteLogStreamer`` (which would send the job's ``error_log.txt`` to the server). Returns the file."""
    dst, doc = _resources(client_kit)
    doc["allow_log_streaming"] = False
    doc["components"] = [c for c in doc.get("components", []) if c.get("path") != LOG_STREAMER]
    dst.write_text(json.dumps(doc, indent=4))
    return dst


def protect_keys(root: str | os.PathLike) -> list[Path]:
    """Mode 600 for every private key (``*.key``) and the CA state (``state/cert.json``) under ``root``, 700 for
    the ``state`` folders. Returns the files changed."""
    changed = []
    for p in sorted(Path(root).rglob("*")):
        if p.is_file() and (p.suffix in (".key", ".pfx") or (p.name == "cert.json" and p.parent.name == "state")):
            os.chmod(p, stat.S_IRUSR | stat.S_IWUSR)
            changed.append(p)
        elif p.is_dir() and p.name == "state":
            os.chmod(p, stat.S_IRWXU)
    return changed


def make_private(root: str | os.PathLike) -> Path:
    """Create ``root`` if needed and make it and everything under it readable by its owner only: folders 700,
    files 600 (a job store holds every job's code and results). Returns ``root``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for p in [root, *root.rglob("*")]:
        if p.is_symlink():
            continue
        os.chmod(p, stat.S_IRWXU if p.is_dir() else stat.S_IRUSR | stat.S_IWUSR)
    return root
