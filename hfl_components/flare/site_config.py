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
    local_epochs: 20                      # omit for the method's default (hfl_components/flare/catalogue.py)
    finetune_epochs: 10
    threads: 1
    device: auto              # auto | cpu | cuda | cuda:N (auto = the first GPU when PyTorch sees one)
    amp: false                # mixed precision training (float16 on CUDA, bfloat16 on the CPU)
    share_predictions: false  # true: per-image test probabilities go to the server for pooled metrics

A coordinator's *profile* (the folder ``cxr-hfl export-job --profile`` reads) needs no ``data:`` section: only the
site names, model specs and input sizes are used (``require_data=False``); ``data: {labels: subtype}`` without a
manifest sets the label scheme there.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import yaml

ENV_DIR = "CXR_HFL_SITE_CONFIG_DIR"
LOCAL_SUBDIR = Path("local") / "cxr_hfl"
#: training augmentation implementations (site-config key ``augment``): the first is the default
#: ``border`` = monai plus random black / grey / white bands framing every class (chest_xray AUGMENT_BORDER);
#: ``border_dense`` = the same with most images framed, wider bands and any grey (chest_xray BORDER_PROFILES)
#: ``border_raw`` = the border_dense bands added to the decoded image before squaring and intensity scaling, where
#: the border probe adds its bands (chest_xray RAW_BORDER_PROFILES)
#: ``zoom_out`` = the border probe's own frame at a random share of each side (0-6 %), a centred zoom-out of the
#: film with its aspect kept, on the decoded image of every class (chest_xray AUGMENT_ZOOM_OUT)
AUGMENTS = ("monai", "batch", "border", "border_dense", "border_raw", "zoom_out")
#: the ``augment`` values that act per image in the MONAI pipeline: ``fast_augment: true`` (flip + shift on cached
#: tensors) would silently replace them, so the two are refused together
PER_IMAGE_AUGMENTS = ("monai", "border", "border_dense", "border_raw", "zoom_out")

DEFAULTS = {
    "input_size": 64,
    "batch_size": 16,
    # None: the running method's default (hfl_components.flare.catalogue, the simulator's values), resolved at the
    # site when a task arrives; a job's task_config (CLI --local-epochs ...) overrides both
    "local_epochs": None,
    "finetune_epochs": None,
    "lr": 0.01,
    "momentum": 0.9,
    # local training optimiser: sgd (momentum above; OHFL's), adam or adamw (Adam moments kept across rounds)
    "optimizer": "sgd",
    "weight_decay": 0.0,
    # which model a site deploys: last (the last round's) | best_val (the round whose site validation balanced
    # accuracy is best, ties -> the later round; round-based methods)
    "deploy": "last",
    # exponential moving average of the weights (and BatchNorm buffers) after every optimiser step; the site
    # evaluates and deploys the average, the method's uploads use the trained weights. null/0 = off
    "weight_ema": None,
    "lr_schedule": "constant",  # constant | cosine: lr x 0.5 (1 + cos(pi r / R)) in round r of R (round-based methods)
    "finetune_lr": 0.001,
    "class_weights": None,
    "balanced_sampling": False,  # true: class-balanced WeightedRandomSampler over the training split
    "fast_augment": False,  # true: training images as one cached tensor, flip + shift on tensors (no rotation)
    # training augmentation (flip p=0.5 + affine p=0.8, +-10 deg, +-6 % shift): batch = per collated batch on the
    # site's device (chest_xray.batch_augment) | monai = per image, MONAI RandFlipd + RandAffined
    "augment": "monai",  # the default the 3-seed comparisons measured; batch is opt-in (docs/decisions.md)
    "augment_classes": "all",  # every class (docs/decisions.md: minority-only augmentation is a label cue)
    "threads": 1,
    "seed": 0,
    "cache_dir": None,
    # a deployed model file (cxr-hfl predict's input): site check compares the site's images with its training
    # population (the file's population reference); null = no population check
    "deployed_model": None,
    # DICOM headers site check (and partition, --keep-for-processing / --skip-other-body-parts) judges: For
    # Processing images (the raw detector signal) are left out unless kept; an image whose header names another
    # body part than the chest is noted, or left out with skip_other_body_parts (the attribute is unreliable)
    "keep_for_processing": False,
    "skip_other_body_parts": False,
    # how a non-square image is made input_size x input_size: stretch (default) | letterbox | crop
    # (chest_xray.ASPECTS); every site of a job and the server's probe should use the same
    "aspect": "stretch",
    "max_train_images": None,
    # final `evaluate` task: send per-image test probabilities and labels (no images, no ids) to the server
    # for pooled metrics; false (the default) keeps them at the site (the server reports per-site metrics only).
    # Profiles written by `cxr-hfl simulate` / `compare` set it to true (simulated sites; pooled CIs).
    "share_predictions": False,
    "device": "auto",  # auto | cpu | cuda | cuda:N, for training and evaluation
    "amp": False,  # mixed precision training
    # differential privacy of local training (DP-SGD with Opacus, hfl_components.privacy): null = off, or
    # {epsilon: 8[, delta, max_grad_norm, accountant, losses, loss_clip, count_epsilon]} for the whole job's
    # training at this site; delta null = 1 / (10 x training images)
    "dp": None,
}
DEPLOY_RULES = ("last", "best_val")
TOP_KEYS = set(DEFAULTS) | {"site", "data", "model"}
DATA_KEYS = {"manifest", "labels"}


