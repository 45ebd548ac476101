"""Per-hospital site configuration: schema, validation, and where a site finds its own file.

A site config is one YAML file named after the site (``<site>.yaml``); the file name is the site name, and the
same names are used by the simulator's clients, the job's deploy_map and provisioning. A hospital's operator edits
only this file. It is never shipped inside a job: each site looks it up locally, by its own site name, in

1. ``$CXR_HFL_SITE_CONFIG_DIR/<site>.yaml`` -- a folder the site is started with (the simulator and POC mode set
   it to a folder holding every simulated site's file; it is keyed by site name, not a per-site variable);
2. ``local/cxr_hfl/<site>.yaml`` in the site's workspace / startup kit (searched upwards from the working
   directory of the site process) -- the production place.

Example::

    data:
      manifest: /data/hospital-a/site.csv   # CSV with path,label,split[,patient_id,width,height]
      labels: binary                        # binary | subtype
    model: {family: cnn, depth: shallow, width: 1.0}
    input_size: 64
    batch_size: 16
    local_epochs: 2
    finetune_epochs: 2
    threads: 1
    share_predictions: true   # false: per-image test probabilities stay at the site (no pooled metrics)
"""
from __future__ import annotations

import os
from pathlib import Path

import yaml

ENV_DIR = "CXR_HFL_SITE_CONFIG_DIR"
LOCAL_SUBDIR = Path("local") / "cxr_hfl"

DEFAULTS = {
    "input_size": 64,
    "batch_size": 16,
    "local_epochs": 2,
    "finetune_epochs": 2,
    "lr": 0.01,
    "momentum": 0.9,
    "finetune_lr": 0.001,
    "class_weights": None,
    "balanced_sampling": False,  # true: class-balanced WeightedRandomSampler over the training split
    "fast_augment": False,  # true: training images as one cached tensor, flip + shift on tensors (no rotation)
    "augment_classes": "auto",
    "threads": 1,
    "seed": 0,
    "cache_dir": None,
    "max_train_images": None,
    # final `evaluate` task: send per-image test probabilities and labels (no images, no ids) to the server
    # for pooled metrics; false keeps them at the site (the server then reports per-site metrics only)
    "share_predictions": True,
}
TOP_KEYS = set(DEFAULTS) | {"site", "data", "model"}
DATA_KEYS = {"manifest", "labels"}


class SiteConfigError(ValueError):
    """A site's config is missing or invalid; the message names the site, the file and the key."""


def find_site_config(site: str, start: str | os.PathLike | None = None) -> Path:
    """Return the path of ``<site>.yaml`` for this site (lookup order in the module docstring).

    Raises:
        SiteConfigError: no config file in any of the places, naming each place searched.
    """
    tried = []
    env_dir = os.environ.get(ENV_DIR)
    if env_dir:
        p = Path(env_dir) / f"{site}.yaml"
        if p.is_file():
            return p
        tried.append(str(p))
    here = Path(start or os.getcwd()).resolve()
    for d in [here, *here.parents]:
        p = d / LOCAL_SUBDIR / f"{site}.yaml"
        if p.is_file():
            return p
        tried.append(str(p))
        if (d / "startup").is_dir():  # top of a site workspace / startup kit
            break
    raise SiteConfigError(f"site {site!r}: no site config found; looked in: {', '.join(tried[:4])}")


def _err(site, path, key, msg):
    return SiteConfigError(f"site {site!r}: config {path} key {key!r}: {msg}")


