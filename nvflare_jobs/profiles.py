"""Data discovery, partitioning and site-config profiles for simulated federations."""
from __future__ import annotations

import os
from pathlib import Path

from hfl_components.flare.catalogue import is_prototype, prototype_methods
from hfl_components.flare.catalogue import method_defaults as _method_defaults
from hfl_components.flare.site_config import write_site_config

DEPTHS = ("shallow", "medium", "deep")
HETERO_FAMILIES = ("hetero_cnn", "densenet", "resnet", "efficientnet")
# Prototype methods' default backbones: the pool's families, the two slowest made smaller so that one
# epoch of 6 sites on ~850 training images at 64 px costs a few CPU seconds. EfficientNet's BatchNorm momentum is
# PyTorch's 0.1 instead of MONAI's 0.01: with 0.01 its eval-mode predictions stayed one class (docs/decisions.md).
PROTO_BACKBONES = {
    "densenet": {"block_config": [2, 2, 2]},
    "efficientnet": {"blocks": ["r1_k3_s11_e1_i32_o16_se0.25", "r1_k3_s22_e4_i16_o24_se0.25",
                                "r1_k3_s22_e4_i24_o40_se0.25"], "bn_momentum": 0.1},
}
# Prototype methods' default site training, chosen on the sites' validation splits by
# studies/proto_tuning/tune_proto.py (results in studies/proto_tuning/RESULTS.md); never on test or evaluation images.
# augment_classes "all": with "auto" only the minority classes were flipped / shifted, so at a label-skewed site a
# flipped or black-bordered image was a minority-class image (a label shortcut; docs/decisions.md).
PROTO_TRAINING = {"input_size": 64, "lr": 0.001, "optimizer": "adam", "lr_schedule": "cosine",
                  "balanced_sampling": True, "class_weights": None, "fast_augment": True, "deploy": "best_val",
                  "augment_classes": "all"}
# Prototype methods' site splits: every class a site holds >= 4 x 2 images of gets >= 2 images in val and
# in test (chest_xray.partition_records(min_eval_per_class=...); patients whole, train keeps >= half of the class).
# With the 80/10/10 cut alone a class of 8-20 images at a site often had 0-1 validation / test images, so neither the
# validation model selection (deploy: best_val) nor the single-class check of the test split could see it.
PROTO_MIN_EVAL_PER_CLASS = 2
# federated rounds and local epochs per round of the prototype methods (and of Local when compared with them): the
# one source is the method catalogue
PROTO_ROUNDS = _method_defaults(prototype_methods()[0])["rounds"]
PROTO_LOCAL_EPOCHS = _method_defaults(prototype_methods()[0])["local_epochs"]

NO_DATA_HELP = """no chest X-ray data found.
Looked at --data, then $CXR_DATA, then ../shared/data (beside the repository).
Get the Kermany chest X-ray set (Kaggle "Chest X-Ray Images (Pneumonia)", CC BY 4.0,
doi:10.17632/rscbjbr9sj.2) and point --data at a folder in the Kaggle layout:
    DATA/train/NORMAL/*.jpeg  DATA/train/PNEUMONIA/person*_bacteria_*.jpeg ...
(also accepted: DATA/NORMAL, DATA/PNEUMONIA class folders, or a CSV with path,label columns).
Generated images are never substituted for real data."""


class DataNotFoundError(FileNotFoundError):
    pass


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def resolve_data(arg: str | None) -> Path:
    """The data root: ``--data``, then ``$CXR_DATA``, then ``../shared/data``; the shared folder resolves to its
    ``chest_xray_original`` (the resolution-heterogeneous set). Raises DataNotFoundError with instructions."""
    candidates = []
    if arg:
        p = Path(arg).expanduser()
        if not p.exists():
            raise DataNotFoundError(f"--data {arg}: no such file or folder.\n" + NO_DATA_HELP)
        candidates.append(p)
    else:
        if os.environ.get("CXR_DATA"):
            candidates.append(Path(os.environ["CXR_DATA"]).expanduser())
        candidates += [Path.cwd() / ".." / "shared" / "data", repo_root().parent / "shared" / "data"]
    for p in candidates:
        if p.exists():
            if (p / "chest_xray_original").is_dir():
                p = p / "chest_xray_original"
            return p.resolve()
    raise DataNotFoundError(NO_DATA_HELP)