class _SiteYamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader that also reads ``1e-4`` / ``5E-3`` as numbers (YAML 1.2 floats; PyYAML's YAML 1.1
    rules need a dot, ``1.0e-4``, and would hand ``lr: 1e-3`` to validation as the text ``'1e-3'``), and refuses a
    key given twice in one mapping (YAML requires unique keys; PyYAML keeps the last silently, so an ``augment:``
    added above the template's own line would be dropped without a word).

    Raises:
        yaml.constructor.ConstructorError: the duplicate key, with the line of its second occurrence.
    """

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: set = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # "<<: *base": its keys may be overridden here
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    twice = key in seen
                    seen.add(key)
                except TypeError:  # an unhashable key: PyYAML's own construction refuses it below
                    continue
                if twice:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} is given twice (YAML keys must be unique; remove one)",
                        key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


_SiteYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


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


def _quoted_hint(v) -> str:
    """`` (quoted: a text, not a number; drop the quotes)`` when ``v`` is a string that reads as a number."""
    if isinstance(v, str):
        try:
            float(v)
        except ValueError:
            return ""
        return " (quoted: a text, not a number; drop the quotes)"
    return ""


def validate_site_config(raw: dict, site: str, path: str | os.PathLike = "<memory>", check_files: bool = True,
                         require_data: bool = True) -> dict:
    """Validate a parsed site config and fill defaults.

    Args:
        raw: the parsed YAML mapping.
        site: the site name (the file stem); a ``site`` key, when present, must equal it.
        path: the file, for messages.
        check_files: check that the data manifest exists.
        require_data: a ``data.manifest`` is required (False for a coordinator's export profile: then ``data`` may
            be absent, ``data.manifest`` is None and the labels default to ``binary``).

    Returns:
        dict with every key of ``DEFAULTS`` plus ``site``, ``data`` and ``model``.

    Raises:
        SiteConfigError: unknown keys, missing data/model, impossible sizes, missing files.
    """
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
    cfg["data"] = _data_section(raw, site, path, check_files, require_data)
    cfg["model"] = _model_section(raw, site, path, cfg["data"]["labels"])
    _check_training(cfg, site, path)
    _check_augmentation(cfg, raw, site, path)
    _check_dp(cfg, site, path)
    return cfg


def _check_dp(cfg: dict, site: str, path) -> None:
    """``dp``: null, or a mapping :class:`hfl_components.privacy.DPSpec` accepts (SiteConfigError naming the key);
    DP-SGD needs per-image gradients of plain float32 steps over Poisson batches, so ``amp`` and
    ``balanced_sampling`` are refused with it, and ``class_weights: balanced`` (from exact class counts). The mapping is kept as written (the site resolves delta from its
    image count)."""
    if cfg["dp"] is None:
        return
    from hfl_components.privacy.dp import DPSpec

    try:
        DPSpec.from_config(cfg["dp"], site, str(path))
    except ValueError as e:
        msg = str(e).removeprefix(f"site {site}: config {path} key dp: ")
        raise _err(site, path, "dp", msg) from None
    if cfg["class_weights"] is not None:
        raise _err(site, path, "class_weights", "cannot be combined with dp (balanced weights come from the exact "
                                                "training class counts, outside the DP-SGD accountant); set null")
    for key in ("amp", "balanced_sampling"):
        if cfg[key]:
            raise _err(site, path, key, f"cannot be combined with dp (DP-SGD samples Poisson batches and clips "
                                        f"per-image float32 gradients); set {key}: false or remove dp")
    cfg["dp"] = dict(cfg["dp"])


def _data_section(raw: dict, site: str, path, check_files: bool, require_data: bool) -> dict:
    """``{"manifest": absolute path or None, "labels": scheme}`` of a site config's ``data``."""
    from chest_xray.labels import DEFAULT_LABEL_SCHEME, LABEL_SCHEMES

    data = raw.get("data")
    if data is None and not require_data:
        data = {}
    if not isinstance(data, dict):
        raise _err(site, path, "data", "missing; needs data.manifest (a site CSV)")
    unknown = set(data) - DATA_KEYS
    if unknown:
        raise _err(site, path, f"data.{sorted(unknown)[0]}", f"unknown key (known: {sorted(DATA_KEYS)})")
    manifest = None
    if "manifest" in data and data["manifest"] is not None:
        manifest = Path(str(data["manifest"])).expanduser()
        if not manifest.is_absolute():
            manifest = (Path(path).parent / manifest).resolve()
        if check_files and not manifest.is_file():
            raise _err(site, path, "data.manifest", f"file does not exist: {manifest}")
    elif require_data:
        raise _err(site, path, "data.manifest", "missing")
    labels = data.get("labels", DEFAULT_LABEL_SCHEME)
    if labels not in LABEL_SCHEMES:
        raise _err(site, path, "data.labels", f"must be one of {', '.join(LABEL_SCHEMES)}, got {labels!r}")
    return {"manifest": None if manifest is None else str(manifest), "labels": labels}


def _model_section(raw: dict, site: str, path, labels: str) -> dict:
    """The checked model spec of a site config (``in_channels`` 1 by default, ``num_classes`` of the labels)."""
    from chest_xray.labels import num_classes
    from hfl_components.models import validate_spec

    model = raw.get("model")
    if not isinstance(model, dict):
        raise _err(site, path, "model", "missing; e.g. {family: cnn, depth: shallow, width: 1.0}")
    model = dict(model)
    model.setdefault("in_channels", 1)
    model["num_classes"] = num_classes(labels)
    try:
        validate_spec(model)
    except (ValueError, TypeError) as e:
        raise _err(site, path, "model", str(e)) from None
    from hfl_components.models.registry import FAMILY_TABLE

    if model.get("family") not in FAMILY_TABLE:  # a composite model (fens) is deployed, never trained by a site
        raise _err(site, path, "model", f"family {model.get('family')!r} is not a site model; choose one of "
                   f"{', '.join(sorted(FAMILY_TABLE))}")
    return model


def _check_training(cfg: dict, site: str, path) -> None:
    """Sizes, epochs, learning rates, optimiser, deploy rule, EMA, schedule, weight decay, switches, device, caps,
    seed and cache folder of a site config (SiteConfigError naming the key)."""
    from hfl_components.training.device import check_device_name

    for key in ("input_size", "batch_size", "threads"):
        v = cfg[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise _err(site, path, key, f"must be a positive integer, got {v!r}")
    if not 16 <= cfg["input_size"] <= 1024:
        raise _err(site, path, "input_size", f"must be between 16 and 1024 px, got {cfg['input_size']}")
    for key, lo in (("local_epochs", 1), ("finetune_epochs", 0)):  # every method trains a site in local epochs
        v = cfg[key]
        if v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise _err(site, path, key, f"must be an integer >= {lo}, got {v!r}"
                       + (" (a site must train at least one local epoch)" if key == "local_epochs" else ""))
    for key, hi in (("lr", 10), ("finetune_lr", 10), ("momentum", 1)):  # SGD momentum >= 1 never forgets: diverges
        v = cfg[key]
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not (0 <= v < hi):
            raise _err(site, path, key, f"must be a number in [0, {hi}), got {v!r}{_quoted_hint(v)}")
    if cfg["optimizer"] not in ("sgd", "adam", "adamw"):
        raise _err(site, path, "optimizer", f"must be sgd, adam or adamw, got {cfg['optimizer']!r}")
    if cfg["deploy"] not in DEPLOY_RULES:
        raise _err(site, path, "deploy", f"must be last or best_val, got {cfg['deploy']!r}")
    ema = cfg["weight_ema"]
    if ema is not None and (not isinstance(ema, (int, float)) or isinstance(ema, bool) or not 0 <= ema < 1):
        raise _err(site, path, "weight_ema", f"must be null or a number in [0, 1), got {ema!r}{_quoted_hint(ema)}")
    if cfg["lr_schedule"] not in ("constant", "cosine"):
        raise _err(site, path, "lr_schedule", f"must be constant or cosine, got {cfg['lr_schedule']!r}")
    wd = cfg["weight_decay"]
    if not isinstance(wd, (int, float)) or isinstance(wd, bool) or not 0 <= wd < 1:
        raise _err(site, path, "weight_decay", f"must be a number in [0, 1), got {wd!r}{_quoted_hint(wd)}")
    for key in ("share_predictions", "amp"):
        if not isinstance(cfg[key], bool):
            raise _err(site, path, key, f"must be true or false, got {cfg[key]!r}")
    try:
        cfg["device"] = check_device_name(cfg["device"])
    except ValueError as e:
        raise _err(site, path, "device", str(e)) from None
    if cfg["max_train_images"] is not None and (not isinstance(cfg["max_train_images"], int)
                                                or isinstance(cfg["max_train_images"], bool)
                                                or cfg["max_train_images"] < 1):
        raise _err(site, path, "max_train_images", f"must be null or a positive integer, got {cfg['max_train_images']!r}")
    if not isinstance(cfg["seed"], int) or isinstance(cfg["seed"], bool):
        raise _err(site, path, "seed", f"must be an integer, got {cfg['seed']!r}")
    if cfg["cache_dir"] is not None and not isinstance(cfg["cache_dir"], str):
        raise _err(site, path, "cache_dir", f"must be null or a folder path, got {cfg['cache_dir']!r}")
    if cfg["deployed_model"] is not None and not isinstance(cfg["deployed_model"], str):
        raise _err(site, path, "deployed_model", f"must be null or a model file path, got {cfg['deployed_model']!r}")


def _check_augmentation(cfg: dict, raw: dict, site: str, path) -> None:
    """Aspect, augmentation implementation and switches, and ``augment_classes`` (SiteConfigError naming the key)."""
    from chest_xray import ASPECTS

    if cfg["aspect"] not in ASPECTS:
        raise _err(site, path, "aspect", f"must be one of {', '.join(ASPECTS)}, got {cfg['aspect']!r}")
    if cfg["augment"] not in AUGMENTS:
        raise _err(site, path, "augment", f"must be one of {', '.join(AUGMENTS)}, got {cfg['augment']!r}")
    for key in ("balanced_sampling", "fast_augment", "keep_for_processing", "skip_other_body_parts"):
        if not isinstance(cfg[key], bool):
            raise _err(site, path, key, f"must be true or false, got {cfg[key]!r}")
    if cfg["fast_augment"] and raw.get("augment") in PER_IMAGE_AUGMENTS:  # the tensor path would silently win
        raise _err(site, path, "augment", f"{raw['augment']} has no effect with fast_augment: true (flip + shift "
                                          "on cached tensors); set fast_augment: false to augment per image with MONAI")
    if cfg["class_weights"] not in (None, "balanced"):
        raise _err(site, path, "class_weights", "must be null or 'balanced'")
    ac = cfg["augment_classes"]
    n_cls = int(cfg["model"]["num_classes"])
    if ac is None:  # None means every class in the code but meant none here once: refused rather than guessed
        raise _err(site, path, "augment_classes", "null is ambiguous: write 'all' for every class or [] for none")
    if not (ac in ("auto", "all")
            or (isinstance(ac, list) and all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c < n_cls
                                             for c in ac) and len(set(ac)) == len(ac))):
        raise _err(site, path, "augment_classes", f"must be 'auto', 'all', [] (none) or a list of distinct class "
                                                  f"indices 0..{n_cls - 1} ({cfg['data']['labels']} labels), got {ac!r}")


def load_site_config(site: str, path: str | os.PathLike | None = None, check_files: bool = True,
                     require_data: bool = True) -> dict:
    """Find (unless ``path`` is given), parse and validate a site's config. Raises SiteConfigError."""
    p = Path(path) if path else find_site_config(site)
    try:
        raw = yaml.load(p.read_text(), Loader=_SiteYamlLoader)  # noqa: S506 (a SafeLoader)
    except FileNotFoundError:
        raise SiteConfigError(f"site {site!r}: config {p} does not exist") from None
    except UnicodeDecodeError:
        raise SiteConfigError(f"site {site!r}: config {p} is not a text (UTF-8) YAML file") from None
    except yaml.YAMLError as e:
        mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = " ".join(str(problem or e).split())
        raise SiteConfigError(f"site {site!r}: config {p} is not valid YAML ({where}{what})") from None
    cfg = validate_site_config(raw, site, p, check_files=check_files, require_data=require_data)
    cfg["config_path"] = str(p)
    return cfg


def load_profile(profile_dir: str | os.PathLike, check_files: bool = True, require_data: bool = True,
                 ) -> dict[str, dict]:
    """Load every ``<site>.yaml`` of a profile folder: {site: config}, sorted by site name.

    Raises:
        SiteConfigError: the folder has no site files, or any file is invalid (the message lists every invalid
            file, one per line).
    """
    profile, errors = check_profile(profile_dir, check_files=check_files, require_data=require_data)
    if errors:
        raise SiteConfigError("\n".join(errors))
    return profile


def check_profile(profile_dir: str | os.PathLike, check_files: bool = True, require_data: bool = True,
                  ) -> tuple[dict[str, dict], list[str]]:
    """Load every ``<site>.yaml`` of a profile folder, collecting every error instead of stopping at the first.

    Returns:
        ``({site: config} of the valid files, [one message per invalid file])``; a folder without site files or
        that does not exist gives one message.
    """
    d = Path(profile_dir)
    if not d.is_dir():
        return {}, [f"profile {d}: no <site>.yaml files found (no such folder)"]
    files = sorted(d.glob("*.yaml"))
    if not files:
        return {}, [f"profile {d}: no <site>.yaml files found"]
    profile, errors = {}, []
    for f in files:
        try:
            profile[f.stem] = load_site_config(f.stem, f, check_files=check_files, require_data=require_data)
        except SiteConfigError as e:
            errors.append(str(e))
    labels = {c["data"]["labels"] for c in profile.values()}
    if len(labels) > 1:
        errors.append(f"profile {d}: sites disagree on data.labels ({sorted(labels)}); a job uses one label scheme")
    return profile, errors


SAMPLE = """\
# cxr-hfl site config for site {site}. Copy this file to {site}.yaml in this folder (local/cxr_hfl/ of your
# startup kit), edit it, then check it with:   cxr-hfl site check --config local/cxr_hfl/{site}.yaml
# It stays at your site: jobs never carry it, and no path in it is sent to the server.
data:
  manifest: /data/cxr/{site}.csv   # CSV: path,label,split[,patient_id,width,height] (cxr-hfl partition writes one)
  labels: binary                   # binary (NORMAL/PNEUMONIA) | subtype (NORMAL/BACTERIAL/VIRAL): as the consortium
model: {{family: cnn, depth: medium, width: 1.0}}   # as agreed with the coordinator (fedsaf/fedtopo: + feature_dim)
#                                  # cnn/vgg11 may add frame_mask: 0.08 (outer share of each side masked, as agreed)
input_size: 96                     # px; what your hardware affords (16..1024)
batch_size: 16
# device: auto                     # auto | cpu | cuda | cuda:N (auto = the first GPU when PyTorch sees one)
# amp: false                       # mixed precision training (float16 on CUDA, bfloat16 on CPU)
# threads: 1                       # CPU threads for training
# share_predictions: false         # true: per-image test probabilities go to the server for pooled metrics
# local_epochs: null               # null: the method's default (OHFL 20 + 10 fine-tuning, FedAvg/Local 2, FedSAF/
# finetune_epochs: null            # FedProto/FedTopo 1 a round); a job that sets them wins
# lr: 0.01                         # SGD learning rate / momentum of local training; OHFL fine-tuning lr
# momentum: 0.9
# optimizer: sgd                   # sgd | adam | adamw (local training; Adam moments persist across rounds)
# weight_decay: 0.0               # optimiser weight decay (AdamW: decoupled)
# lr_schedule: constant            # constant | cosine (decays lr over the job's rounds)
# weight_ema: null                 # e.g. 0.95: evaluate and deploy an EMA of the weights (off; measured worse)
# deploy: last                     # last | best_val (the round with the best validation balanced accuracy)
# finetune_lr: 0.001
# seed: 0
# max_train_images: null           # cap the training images (stratified by class), e.g. for a first trial
# class_weights: null              # null | balanced (inverse class frequency in the loss)
# augment_classes: all             # all (default) | auto (minority classes only: a label shortcut) | [] (none) | [0, 1]
# augment: monai                   # monai (per image) | batch (flip + affine per collated batch, faster) | border (monai + random bands) | border_dense (more, wider) | border_raw (border_dense bands in the file, before intensity scaling) | zoom_out (random centred zoom-out in the file, 0-12 %)
# fast_augment: false              # true: flip + shift on cached tensors instead (refused with augment: monai)
# balanced_sampling: false         # true: class-balanced sampling of the training split
# cache_dir: null                  # a folder: decoded images are cached on disk between jobs
# aspect: stretch                  # stretch | letterbox | crop: how non-square images become square (as the job's)
# deployed_model: null             # the deployed model file: site check compares your images with its training population
# keep_for_processing: false       # true: DICOM For Processing images (raw detector signal) may train; site check warns otherwise
# skip_other_body_parts: false     # true: site check warns about images whose header names another body part (else a note)
# dp: null                         # e.g. {{epsilon: 8}}: DP-SGD (Opacus) for the whole job's training here; optional
#                                  # delta (default 1/(10 x training images)), max_grad_norm (1.0); see docs/DEPLOYMENT.md
"""


def write_sample_config(folder: str | os.PathLike, site: str) -> Path:
    """Write the commented template ``<folder>/<site>.yaml.sample`` (what a provisioned kit ships in
    ``local/cxr_hfl/``). Returns the file."""
    p = Path(folder) / f"{site}.yaml.sample"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(SAMPLE.format(site=site))
    return p


def write_site_config(cfg: dict, path: str | os.PathLike) -> Path:
    """Write a site config as YAML (only schema keys)."""
    out = {k: v for k, v in cfg.items() if k in TOP_KEYS and k != "site"}
    if "model" in out:
        out["model"] = {k: v for k, v in out["model"].items() if k != "num_classes"}
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(yaml.safe_dump(out, sort_keys=False))
    return p
