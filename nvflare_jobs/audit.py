"""``cxr-hfl audit``: the shortcut audit of a run's saved models on an evaluated external set.

Run by ``cxr-hfl evaluate`` (and ``compare --external``) after the models are scored, or on its own on an existing
``RUN/external/<name>/`` folder. It reads that folder's ``predictions.npz`` (image paths, labels and every model's
probabilities) and the run's model files, and writes ``audit.json`` and ``audit_saliency.png`` beside them:

- **metadata baseline** (:mod:`hfl_components.audit.metadata`): a cross-validated model on the images' file-level
  facts (:mod:`chest_xray.file_facts`), its AUC with a 95 % CI, and per model the AUC margin over it with a paired
  CI; a margin whose CI covers 0 is flagged;
- **perturbation probes** (:mod:`hfl_components.audit.probes`): flip, shift (zero-filled border), contrast (gamma)
  and aspect (centred square crop vs the model's own squaring), the mean change of p(PNEUMONIA) with a CI, on a
  fixed seeded class-balanced subsample of :data:`PROBE_IMAGES` images (a 95 % CI half-width of about
  1.96 x sd / sqrt(300): +-0.011 for per-image changes with sd 0.1);
- **saliency** (:mod:`hfl_components.audit.saliency`): Grad-CAM on a fixed class-balanced sample of
  :data:`SALIENCY_IMAGES` images per model, the share of saliency in the outer border band (crude) and a montage;
- **operating point** (:mod:`hfl_components.operating_point`): for deployed models that carry a temperature and a
  federated threshold, sensitivity and specificity at that threshold with CIs, and the expected calibration error
  before and after the temperature.

The audit reads only what a site may share: the external (public) images, the models and their predictions on
them; the site data are never read. Its outputs hold counts, file-level facts named as features (never a DICOM
patient, study or institution field: :data:`chest_xray.file_facts.DICOM_TAGS` are the only tags read), and
numbers. Anything that cannot be audited gives one line in ``skipped`` naming what and why.
"""
from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from nvflare_jobs.evaluation.run_folder import list_run_models, load_model_file, model_aspect

PROBE_IMAGES = 300
SALIENCY_IMAGES = 8
MONTAGE_KINDS = ("deployed", "global")  # rows of the montage; border shares are computed for every model


def _binary(y: np.ndarray) -> np.ndarray:
    return (np.asarray(y) > 0).astype(int)


def _p_pos(p: np.ndarray) -> np.ndarray:
    p = np.asarray(p, np.float64)
    return 1.0 - p[:, 0] if p.ndim == 2 else p


class _Images:
    """Eval-mode image tensors of a fixed set of rows, per (input size, aspect), decoded once."""

    def __init__(self, rows: list[dict]):
        self.rows = rows
        self._x: dict = {}

    def get(self, size: int, aspect: str):
        import torch

        from chest_xray import make_site_dataset

        k = (int(size), aspect)
        if k not in self._x:
            ds = make_site_dataset(self.rows, int(size), "eval", aspect=aspect)
            self._x[k] = torch.stack([torch.as_tensor(ds[i]["image"]) for i in range(len(ds))])
        return self._x[k]


def _models_by_name(run: Path) -> dict[str, dict]:
    return {m["name"]: m for m in list_run_models(run, "all")}