def proto_training_data(out_csv: Path) -> Path | None:
    """Default data set of the prototype methods: the ``tuning`` + ``probe`` parts of the shared
    ``chest_xray_224`` pool (1,055 images, 3 subtypes) written as one manifest CSV at ``out_csv``.

    Their heterogeneity is the model's, not the resolution's, so they do not need ``chest_xray_original`` (~100
    training images a site, too few to learn bacterial vs viral pneumonia); the committed ``evaluation`` part of
    the same pool (1,715 images, patient-disjoint) is never trained on and serves as the external test set.
    Returns None (callers fall back to :func:`resolve_data`) when no ``chest_xray_224`` is found beside the data
    root of :func:`resolve_data` (``$CXR_DATA``, ``../shared/data``).
    """
    from chest_xray.splits import TRAINING_PARTS, write_pool_csv

    pool = proto_pool_root()
    return write_pool_csv(TRAINING_PARTS, pool, out_csv) if pool else None


def proto_pool_root() -> Path | None:
    """The ``chest_xray_224`` folder :func:`proto_training_data` reads (beside or under the data root of
    :func:`resolve_data`), or None when there is none; writes nothing."""
    try:
        root = resolve_data(None)
    except DataNotFoundError:
        return None
    return next((c for c in (root.parent / "chest_xray_224", root / "chest_xray_224") if c.is_dir()), None)


def default_probe(data_root: Path, partition_dir: Path | None = None) -> str | None:
    """A public probe pool for OHFL's CKA: the reserved probe.csv of the partition if any, else the
    patient-disjoint sibling ``chest_xray_224`` when the sites come from ``chest_xray_original``."""
    if partition_dir and (partition_dir / "probe.csv").is_file():
        return str(partition_dir / "probe.csv")
    sib = data_root.parent / "chest_xray_224"
    if data_root.name == "chest_xray_original" and sib.is_dir():
        return str(sib)
    return None


def parse_families(text: str | list | None, n_sites: int) -> list[str] | None:
    """``--families`` (comma-separated, one per site in site-name order) as a list; None when not given.

    Raises:
        ValueError: an empty list, a count other than ``n_sites``, an empty name or a family the model registry
        does not know.
    """
    if text is None:
        return None
    fams = [f.strip() for f in (text.split(",") if isinstance(text, str) else text)]
    if not any(fams):  # "" would otherwise mean the default (cnn everywhere) without a word
        raise ValueError(f"--families is empty; give one model family per site ({n_sites} sites), comma-separated, "
                         "or leave the option out for cnn at every site")
    empty = [i + 1 for i, f in enumerate(fams) if not f]
    if empty:
        raise ValueError(f"--families {','.join(fams)}: empty family name at position {empty[0]}")
    if len(fams) != n_sites:
        raise ValueError(f"--families needs one family per site ({n_sites} sites), got {len(fams)}: {','.join(fams)}")
    from hfl_components.models.registry import FAMILY_TABLE

    unknown = [f for f in fams if f not in FAMILY_TABLE]
    if unknown:
        raise ValueError(f"--families: unknown model family {unknown[0]!r}; known: {', '.join(sorted(FAMILY_TABLE))}")
    return fams