def validate_site_config(raw: dict, site: str, path: str | os.PathLike = "<memory>", check_files: bool = True) -> dict:
    """Validate a parsed site config and fill defaults.

    Args:
        raw: the parsed YAML mapping.
        site: the site name (the file stem); a ``site`` key, when present, must equal it.
        path: the file, for messages.
        check_files: check that the data manifest exists.

    Returns:
        dict with every key of ``DEFAULTS`` plus ``site``, ``data`` and ``model``.

    Raises:
        SiteConfigError: unknown keys, missing data/model, impossible sizes, missing files.
    """
    from hfl_components.models import validate_spec

    if not isinstance(raw, dict):
        raise _err(site, path, "<root>", "must be a YAML mapping")
    unknown = set(raw) - TOP_KEYS
    if unknown:
        raise _err(site, path, sorted(unknown)[0], f"unknown key (known: {sorted(TOP_KEYS)})")
    if raw.get("site", site) != site:
        raise _err(site, path, "site", f"says {raw['site']!r} but the file is for site {site!r}")
    cfg = dict(DEFAULTS)
    cfg.update(raw)
    cfg["site"] = site
    data = raw.get("data")
    if not isinstance(data, dict):
        raise _err(site, path, "data", "missing; needs data.manifest (a site CSV)")
    unknown = set(data) - DATA_KEYS
    if unknown:
        raise _err(site, path, f"data.{sorted(unknown)[0]}", f"unknown key (known: {sorted(DATA_KEYS)})")
    if "manifest" not in data:
        raise _err(site, path, "data.manifest", "missing")
    manifest = Path(str(data["manifest"])).expanduser()
    if not manifest.is_absolute():
        manifest = (Path(path).parent / manifest).resolve()
    if check_files and not manifest.is_file():
        raise _err(site, path, "data.manifest", f"file does not exist: {manifest}")
    labels = data.get("labels", "binary")
    if labels not in ("binary", "subtype"):
        raise _err(site, path, "data.labels", f"must be binary or subtype, got {labels!r}")
    cfg["data"] = {"manifest": str(manifest), "labels": labels}
    model = raw.get("model")
    if not isinstance(model, dict):
        raise _err(site, path, "model", "missing; e.g. {family: cnn, depth: shallow, width: 1.0}")
    model = dict(model)
    model.setdefault("in_channels", 1)
    model["num_classes"] = 3 if labels == "subtype" else 2
    try:
        validate_spec(model)
    except (ValueError, TypeError) as e:
        raise _err(site, path, "model", str(e)) from None
    cfg["model"] = model
    for key in ("input_size", "batch_size", "threads"):
        v = cfg[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise _err(site, path, key, f"must be a positive integer, got {v!r}")
    if not 16 <= cfg["input_size"] <= 1024:
        raise _err(site, path, "input_size", f"must be between 16 and 1024 px, got {cfg['input_size']}")
    for key in ("local_epochs", "finetune_epochs"):
        v = cfg[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise _err(site, path, key, f"must be a non-negative integer, got {v!r}")
    for key in ("lr", "finetune_lr", "momentum"):
        v = cfg[key]
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not (0 <= v < 10):
            raise _err(site, path, key, f"must be a number in [0, 10), got {v!r}")
    if not isinstance(cfg["share_predictions"], bool):
        raise _err(site, path, "share_predictions", f"must be true or false, got {cfg['share_predictions']!r}")
    for key in ("balanced_sampling", "fast_augment"):
        if not isinstance(cfg[key], bool):
            raise _err(site, path, key, f"must be true or false, got {cfg[key]!r}")
    if cfg["class_weights"] not in (None, "balanced"):
        raise _err(site, path, "class_weights", "must be null or 'balanced'")
    ac = cfg["augment_classes"]
    if not (ac in ("auto", None) or (isinstance(ac, list) and all(isinstance(c, int) for c in ac))):
        raise _err(site, path, "augment_classes", "must be 'auto', null or a list of class indices")
    return cfg


def load_site_config(site: str, path: str | os.PathLike | None = None, check_files: bool = True) -> dict:
    """Find (unless ``path`` is given), parse and validate a site's config. Raises SiteConfigError."""
    p = Path(path) if path else find_site_config(site)
    try:
        raw = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise SiteConfigError(f"site {site!r}: config {p} does not exist") from None
    except yaml.YAMLError as e:
        raise SiteConfigError(f"site {site!r}: config {p} is not valid YAML: {e}") from None
    cfg = validate_site_config(raw, site, p, check_files=check_files)
    cfg["config_path"] = str(p)
    return cfg


def load_profile(profile_dir: str | os.PathLike, check_files: bool = True) -> dict[str, dict]:
    """Load every ``<site>.yaml`` of a profile folder: {site: config}, sorted by site name.

    Raises:
        SiteConfigError: the folder has no site files, or one file is invalid.
    """
    d = Path(profile_dir)
    files = sorted(d.glob("*.yaml"))
    if not files:
        raise SiteConfigError(f"profile {d}: no <site>.yaml files found")
    return {f.stem: load_site_config(f.stem, f, check_files=check_files) for f in files}


def write_site_config(cfg: dict, path: str | os.PathLike) -> Path:
    """Write a site config as YAML (only schema keys)."""
    out = {k: v for k, v in cfg.items() if k in TOP_KEYS and k != "site"}
    if "model" in out:
        out["model"] = {k: v for k, v in out["model"].items() if k != "num_classes"}
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(yaml.safe_dump(out, sort_keys=False))
    return p