def audit_external(run: str | Path, ext_dir: str | Path, *, probe_images: int = PROBE_IMAGES,
                   saliency_images: int = SALIENCY_IMAGES, n_boot: int = 1000, seed: int = 0,
                   device: str | None = "auto", log=print) -> dict[str, Any]:
    """Audit every model scored in ``ext_dir`` (``RUN/external/<name>/``); write ``audit.json`` and the montage.

    Returns the audit dict (as written). Raises FileNotFoundError: no ``predictions.npz`` in ``ext_dir`` (run
    ``cxr-hfl evaluate`` first); ValueError (one line naming the file): an unreadable ``predictions.npz`` or
    ``summary.json``.
    """
    from chest_xray.file_facts import facts_for
    from hfl_components.training.device import describe_device, resolve_device

    run, ext_dir = Path(run).resolve(), Path(ext_dir)
    npz = ext_dir / "predictions.npz"
    if not npz.is_file():
        raise FileNotFoundError(f"{ext_dir}: no predictions.npz (run `cxr-hfl evaluate` on this data first)")
    try:
        with np.load(npz, allow_pickle=False) as z:
            paths = [str(p) for p in z["paths"]]
            y = _binary(z["y"])
            preds = {k: z[k] for k in z.files if k not in ("paths", "y")}
    except (zipfile.BadZipFile, EOFError, KeyError, ValueError, OSError) as e:
        raise ValueError(f"{npz}: unreadable ({type(e).__name__}: {e}; truncated, or not written by evaluate); "
                         "rerun `cxr-hfl evaluate` on this set with --overwrite") from None
    summ_path = ext_dir / "summary.json"
    try:
        summ = json.loads(summ_path.read_text()) if summ_path.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{summ_path}: not readable as JSON ({e}; truncated or edited?); rerun `cxr-hfl evaluate` "
                         "on this set with --overwrite") from None
    if not isinstance(summ, dict):
        raise ValueError(f"{summ_path}: not a JSON object (truncated or edited?); rerun `cxr-hfl evaluate` on this "
                         "set with --overwrite")
    dev = resolve_device(device)
    skipped: list[str] = []
    out: dict[str, Any] = {"data": summ.get("data"), "part": summ.get("part"), "n_images": len(paths),
                           "class_counts": {"NORMAL": int((y == 0).sum()), "PNEUMONIA": int((y == 1).sum())},
                           "device": describe_device(dev), "seed": seed, "n_boot": n_boot, "skipped": skipped}
    log(f"[audit] {len(paths)} images, {len(preds)} models, on {out['device']}")
    facts, problems = facts_for(paths)
    out["metadata"] = _metadata_section(facts, problems, y, preds, n_boot, seed, skipped)
    registry = _models_by_name(run)
    loaded: dict[str, Any] = {}
    cams, simg = _probe_and_saliency(run, out, paths, y, facts, preds, registry, loaded, dev,
                                     probe_images, saliency_images, n_boot, seed, skipped)
    out["operating_point"] = operating_point_results(run, preds, y, registry, n_boot, seed, skipped)
    png = ext_dir / "audit_saliency.png"
    rows = _montage_rows(cams, registry)
    if rows and simg.rows:
        montage_figure(simg, rows, cams, registry, loaded, run, png)
        out["saliency"]["montage"] = png.name
        out["saliency"]["montage_models"] = rows
    (ext_dir / "audit.json").write_text(json.dumps(_jsonable(out), indent=1))
    for line in skipped:
        log(f"[audit] skipped: {line}")
    for line in summary_lines(out):
        log(f"[audit] {line}")
    return out


def _metadata_section(facts: list, problems: list[str], y: np.ndarray, preds: dict, n_boot: int, seed: int,
                      skipped: list[str]) -> dict[str, Any]:
    """The metadata baseline of the images whose file facts could be read, and every model's margin over it."""
    from hfl_components.audit.metadata import auc_margin, metadata_baseline

    ok = np.array([f is not None for f in facts])
    for line in problems[:5]:
        skipped.append(f"metadata: file facts unreadable, image left out of the baseline: {line}")
    if len(problems) > 5:
        skipped.append(f"metadata: {len(problems) - 5} more images with unreadable file facts left out")
    if not ok.any():
        return {"skipped": "no image with readable file facts"}
    mb = metadata_baseline([f for f in facts if f is not None], y[ok], seed=seed, n_boot=n_boot)
    scores = mb.pop("scores")
    meta = {**mb, "n": int(ok.sum()), "margins": {}}
    for fact, why in mb["not_applicable"].items():
        skipped.append(f"metadata: feature {fact} not applicable ({why})")
    if mb["skipped"]:
        skipped.append(f"metadata: no baseline AUC ({mb['skipped']})")
        return meta
    for name, p in preds.items():
        meta["margins"][name] = auc_margin(y[ok], _p_pos(p)[ok], scores, n_boot=n_boot, seed=seed)
    return meta