def site_options_problem(args) -> str | None:
    """What is wrong with the options that describe simulated sites (``sites``, ``scheme``, ``alpha``, ``families``,
    ``profile`` of a ``cxr-hfl simulate`` / ``partition`` namespace), checked before anything is scanned or written:
    one line naming the option (``--sites`` < 1, ``--min-sites`` > ``--sites``, ``--alpha`` <= 0 for the dirichlet
    scheme, a bad ``--families``, see :func:`parse_families`, or one that would be ignored: with a profile or a
    prototype ``method``), or None.
    """
    if args.sites < 1:
        return f"--sites must be at least 1, got {args.sites}"
    if why := _input_sizes_problem(getattr(args, "input_sizes", None)):
        return why
    ms = getattr(args, "min_sites", None)
    if ms is not None and not getattr(args, "profile", None) and ms > args.sites:
        return f"--min-sites {ms}: more than the {args.sites} sites (--sites); no round could proceed"
    fams = getattr(args, "families", None)
    if fams is not None and not fams.strip(", "):
        return _families_problem(fams, args.sites)
    if getattr(args, "profile", None):
        return ("--families: with --profile each site config's model: decides the family; set it there"
                if fams is not None else None)
    if fams is not None and is_prototype(getattr(args, "method", None) or ""):
        return (f"--families: {args.method} is a prototype method; its sites train the heterogeneous backbone "
                f"pool (--families is for {', '.join(family_methods())})")
    if args.scheme == "dirichlet" and not args.alpha > 0:
        return f"--alpha must be > 0 for --scheme dirichlet, got {args.alpha}"
    if args.scheme == "dirichlet" and args.alpha == float("inf"):
        return "--alpha must be a finite number for --scheme dirichlet, got inf"
    return _families_problem(fams, args.sites)


def _input_sizes_problem(sizes) -> str | None:
    """One line when ``--input-sizes`` (a list, or comma-separated text as `cxr-hfl compare` passes it on) is not
    in increasing order (sites are assigned sizes smallest to largest by image width), else None."""
    if sizes is None:
        return None
    text = sizes if isinstance(sizes, str) else ",".join(map(str, sizes))
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        return f"--input-sizes {text}: expected comma-separated integers"
    if any(b <= a for a, b in zip(values, values[1:])):
        return (f"--input-sizes {text}: give them smallest to largest, each once (e.g. "
                f"{','.join(map(str, sorted(set(values))))}); sites are assigned sizes in that order by image width")
    return None


def _families_problem(text, n_sites: int) -> str | None:
    """:func:`parse_families`' error as one line, or None when ``text`` is fine."""
    try:
        parse_families(text, n_sites)
    except ValueError as e:
        return str(e)
    return None


def family_methods() -> tuple[str, ...]:
    """The methods whose sites take ``--families`` (every catalogue method that is not a prototype method; those
    train the heterogeneous backbone pool)."""
    from hfl_components.flare.catalogue import methods

    return tuple(m for m in methods() if not is_prototype(m))


