"""External validation of a run's saved models (``cxr-hfl evaluate``) and prediction on unlabelled images
(``cxr-hfl predict``).

``evaluate_run`` loads every model a run saved (``models/<site>_deployed.pt``, ``models/<site>_local.pt``,
``global_model.pt`` at each input size the run's sites used), evaluates it on an external labelled set at the
model's own input size with :func:`hfl_components.training.compute_metrics` (the same metrics as the sites' test
splits, argmax decision) and, for binary labels, again at the decision threshold chosen (Youden's J) on the
validation split of the model's own site (the global model: all sites' validation splits pooled).

Each evaluated data set has its own folder ``RUN/external/<name>/`` (:func:`external_name`: the data set's folder or
CSV name, plus ``-<part>`` for a committed part of ``chest_xray_224``, see :mod:`chest_xray.splits`), holding one
JSON per model, ``summary.json`` and ``predictions.npz`` (every model's per-image probabilities, for paired
comparisons). The global model has no input size of its own: it is scored at every site's input size and the
headline ``global`` entry is the mean over sites (no size is chosen on the test set).

Leakage guards: :func:`training_overlap` compares the external set's file names and patient ids with every row of
the run's site manifests; ``evaluate_run`` refuses an overlapping set unless ``force=True``. The probe is never
scored: every image of the probe pool the run's OHFL server was given (:func:`probe_pool`: a folder, a probe CSV, or
the committed ``probe`` part) is left out, and ``summary.json`` records how many as ``probe_images_excluded``.
"""
from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from chest_xray.io import SUPPORTED_SUFFIXES


class LeakageError(RuntimeError):
    """The external set shares file names or patient ids with the run's training data."""


# ----------------------------------------------------------------------------------------------- run contents
def run_manifests(run: Path) -> dict[str, Path]:
    """Site -> manifest CSV the run trained on: ``resolved_configs/<site>.json`` (data.manifest), else
    ``partition/sites/<site>.csv``."""
    run = Path(run)
    out: dict[str, Path] = {}
    for f in sorted((run / "resolved_configs").glob("*.json")):
        try:
            man = json.loads(f.read_text())["data"]["manifest"]
        except (KeyError, ValueError, TypeError):
            continue
        if Path(man).is_file():
            out[f.stem] = Path(man)
    if not out:
        for f in sorted((run / "partition" / "sites").glob("*.csv")):
            out[f.stem] = f
    return out


def site_rows(run: Path) -> dict[str, list[dict]]:
    from chest_xray import read_site_manifest

    return {s: read_site_manifest(p) for s, p in run_manifests(run).items()}


def run_input_sizes(run: Path) -> list[int]:
    sizes = set()
    for f in (Path(run) / "resolved_configs").glob("*.json"):
        try:
            sizes.add(int(json.loads(f.read_text())["input_size"]))
        except (KeyError, ValueError, TypeError):
            pass
    if not sizes and (Path(run) / "metrics.json").is_file():
        m = json.loads((Path(run) / "metrics.json").read_text())
        sizes = {int(b["input_size"]) for b in m.get("sites", {}).values() if b.get("input_size")}
    return sorted(sizes)


def run_labels(run: Path) -> str | None:
    p = Path(run) / "metrics.json"
    if p.is_file():
        return json.loads(p.read_text()).get("labels")
    return None


def load_model_file(path: str | Path):
    """``(model in eval mode, header)`` of a model file; see :func:`hfl_components.models.load_model_file`."""
    from hfl_components.models import load_model_file as _load

    return _load(path)


def list_run_models(run: Path, global_sizes: str = "all") -> list[dict[str, Any]]:
    """Every saved model of a run as ``{"name", "path", "kind", "site", "input_size"}``.

    ``kind`` is ``deployed``, ``local`` or ``global``; the global model (no input size of its own) is listed once per
    input size the run used (``global_sizes="all"``) or once at the largest (``"largest"``).
    """
    run = Path(run)
    out = []
    for f in sorted((run / "models").glob("*.pt")):
        site, _, kind = f.stem.rpartition("_")
        out.append({"name": f.stem, "path": f, "kind": kind, "site": site or None, "input_size": None})
    g = run / "global_model.pt"
    if g.is_file():
        sizes = run_input_sizes(run) or [64]
        if global_sizes == "largest":
            sizes = sizes[-1:]
        for s in sizes:
            out.append({"name": f"global_{s}px", "path": g, "kind": "global", "site": None, "input_size": s})
    return out