def _probe_and_saliency(run: Path, out: dict, paths: list[str], y: np.ndarray, facts: list, preds: dict,
                        registry: dict, loaded: dict, dev, probe_images: int, saliency_images: int, n_boot: int,
                        seed: int, skipped: list[str]) -> tuple[dict, _Images]:
    """Probes and Grad-CAM of every model in ``preds`` (loaded onto ``dev`` into ``loaded``); fills
    ``out["probes"]`` and ``out["saliency"]``; returns the Grad-CAM maps per model and the saliency images."""
    from hfl_components.audit.intervals import mean_ci
    from hfl_components.audit.probes import all_square, balanced_subsample
    from hfl_components.audit.saliency import BORDER_BAND, border_share, gradcam_maps, uniform_border_share

    pidx = balanced_subsample(y, probe_images, seed)
    sidx = balanced_subsample(y, saliency_images, seed + 1)
    pimg = _Images([{"path": paths[i], "label": int(y[i])} for i in pidx])
    simg = _Images([{"path": paths[i], "label": int(y[i])} for i in sidx])
    sizes = [(f["width"], f["height"]) for f in (facts[i] for i in pidx) if f is not None]
    square = bool(sizes) and all_square(sizes)
    if square:
        skipped.append("probes: aspect not applicable (every probed image is square, so crop and stretch agree)")
    out["probes"] = {"n_images": len(pidx), "class_counts": {"NORMAL": int((y[pidx] == 0).sum()),
                                                             "PNEUMONIA": int((y[pidx] == 1).sum())},
                     "aspect_applicable": not square, "models": {}}
    out["saliency"] = {"n_images": len(sidx), "band": BORDER_BAND, "uniform_share": uniform_border_share(),
                       "crude": True, "models": {}}
    cams: dict[str, np.ndarray] = {}
    for name in preds:
        m = registry.get(name)
        if m is None:
            skipped.append(f"probes/saliency: {name}: its model file is no longer in the run, skipped")
            continue
        try:
            if str(m["path"]) not in loaded:
                model, header = load_model_file(m["path"])
                loaded[str(m["path"])] = (model.to(dev).eval(), header)
            model, header = loaded[str(m["path"])]
        except (ValueError, OSError, RuntimeError, KeyError) as e:
            skipped.append(f"probes/saliency: {name}: cannot load {m['path']} ({str(e).splitlines()[0]})")
            continue
        size = int(m["input_size"] or header.get("input_size") or 64)
        aspect = model_aspect(header, run)
        res = probe_model(model, size, aspect, pimg, square, n_boot, seed, p0=_p_pos(preds[name])[pidx])
        out["probes"]["models"][name] = {"kind": m["kind"], "input_size": size, "aspect": aspect, **res}
        try:
            cams[name] = gradcam_maps(model, simg.get(size, aspect))
            bs = border_share(cams[name])
            out["saliency"]["models"][name] = {"kind": m["kind"],
                                               "border_share": mean_ci(bs[np.isfinite(bs)], n_boot=n_boot, seed=seed)}
        except (ValueError, RuntimeError) as e:
            skipped.append(f"saliency: {name}: Grad-CAM failed ({str(e).splitlines()[0]})")
    return cams, simg