def assign_models(sites: list[str], method: str, input_sizes: list[int], num_classes: int,
                  feature_dim: int = 64, family: str = "cnn", width: float = 1.0,
                  families: list[str] | None = None) -> dict[str, dict]:
    """Default per-site model and input size.

    ``families`` (OHFL's mixed-family variant): one catalogue family per site in name order; fusable families
    (cnn/vgg11) keep the depth of the site's group, any other family gets the prototype pool's backbone of that
    family (:data:`PROTO_BACKBONES`, ``feature_dim``). The input sizes stay those of the site's group.

    Fusable methods (local/fedavg/ohfl), OHFL's assignment: sites in name order (site-1 = narrowest images) are cut
    into up to three contiguous groups -> shallow / medium / deep, at the smallest / middle / largest input size
    (6 sites: two each). Prototype methods (fedsaf/fedproto/fedtopo): backbones cycle through the heterogeneous
    pool (hetero_cnn, densenet, resnet, efficientnet) with a common feature_dim, input sizes as above.

    Returns:
        {site: {"model": spec, "input_size": int}}
    """
    import numpy as np

    n = len(sites)
    groups = np.array_split(np.arange(n), min(n, 3))
    depth_idx = np.linspace(0, 2, num=len(groups)).round().astype(int) if len(groups) > 1 else [0]
    size_idx = np.linspace(0, len(input_sizes) - 1, num=len(groups)).round().astype(int) if len(groups) > 1 else [0]
    out = {}
    for g, (di, si) in enumerate(zip(depth_idx, size_idx)):
        for i in groups[g]:
            site = sites[i]
            if families is not None and families[i] not in ("cnn", "vgg11"):
                fam = families[i]
                spec = {"family": fam, "feature_dim": feature_dim, **PROTO_BACKBONES.get(fam, {})}
            elif families is not None:
                spec = {"family": families[i], "depth": DEPTHS[di], "width": width}
            elif is_prototype(method):
                fam = HETERO_FAMILIES[i % len(HETERO_FAMILIES)]
                spec = {"family": fam, "feature_dim": feature_dim, **PROTO_BACKBONES.get(fam, {})}
            else:
                spec = {"family": family, "depth": DEPTHS[di], "width": width}
            spec.update({"in_channels": 1, "num_classes": num_classes})
            out[site] = {"model": spec, "input_size": int(input_sizes[si])}
    return out


def write_profile(partition_dir: Path, out_dir: Path, method: str, labels: str, input_sizes: list[int],
                  settings: dict, proto: bool | None = None, families: list[str] | None = None) -> Path:
    """Write one ``<site>.yaml`` per site of a partition into ``out_dir`` (the profile folder).

    These are *simulated* sites: unless ``settings`` says otherwise they set ``share_predictions: true`` so the
    run reports pooled test metrics with confidence intervals (a real site's default is false; see
    docs/DEPLOYMENT.md, Privacy). ``proto`` (default: ``method`` is a prototype method): the sites get the
    heterogeneous backbones and the prototype methods' training defaults :data:`PROTO_TRAINING` (``settings`` keys
    win). ``cxr-hfl compare`` passes ``proto=True`` for Local when it is compared with the prototype methods, so
    Local trains the same backbones. ``families``: one model family per site (:func:`assign_models`; ignored for
    prototype backbones). ``settings["frame_mask"]``, ``settings["frame_rescale"]`` (optional): written into every site's
    model spec."""
    settings = dict(settings)
    settings.setdefault("share_predictions", True)
    sites = sorted((p.stem for p in (partition_dir / "sites").glob("*.csv")), key=_site_key)
    from chest_xray.labels import num_classes as scheme_classes

    num_classes = scheme_classes(labels)
    proto = is_prototype(method) if proto is None else bool(proto)
    if proto:
        settings = {**{k: v for k, v in PROTO_TRAINING.items() if k != "input_size"}, **settings}
    models = assign_models(sites, prototype_methods()[0] if proto else method, input_sizes, num_classes,
                           feature_dim=int(settings.pop("feature_dim", 64)),
                           families=None if proto else parse_families(families, len(sites)))
    mask, rescale = settings.pop("frame_mask", None), settings.pop("frame_rescale", False)
    if mask:  # a share of each side masked in the model's input (fusable families' model spec keys)
        for m in models.values():
            m["model"] = {**m["model"], "frame_mask": float(mask), **({"frame_rescale": True} if rescale else {})}
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("*.yaml"):
        old.unlink()
    for site in sites:
        cfg = {"data": {"manifest": str((partition_dir / "sites" / f"{site}.csv").resolve()), "labels": labels},
               "model": models[site]["model"], "input_size": models[site]["input_size"]}
        cfg.update({k: v for k, v in settings.items() if v is not None})
        write_site_config(cfg, out_dir / f"{site}.yaml")
    return out_dir


def _site_key(name: str):
    head, _, tail = name.rpartition("-")
    return (head, int(tail)) if tail.isdigit() else (name, 0)