# ----------------------------------------------------------------------------------------------- leakage
def _stem_key(path: str) -> str:
    return Path(path).name.lower()


def training_overlap(run: Path, records: list[dict]) -> dict[str, Any]:
    """File names and patient ids the external ``records`` share with the run's site manifests (all splits)."""
    rows = [r for rs in site_rows(run).values() for r in rs]
    names = {_stem_key(r["path"]) for r in rows}
    pids = {str(r["patient_id"]) for r in rows if r.get("patient_id")}
    shared_names = sorted({_stem_key(r["path"]) for r in records} & names)
    shared_pids = sorted({str(r["patient_id"]) for r in records if r.get("patient_id")} & pids)
    n_img = sum(1 for r in records if _stem_key(r["path"]) in names or str(r.get("patient_id")) in pids)
    return {"n_run_rows": len(rows), "shared_file_names": len(shared_names), "shared_patient_ids": len(shared_pids),
            "n_external_images_affected": n_img, "examples": (shared_names[:5] + shared_pids[:5])}


def _probe_part(source: str) -> str | None:
    """``"probe"`` when ``source`` names the committed probe part: ``probe``, ``part:probe``,
    ``chest_xray_224:probe`` or the committed list ``chest_xray/splits/chest_xray_224_probe.csv`` itself."""
    from chest_xray.splits import POOL

    s = str(source)
    if s in ("probe", "part:probe", f"{POOL}:probe") or Path(s).name == f"{POOL}_probe.csv":
        return "probe"
    return None


def probe_pool(run: Path) -> tuple[set[str], str | None]:
    """File names (lower case) of every image the run's OHFL server could draw its probe from, and the source.

    The source is ``job_options.json``'s ``probe``: a folder (every image under it; the root of the shared
    ``chest_xray_224`` pool stands for its committed ``probe`` part, as the server reads it), a CSV (its ``path``
    column, e.g. a partition's probe.csv or the committed ``chest_xray_224_probe.csv``), or the committed ``probe``
    part named as ``probe`` / ``part:probe``. File names the server recorded as used (``metrics.json`` ->
    ``probe.files``) are added. A run without a probe (not OHFL, or ``generated`` inputs) gives an empty set. Whole
    pools are left out, not only the images one draw took: the server may have drawn any of them.

    Raises:
        FileNotFoundError: the recorded probe folder / CSV no longer exists (the exclusion cannot be honoured).
    """
    from chest_xray.splits import POOL, split_rows

    run = Path(run)
    used: set[str] = set()
    if (run / "metrics.json").is_file():
        rec = json.loads((run / "metrics.json").read_text()).get("probe")
        if isinstance(rec, dict):
            used = {_stem_key(str(f)) for f in rec.get("files") or []}
    opts = run / "job_options.json"
    if not opts.is_file():
        return used, None
    probe = json.loads(opts.read_text()).get("probe")
    if not probe or probe == "generated":
        return used, probe
    p = Path(probe)
    part = {_stem_key(r["path"]) for r in split_rows("probe")}
    if _probe_part(probe):
        return part | used, str(probe)
    if p.is_dir() and p.name == POOL and any((p / r["path"]).is_file() for r in split_rows("probe")[:20]):
        return part | used, f"{p} (its committed probe part)"
    if p.is_file():
        with open(p, newline="", encoding="utf-8", errors="surrogateescape") as fh:  # as write_partition wrote it
            return {_stem_key(r.get("path", "")) for r in csv.DictReader(fh) if r.get("path")} | used, str(p)
    if p.is_dir():
        return {f.name.lower() for f in p.rglob("*") if f.suffix.lower() in SUPPORTED_SUFFIXES} | used, str(p)
    raise FileNotFoundError(f"{run}: the probe pool its server used ({probe}) no longer exists, so its images "
                            "cannot be left out of the evaluation; restore it or evaluate on a set without them")