def probe_model(model, size: int, aspect: str, images: _Images, square: bool, n_boot: int = 1000,
                seed: int = 0, p0: np.ndarray | None = None) -> dict[str, dict]:
    """The four probes (:data:`hfl_components.audit.probes.PROBES`) of one model on ``images`` at its input size and
    squaring ``aspect``: ``{probe: probe_change(...) + {"applicable": bool}}``. The aspect probe decodes the files
    again cut to their centred square (``crop``; a ``crop`` model: ``stretch``); with ``square`` it is reported as
    not applicable. ``p0``: the model's p(PNEUMONIA) on the unperturbed images when already known (evaluate's
    predictions: the same transform), else computed."""
    from hfl_components.audit.probes import PROBES, p_pneumonia, perturb, probe_change

    X = images.get(size, aspect)
    if p0 is None:
        p0 = p_pneumonia(model, X)
    res: dict[str, dict] = {}
    for pr in PROBES:
        if pr == "aspect":
            if square:
                res[pr] = {"applicable": False, "reason": "every probed image is square"}
                continue
            alt = "crop" if aspect != "crop" else "stretch"
            res[pr] = {**probe_change(p0, p_pneumonia(model, images.get(size, alt)), n_boot, seed),
                       "applicable": True, "compared": f"{alt} vs {aspect}"}
        else:
            res[pr] = {**probe_change(p0, p_pneumonia(model, perturb(X, pr)), n_boot, seed), "applicable": True}
    return res


def _montage_rows(cams: dict, registry: dict) -> list[str]:
    """Deployed models, and the global model at its largest size only."""
    rows = [n for n in cams if registry.get(n, {}).get("kind") == "deployed"]
    glob = [n for n in cams if registry.get(n, {}).get("kind") == "global"]
    if glob:
        rows.append(max(glob, key=lambda n: int(registry[n]["input_size"] or 0)))
    return rows or list(cams)[:6]