def probe_overlap(run: Path, records: list[dict]) -> int:
    """Number of external images whose file name is in the run's OHFL probe pool (:func:`probe_pool`)."""
    names, _ = probe_pool(run)
    return sum(1 for r in records if _stem_key(r["path"]) in names)


# ----------------------------------------------------------------------------------------------- evaluation
def _subset(records: list[dict], max_images: int | None, seed: int = 0) -> list[dict]:
    """A class-stratified subset of at most ``max_images`` records: :func:`chest_xray.sampling.stratified_subset`."""
    from chest_xray.sampling import stratified_subset

    return stratified_subset(records, max_images, seed)


class _ProbCache:
    """Image tensors per (image set, input size), decoded once and reused by every model scored at that size (a run
    has up to 15 models on the same external images; decoding dominates the cost)."""

    def __init__(self, batch_size: int = 64):
        self.batch_size = batch_size
        self._ds: dict[tuple, Any] = {}

    def loader(self, key: str, rows: list[dict], size: int, aspect: str | None = None):
        import torch

        from chest_xray import make_site_dataset
        from hfl_components.training.loop import unpack_batch

        from chest_xray import DEFAULT_ASPECT

        aspect = aspect or DEFAULT_ASPECT
        k = (key, size, aspect)
        if k not in self._ds:
            xs, ys = [], []
            for batch in torch.utils.data.DataLoader(make_site_dataset(rows, size, "eval", aspect=aspect),
                                                     batch_size=self.batch_size, shuffle=False, num_workers=0):
                x, y = unpack_batch(batch)
                xs.append(torch.as_tensor(x).float())
                ys.append(torch.as_tensor(y))
            self._ds[k] = torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys))
        return torch.utils.data.DataLoader(self._ds[k], batch_size=self.batch_size, shuffle=False, num_workers=0)


def _collapse(probs: np.ndarray, model_classes: int, want_classes: int) -> np.ndarray:
    """Subtype (NORMAL, BACTERIAL, VIRAL) probabilities -> binary (NORMAL, PNEUMONIA) when the data are binary."""
    if model_classes == want_classes:
        return probs
    if model_classes == 3 and want_classes == 2:
        return np.stack([probs[:, 0], probs[:, 1:].sum(axis=1)], axis=1)
    raise ValueError(f"a {model_classes}-class model cannot be evaluated on {want_classes}-class labels")


def external_name(data: str | Path, part: str | None = None) -> str:
    """Folder name of an evaluated data set under ``RUN/external/``: the folder's name (a CSV: its stem), plus
    ``-<part>`` for a committed part, e.g. ``chest_xray_224-evaluation``; characters other than letters, digits,
    ``.``, ``_`` and ``-`` become ``_``."""
    import re

    p = Path(data).resolve()
    base = p.stem if p.is_file() else p.name
    return re.sub(r"[^A-Za-z0-9._-]", "_", base + (f"-{part}" if part else "")) or "external"


def load_external(data: str | Path, labels: str, part: str | None = None) -> tuple[list[dict], dict]:
    """Records of an external labelled set (``chest_xray.scan_dataset``), restricted to a committed part of
    ``chest_xray_224`` (``probe`` / ``tuning`` / ``evaluation``, :mod:`chest_xray.splits`) when ``part`` is given,
    in which case ``data`` must be the ``chest_xray_224`` root.

    Raises:
        ValueError: no usable images; ``part`` given but ``data`` holds none of the part's images.
    """
    from chest_xray import scan_dataset

    # a committed part lists known images of the shared pool: headers only (a broken file still fails when loaded)
    records, report = scan_dataset(data, labels=labels, verify=not part)
    if part:
        from chest_xray.splits import split_rows

        # matched by class folder and file name (unique in the pool; robust to a root of symbolic links)
        want = {Path(r["path"]).parts[-2:] for r in split_rows(part)}
        kept = [r for r in records if Path(r["path"]).parts[-2:] in want]
        if not kept:
            raise ValueError(f"{data}: none of the {len(want)} images of the committed {part!r} part found; --part "
                             "needs the chest_xray_224 root (e.g. ../shared/data/chest_xray_224)")
        if len(kept) < len(want):
            print(f"note: {len(want) - len(kept)} of the {len(want)} images of the {part!r} part are missing or "
                  f"unreadable under {data}", file=sys.stderr)
        records = kept
        report = {**report, "part": part, "n_part": len(want)}
    if not records:
        raise ValueError(f"{data}: no usable labelled images ({len(report.get('skipped', []))} skipped)")
    return records, report