def montage_figure(simg: _Images, rows: list[str], cams: dict, registry: dict, loaded: dict, run: Path,
                   dest: Path) -> None:
    """Grad-CAM montage: one row per model (``rows``), one column per image of the fixed sample, the image in grey
    with the map over it; written to ``dest`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(simg.rows)
    fig, axes = plt.subplots(len(rows), n, figsize=(1.1 * n + 1.2, 1.15 * len(rows) + 0.4), squeeze=False)
    for r, name in enumerate(rows):
        m = registry[name]
        model, header = loaded[str(m["path"])]
        size = int(m["input_size"] or header.get("input_size") or 64)
        X = simg.get(size, model_aspect(header, run))
        maps = cams[name]
        for c in range(n):
            ax = axes[r][c]
            ax.imshow(X[c, 0].numpy(), cmap="gray", vmin=0, vmax=1)
            ax.imshow(np.ma.masked_less(maps[c], 0.05), cmap="jet", alpha=0.45, vmin=0, vmax=1)  # 0: clear
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(["NORMAL", "PNEUMONIA"][simg.rows[c]["label"]], fontsize=7)
            if c == 0:
                ax.set_ylabel(name, fontsize=7)
    fig.suptitle("Grad-CAM for PNEUMONIA (fixed class-balanced sample)", fontsize=8)
    fig.tight_layout()
    fig.savefig(dest, dpi=70)
    plt.close(fig)


def operating_point_results(run: Path, preds: dict, y: np.ndarray, registry: dict, n_boot: int, seed: int,
                            skipped: list[str]) -> dict[str, Any]:
    """Per deployed model carrying ``operating_point`` in its file header: sensitivity / specificity at the
    federated threshold on its calibrated p(PNEUMONIA) with 95 % CIs (stratified image bootstrap), ECE before and
    after the temperature; and the server's pooled choice with each site's own validation sensitivity from
    ``metrics.json``."""
    from hfl_components.models import read_model_header
    from hfl_components.operating_point import metrics_at_operating_point

    res: dict[str, Any] = {"models": {}}
    mpath = run / "metrics.json"
    rec = json.loads(mpath.read_text()).get("operating_point") if mpath.is_file() else None
    res["federated"] = rec
    missing = []
    for name, p in preds.items():
        m = registry.get(name)
        if not m or m["kind"] != "deployed":
            continue
        try:
            op = read_model_header(m["path"]).get("operating_point")
        except (ValueError, OSError):
            op = None
        if not op or op.get("threshold") is None:
            missing.append(name)
            continue
        res["models"][name] = metrics_at_operating_point(p, y, op, n_boot=n_boot, seed=seed)
    if rec and rec.get("threshold") == 0.0:  # a run from before thresholds of 0 were refused
        skipped.append("operating point: the pooled validation histograms reach the target sensitivity only at "
                       "threshold 0 (every image called PNEUMONIA): too few validation images per bin to do better")
    if missing:
        why = ((rec or {}).get("skipped") or ((rec or {}).get("unresolved") and "the federation set no threshold: "
                                               + rec["unresolved"])
               or "a run without the federated operating point (not OHFL, trained before it existed, or no "
               "validation split)")
        skipped.append(f"operating point: {len(missing)} deployed models carry no federated threshold "
                       f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}): {why}")
    return res


def _jsonable(o):
    if isinstance(o, dict):
        return {str(k): _jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_jsonable(v) for v in o]
    if isinstance(o, (np.floating, float)):
        return None if not np.isfinite(o) else float(o)
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.bool_):
        return bool(o)
    if isinstance(o, np.ndarray):
        return _jsonable(o.tolist())
    return o


def summary_lines(a: dict) -> list[str]:
    """A few lines for the console (``evaluate``, ``report``): the baseline, the flagged margins and probes."""
    out = []
    md = a.get("metadata") or {}
    if md.get("auc") is not None:
        out.append(f"metadata baseline AUC {md['auc']:.3f} [{md['ci_low']:.3f}, {md['ci_high']:.3f}] from "
                   f"{', '.join(md.get('features') or []) or 'no feature'}")
        cz = sorted(k for k, v in (md.get("margins") or {}).items() if v.get("beats_metadata") is False)
        if cz:
            out.append(f"FLAG: {len(cz)} models are not shown to beat the metadata baseline (margin CI not above "
                       "0): " + ", ".join(cz))
    flags = [f"{n} {p}" for n, r in ((a.get("probes") or {}).get("models") or {}).items()
             for p, v in r.items() if isinstance(v, dict) and v.get("flagged")]
    if flags:
        out.append(f"FLAG: {len(flags)} probe results beyond the tolerance: " + ", ".join(flags))
    elif (a.get("probes") or {}).get("models"):
        out.append("no probe beyond the tolerance")
    for n, v in ((a.get("operating_point") or {}).get("models") or {}).items():
        sens, spec = v["sensitivity"], v["specificity"]
        out.append(f"{n}: threshold {v['threshold']:.3f}: sensitivity {ci_text(sens, 'value', signed=False)}, "
                   f"specificity {ci_text(spec, 'value', signed=False)}")
    return out


def find_audits(run: str | Path) -> list[Path]:
    """Every ``audit.json`` under ``RUN/external/``."""
    return sorted(Path(run).glob("external/*/audit.json"))


def ci_text(d: dict | None, v: str = "mean_change", nd: int = 3, signed: bool = True) -> str:
    """``value [low, high]`` of an audit interval (a dict with ``v``, ``ci_low``, ``ci_high``) with ``nd`` decimals,
    the value signed when ``signed``; ``–`` when the value is missing, ``value`` alone without both bounds."""
    if not d or d.get(v) is None:
        return "–"
    f = f"{{:{'+' if signed else ''}.{nd}f}}"
    lo, hi = d.get("ci_low"), d.get("ci_high")
    ci = f" [{f.format(lo)}, {f.format(hi)}]" if lo is not None and hi is not None else ""
    return f.format(d[v]) + ci