def model_aspect(header: dict, run: Path | None = None) -> str:
    """How to make images square for a model: its file's ``aspect`` (the site-config key it was trained with),
    else -- a global model, which has none of its own -- the one aspect every site of ``run`` used
    (``resolved_configs/<site>.json``), else ``chest_xray.DEFAULT_ASPECT`` (files written before it was recorded)."""
    from chest_xray import DEFAULT_ASPECT

    if header.get("aspect"):
        return header["aspect"]
    if run is not None:
        seen = set()
        for f in (Path(run) / "resolved_configs").glob("*.json"):
            try:
                seen.add(json.loads(f.read_text()).get("aspect") or DEFAULT_ASPECT)
            except (OSError, ValueError):
                continue
        if len(seen) == 1:
            return seen.pop()
    return DEFAULT_ASPECT


def run_site_sizes(run: Path) -> dict[str, int]:
    """Site -> input size of a run (``resolved_configs/<site>.json``, else metrics.json)."""
    out: dict[str, int] = {}
    for f in sorted((Path(run) / "resolved_configs").glob("*.json")):
        try:
            out[f.stem] = int(json.loads(f.read_text())["input_size"])
        except (KeyError, ValueError, TypeError):
            pass
    if not out and (Path(run) / "metrics.json").is_file():
        m = json.loads((Path(run) / "metrics.json").read_text())
        out = {s: int(b["input_size"]) for s, b in m.get("sites", {}).items() if b.get("input_size")}
    return out


SUMMARY_METRICS = ("accuracy", "balanced_accuracy", "auc", "sensitivity", "specificity")


def global_site_mean(results: dict[str, dict], site_sizes: dict[str, int]) -> dict[str, Any] | None:
    """The global model's headline entry: each metric at every site's own input size, averaged over sites (a size
    used by two sites counts twice). None when the global model was not scored at every site's size."""
    per_site = {s: results.get(f"global_{z}px") for s, z in site_sizes.items()}
    if not per_site or any(v is None for v in per_site.values()):
        return None
    out: dict[str, Any] = {"input_size": "per site", "site_sizes": site_sizes, "val_threshold": None}
    for k in SUMMARY_METRICS:
        vals = [v["test"].get(k) for v in per_site.values()]
        out[k] = None if any(x is None for x in vals) else float(np.mean(vals))
    return out


def evaluate_run(run: str | Path, data: str | Path, labels: str | None = None, *, force: bool = False,
                 max_images: int | None = None, global_sizes: str = "all", n_boot: int = 500,
                 part: str | None = None, log=print, audit: bool = True) -> dict[str, Any]:
    """Evaluate every saved model of ``run`` on the external labelled set ``data``; write ``RUN/external/<name>/``.

    Args:
        audit: then run the shortcut audit (:func:`nvflare_jobs.audit.audit_external`: ``audit.json`` and a
            Grad-CAM montage in the same folder); an audit that fails is reported in one line, never fatal.
        part: a committed part of ``chest_xray_224`` (``evaluation`` for headline numbers), ``data`` its root.
        global_sizes: ``all`` scores the global model at every site's size (and the site mean ``global``),
            ``largest`` only at the largest (no ``global`` mean).

    Returns:
        ``{"summary": path, "models": {name: result dict}, "overlap": {...}, "dir": folder, "n_images": int,
        "probe_images_excluded": int}``.

    Raises:
        LeakageError: the external set shares file names / patient ids with the run's manifests (unless force).
        FileNotFoundError / ValueError: no models, unreadable data root, every image in the probe pool.
    """
    import torch

    from chest_xray import CLASS_NAMES
    from hfl_components.training import choose_threshold, compute_metrics, pooled_metrics_with_ci, predict_proba

    torch.set_num_threads(min(2, torch.get_num_threads()))
    run = Path(run).resolve()
    labels = labels or run_labels(run) or "binary"
    models = list_run_models(run, global_sizes)
    if not models:
        raise FileNotFoundError(f"{run}: no saved models (models/*.pt or global_model.pt)")
    if max_images is not None and max_images < 1:
        raise ValueError(f"max_images must be >= 1, got {max_images}")
    records, report = load_external(data, labels, part)
    overlap = training_overlap(run, records)
    if overlap["shared_file_names"] or overlap["shared_patient_ids"]:
        msg = (f"the external set {data} shares {overlap['shared_file_names']} file names and "
               f"{overlap['shared_patient_ids']} patient ids ({overlap['n_external_images_affected']} images) with "
               f"the run's site data (e.g. {', '.join(overlap['examples'][:4])}): these are not external images")
        if not force:
            raise LeakageError(msg + "; use a disjoint set, or --force to evaluate anyway")
        log("WARNING " + "!" * 60)
        log(f"WARNING: --force: {msg}. The metrics below are optimistic and NOT an external validation.")
        log("WARNING " + "!" * 60)
    probe_names, probe_source = probe_pool(run)
    n_before = len(records)
    records = [r for r in records if _stem_key(r["path"]) not in probe_names]
    n_probe = n_before - len(records)
    overlap["probe_file_names"] = n_probe
    if n_probe:
        log(f"note: left out {n_probe} of {n_before} images: they are in the probe pool the run's server used "
            f"({probe_source})")
    if not records:
        raise ValueError(f"all {n_before} images of {data} are in the probe pool the run's server used "
                         f"({probe_source}); evaluate on images outside it (e.g. --part evaluation of chest_xray_224)")
    records = _subset(records, max_images)
    names = CLASS_NAMES[labels]
    C = len(names)
    rows_by_site = site_rows(run)
    val_rows = {s: [r for r in rs if r["split"] == "val"] for s, rs in rows_by_site.items()}
    run_labels_name = run_labels(run) or labels
    name = external_name(data, part)
    out_dir = run / "external" / name
    if out_dir.is_dir():  # a rerun on the same data set replaces its own folder, never another data set's
        import shutil

        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    cache = _ProbCache()
    results: dict[str, dict] = {}
    preds: dict[str, np.ndarray] = {}
    y = None
    for m in models:
        model, blob = load_model_file(m["path"])
        size = int(m["input_size"] or blob.get("input_size") or 64)
        mc = int(blob["spec"].get("num_classes", C))
        aspect = model_aspect(blob, run)
        p, y = predict_proba(model, cache.loader("ext", records, size, aspect))
        p = _collapse(p, mc, C)
        preds[m["name"]] = p.astype(np.float32)
        argmax = compute_metrics(y, p, C)
        res: dict[str, Any] = {"model": str(m["path"].relative_to(run)), "kind": m["kind"], "site": m["site"],
                               "spec": blob["spec"], "input_size": size, "aspect": aspect, "data": str(Path(data).resolve()),
                               "part": part, "labels": labels, "class_names": list(names), "n": int(len(y)),
                               "test": argmax}
        # threshold from the validation split of the model's own site (global: every site's validation split)
        vrows = (val_rows.get(m["site"], []) if m["site"] else [r for rs in val_rows.values() for r in rs])
        thr = None
        if C == 2 and vrows and run_labels_name in ("binary", "subtype"):
            vlab = [{"path": r["path"], "label": r["label"] if run_labels_name == "binary" else int(r["label"] > 0)}
                    for r in vrows]
            vp, vy = predict_proba(model, cache.loader(f"val:{m['site']}", vlab, size, aspect))
            vp = _collapse(vp, mc, C)
            thr = choose_threshold(vy, vp[:, 1])
            res["val_n"] = int(len(vy))
            res["test_at_val_threshold"] = compute_metrics(y, p, C, threshold=thr)
        res["val_threshold"] = thr
        if C == 2 and blob.get("operating_point"):  # the federated threshold on the temperature-scaled model
            from hfl_components.operating_point import metrics_at_operating_point

            res["operating_point"] = metrics_at_operating_point(p, y, blob["operating_point"], n_boot=n_boot)
        res["pooled_ci"] = pooled_metrics_with_ci(y, p, C, n_boot=n_boot, threshold=None)
        res["overlap"] = overlap
        (out_dir / f"{m['name']}.json").write_text(json.dumps(res, indent=1))
        results[m["name"]] = res
        log(_line(m["name"], size, res))
    np.savez_compressed(out_dir / "predictions.npz", paths=np.asarray([r["path"] for r in records]),
                        y=np.asarray(y, dtype=np.int64), **preds)
    summ_models = {k: {key: v["test"].get(key) for key in SUMMARY_METRICS}
                   | {"kind": v["kind"], "site": v["site"], "input_size": v["input_size"],
                      "val_threshold": v["val_threshold"],
                      **({"sensitivity_at_val_threshold": v["test_at_val_threshold"]["sensitivity"],
                          "specificity_at_val_threshold": v["test_at_val_threshold"]["specificity"]}
                         if "test_at_val_threshold" in v else {}),
                      **({"operating_point": v["operating_point"]} if "operating_point" in v else {})}
                   for k, v in results.items()}
    g = global_site_mean(results, run_site_sizes(run)) if global_sizes == "all" else None
    if g:
        summ_models["global"] = {**g, "kind": "global", "site": None}
        log(f"{'global':<18}{'site mean':>7}  n={len(records):<5} acc {_f3(g['accuracy'])}  bal_acc "
            f"{_f3(g['balanced_accuracy'])}  auc {_f3(g['auc'])}  (each site's size, averaged over sites)")
    summary = {"run": str(run), "data": str(Path(data).resolve()), "part": part, "name": name, "labels": labels,
               "n_images": len(records), "max_images": max_images, "probe_images_excluded": n_probe,
               "probe_source": probe_source,
               "scan_skipped": len(report.get("skipped", [])), "overlap": overlap, "forced": bool(force),
               "models": summ_models}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    if audit:
        from nvflare_jobs.audit import audit_external

        try:
            audit_external(run, out_dir, log=log)
        except (ValueError, OSError, RuntimeError) as e:
            log(f"[audit] skipped: the audit failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
    return {"summary": out_dir / "summary.json", "models": results, "overlap": overlap, "dir": out_dir,
            "n_images": len(records), "probe_images_excluded": n_probe}


def _f3(v) -> str:
    return "  -  " if v is None else f"{v:.3f}"


def _line(name: str, size: int, res: dict) -> str:
    t = res["test"]

    def f(v):
        return "  -  " if v is None else f"{v:.3f}"
    s = (f"{name:<18}{size:>5}px  n={res['n']:<5} acc {f(t['accuracy'])}  bal_acc {f(t['balanced_accuracy'])}  "
         f"auc {f(t['auc'])}")
    if "test_at_val_threshold" in res:
        tv = res["test_at_val_threshold"]
        s += f"  | thr {res['val_threshold']:.3f}: sens {f(tv['sensitivity'])} spec {f(tv['specificity'])}"
    if "operating_point" in res:
        op = res["operating_point"]
        s += (f"  | federated thr {op['threshold']:.3f} (T {op['temperature']:.2f}): sens "
              f"{f(op['sensitivity']['value'])} spec {f(op['specificity']['value'])}")
    return s


# ----------------------------------------------------------------------------------------------- predict
# Screening of JPEG/PNG files lives in chest_xray.screening (next to the DICOM check in chest_xray.io); these
# names stay importable from here.
from chest_xray.screening import (  # noqa: E402,F401
    COLOUR_PIXEL_SPREAD,
    MAX_COLOUR_PIXEL_FRACTION,
    MAX_MEAN_COLOUR_SPREAD,
    MIN_IMAGE_SIDE,
    screen_image,
)


def collect_files(inputs: list[str], skipped: list[dict] | None = None) -> list[Path]:
    """Files to predict on: each input is a file (any suffix: DICOM without suffix is sniffed) or a folder,
    searched recursively, following symbolic links to folders (each real folder once, as ``partition`` does), for
    .jpg/.jpeg/.png/.dcm/.dicom and for files with any other name that carry the DICOM ``DICM`` marker, as PACS
    and CD exports name them (``IM000001``, ``1.2.840.10008....``). Broken symbolic links with an image suffix are
    returned too, so that they are reported as skipped rather than silently left out.

    Args:
        skipped: when given, receives ``{"path", "reason", "kind"}`` for what the folder walk could not enter: a
            symbolic-link cycle or second link to a folder already searched, a folder that cannot be listed, a
            broken link without an image suffix (operating-system junk folders such as ``__MACOSX`` are left out
            silently).
    """
    from chest_xray.dataset import _dir_key, _sniff_dicom, _walk_files

    def wanted(f: Path) -> bool:
        if f.suffix.lower() in SUPPORTED_SUFFIXES:
            return True
        return _sniff_dicom(f)  # IM000001, or a UID name 1.2.840....1234

    out: list[Path] = []
    seen: set[tuple[int, int]] = set()
    for s in inputs:
        p = Path(s)
        if p.is_dir():
            walk_skips: list[dict] = []
            real = Path(os.path.realpath(p))  # a link up to the folder or a parent would leave the input: not followed
            blocked = {k for k in map(_dir_key, [real, *real.parents]) if k}
            files = [f for f in _walk_files(p, walk_skips, seen, blocked) if wanted(f)]
            for e in walk_skips:
                if e["kind"] == "broken symbolic link" and Path(e["path"]).suffix.lower() in SUPPORTED_SUFFIXES:
                    files.append(Path(e["path"]))
                elif e["kind"] != "junk" and skipped is not None:
                    skipped.append(e)
            out.extend(sorted(files))
        else:
            out.append(p)  # missing files are reported as skipped, not raised
    return out


def check_predict_args(inputs: list[str], out_csv: str | Path) -> None:
    """Up-front checks of ``predict``'s arguments, before any model is loaded.

    Raises:
        FileNotFoundError: none of the inputs exists.
        ValueError: ``out_csv`` is a folder or lies under a file; the inputs hold no image files at all.
    """
    out = Path(out_csv)
    if out.is_dir():
        raise ValueError(f"--out {out} is a folder; give a CSV file name, e.g. {out / 'predictions.csv'}")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"--out {out}: {parent} is a file, not a folder")
            break
    missing = [s for s in inputs if not Path(s).exists() and not Path(s).is_symlink()]
    if len(missing) == len(inputs):
        raise FileNotFoundError(f"no such file or folder: {', '.join(missing)}")
    if not collect_files(inputs):
        exts = "/".join(x.lstrip(".") for x in SUPPORTED_SUFFIXES)
        raise ValueError(f"no image files ({exts}) found in {', '.join(inputs)}")


def predict_files(model_path: str | Path, inputs: list[str], out_csv: str | Path, *, batch_size: int = 32,
                  threshold: float | None = None, allow_any_modality: bool = False,
                  allow_lateral: bool = False) -> dict[str, int]:
    """Write per-image class probabilities and the predicted class to ``out_csv``.

    Columns: ``path, status (ok|skipped), reason, p_<class>..., predicted``. A file that cannot be read is
    written with status ``skipped`` and the reason; it never stops the run. So is an image that is not a plausible
    chest radiograph: shorter side under :data:`MIN_IMAGE_SIDE` px, or colourful (see :func:`screen_image`), and
    a broken symbolic link.

    Raises:
        FileNotFoundError: no input exists. ValueError: ``out_csv`` is a folder, no image files in the inputs,
            or ``model_path`` is not a cxr-hfl model file (all checked before inference). DICOM objects that are not CR/DX/DR
    projections or are lateral views are skipped as in training (``allow_*`` to keep them). ``threshold`` (binary
    only): predict PNEUMONIA when p >= threshold; default argmax, or for a deployed model that carries a federated
    operating point (:mod:`hfl_components.operating_point`) its threshold, with the probabilities written
    calibrated by its temperature.
    """
    import torch

    from chest_xray import ImageReadError, build_transforms, class_names, scheme_for_num_classes
    from chest_xray.io import _is_dicom, dicom_header, dicom_skip_reason
    from hfl_components.training import predict_labels

    check_predict_args(inputs, out_csv)
    model, blob = load_model_file(model_path)
    size = int(blob.get("input_size") or 64)
    labels = blob.get("labels") or scheme_for_num_classes(int(blob["spec"].get("num_classes", 2)))
    names = class_names(labels)
    op = blob.get("operating_point") if len(names) == 2 else None
    if op and threshold is None:
        threshold = float(op["threshold"])
    tf = build_transforms(size, "eval", aspect=model_aspect(blob))
    folder_skips: list[dict] = []
    files = collect_files(inputs, folder_skips)
    rows: list[dict] = []
    batch: list[tuple[int, torch.Tensor]] = []

    def flush():
        if not batch:
            return
        with torch.no_grad():
            x = torch.stack([t for _, t in batch])
            p = torch.softmax(model.head(model.features(x)), dim=1).numpy().astype(np.float64)
        if op:
            from hfl_components.operating_point import apply_temperature

            p = apply_temperature(p, float(op["temperature"]))
        pred = predict_labels(p, threshold)
        for (i, _), pi, ci in zip(batch, p, pred):
            rows[i].update({f"p_{n}": round(float(v), 5) for n, v in zip(names, pi)})
            rows[i]["predicted"] = names[int(ci)]
        batch.clear()

    for f in files:
        row = {"path": str(f), "status": "ok", "reason": ""}
        rows.append(row)
        try:
            if f.is_symlink() and not f.exists():
                raise ImageReadError(f, f"broken symbolic link (its target {os.readlink(f)} does not exist)")
            if _is_dicom(f) and f.is_file():  # same rule as the training scan: projection radiographs, no laterals
                hdr = dicom_header(f)
                why = dicom_skip_reason(hdr, allow_any_modality, allow_lateral)
                side = min(int(hdr.get("rows") or 0), int(hdr.get("columns") or 0))
                if not why and 0 < side < MIN_IMAGE_SIDE:
                    why = (f"image too small to be a chest radiograph: {hdr.get('columns')}x{hdr.get('rows')} px "
                           f"(shorter side under {MIN_IMAGE_SIDE} px)")
                if why:
                    raise ImageReadError(f, why)
            elif f.is_file():
                why = screen_image(f)
                if why:
                    raise ImageReadError(f, why)
            x = tf({"image": str(f), "label": 0})["image"]
        except Exception as e:  # noqa: BLE001 -- one bad file never stops the run
            cause = e
            while cause.__cause__ is not None:
                cause = cause.__cause__
            reason = getattr(cause, "reason", None) or f"{type(cause).__name__}: {cause}"
            row.update({"status": "skipped", "reason": str(reason).replace("\n", " ")[:300]})
            continue
        batch.append((len(rows) - 1, x))
        if len(batch) >= batch_size:
            flush()
    flush()
    rows.extend({"path": e["path"], "status": "skipped", "reason": e["reason"]} for e in folder_skips)
    out = Path(out_csv)
    out.parent.mkdir(parents=True, exist_ok=True)
    cols = ["path", "status", "reason", *[f"p_{n}" for n in names], "predicted"]
    # surrogateescape: a file name that is not UTF-8 (e.g. cp1252 from a Windows zip) is written as its exact bytes
    with out.open("w", newline="", encoding="utf-8", errors="surrogateescape") as fh:
        w = csv.DictWriter(fh, fieldnames=cols, restval="")
        w.writeheader()
        w.writerows(rows)
    n_ok = sum(r["status"] == "ok" for r in rows)
    return {"n_files": len(rows), "n_ok": n_ok, "n_skipped": len(rows) - n_ok, "input_size": size,
            "threshold": threshold, "calibrated": bool(op)}


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `cxr-hfl evaluate` / `cxr-hfl predict`")
