"""External validation of a run's saved models (``cxr-hfl evaluate``): :func:`evaluate_run`."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from chest_xray.sampling import stratified_subset
from nvflare_jobs.evaluation.run_folder import (LeakageError, list_run_models, load_model_file, missing_run_manifests,
                                                model_aspect, name_key, probe_pool, run_groups, run_labels,
                                                run_site_sizes, site_rows, training_overlap)

class ProbCache:
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


def _check_model_headers(models: list[dict], labels: str) -> None:
    """Every model file of :func:`list_run_models` readable and able to give ``labels`` (a 3-class subtype model
    also gives binary labels, :func:`_collapse`), from the files' headers without loading the weights.

    Raises:
        ValueError: one line naming the model file (not a model file, or too few classes for ``--labels``).
    """
    from chest_xray import CLASS_NAMES
    from hfl_components.models.files import read_model_header

    want = len(CLASS_NAMES[labels])
    for m in models:
        mc = int(read_model_header(m["path"])["spec"].get("num_classes", want))
        if mc != want and not (mc == 3 and want == 2):
            raise ValueError(f"{m['path']}: a {mc}-class model cannot be evaluated on {want}-class labels "
                             f"(--labels {labels}); use the labels the run was trained on")


def external_name(data: str | Path, part: str | None = None) -> str:
    """Folder name of an evaluated data set under ``RUN/external/``: the folder's name (a CSV: its stem), plus
    ``-<part>`` for a committed part, e.g. ``chest_xray_224-evaluation``; characters other than letters, digits,
    ``.``, ``_`` and ``-`` become ``_``."""
    import re

    p = Path(data).resolve()
    base = p.stem if p.is_file() else p.name
    return re.sub(r"[^A-Za-z0-9._-]", "_", base + (f"-{part}" if part else "")) or "external"


def part_required(data: str | Path, part: str | None, option: str = "--data") -> str | None:
    """One line refusing a bad combination of ``data`` (the value of ``option``) and ``part``, checked by file name
    before anything is scanned: ``data`` without ``part`` when ``data`` is the ``chest_xray_224`` root (it holds
    images of several committed parts, :func:`chest_xray.splits.parts_under`): scored whole it would mix the tuning
    and evaluation parts; ``part`` given but ``data`` holds none of that part's images (it is not the pool root).
    None otherwise, also for a ``data`` path that does not exist (the caller names it)."""
    from chest_xray.splits import POOL, parts_under

    found = parts_under(data)
    if part:
        if part in found or not Path(data).exists():
            return None
        return (f"{option} {data} holds none of the images of the committed {part!r} part: --part needs the {POOL} "
                f"root (e.g. ../shared/data/{POOL})")
    if len(found) < 2:
        return None
    return (f"{option} {data} is the {POOL} root (it holds the committed parts {', '.join(found)}): choose one with "
            f"--part ({'|'.join(found)}); 'evaluation' is for headline numbers, 'tuning' for choosing defaults")


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


SUMMARY_METRICS = ("accuracy", "balanced_accuracy", "auc", "sensitivity", "specificity")


def global_site_mean(results: dict[str, dict], site_sizes: dict[str, int], kind: str = "global",
                     site_groups: dict[str, str] | None = None) -> dict[str, Any] | None:
    """The global model's headline entry: each metric at every site's own input size, averaged over sites (a size
    used by two sites counts twice). ``kind="fused"``: the same for the model before distillation. With
    ``site_groups`` ({site: architecture group}) each site scores its own group's model. None when the model was
    not scored at every site's size."""
    def name(s, z):
        return f"{kind}-{site_groups[s]}_{z}px" if site_groups else f"{kind}_{z}px"
    per_site = {s: results.get(name(s, z)) for s, z in site_sizes.items()}
    if not per_site or any(v is None for v in per_site.values()):
        return None
    out: dict[str, Any] = {"input_size": "per site", "site_sizes": site_sizes, "val_threshold": None}
    for k in SUMMARY_METRICS:
        vals = [v["test"].get(k) for v in per_site.values()]
        out[k] = None if any(x is None for x in vals) else float(np.mean(vals))
    return out


def evaluate_run(run: str | Path, data: str | Path, labels: str | None = None, *, force: bool = False,
                 max_images: int | None = None, global_sizes: str = "all", n_boot: int = 500,
                 part: str | None = None, log=print, audit: bool = True, overwrite: bool = False) -> dict[str, Any]:
    """Evaluate every saved model of ``run`` on the external labelled set ``data``; write ``RUN/external/<name>/``.

    Args:
        audit: then run the shortcut audit (:func:`nvflare_jobs.audit.audit_external`: ``audit.json`` and a
            Grad-CAM montage in the same folder); an audit that fails is reported in one line, never fatal.
        part: a committed part of ``chest_xray_224`` (``evaluation`` for headline numbers), ``data`` its root.
        global_sizes: ``all`` scores the global model at every site's size (and the site mean ``global``),
            ``largest`` only at the largest (no ``global`` mean).
        overwrite: replace an earlier evaluation of the same set (``RUN/external/<name>/``) that was made with other
            options (:func:`replace_problem`); without it such a folder is never touched. One made with the same
            options is always replaced (a rerun); when it has no audit and ``audit`` is set, one ``log`` line says
            that the audit is added to it.

    Returns:
        ``{"summary": path, "models": {name: result dict}, "overlap": {...}, "dir": folder, "n_images": int,
        "probe_images_excluded": int}``.

    Raises:
        LeakageError: the external set shares file names / patient ids with the run's manifests (unless force).
        FileNotFoundError / ValueError: no models, unreadable data root, every image in the probe pool, an earlier
            evaluation of the set made with other options and no ``overwrite`` (one line naming its folder).
    """
    import torch

    torch.set_num_threads(min(2, torch.get_num_threads()))
    run = Path(run).resolve()
    labels = labels or run_labels(run) or "binary"
    models = list_run_models(run, global_sizes, log)
    if not models:
        raise FileNotFoundError(f"{run}: no saved models (models.json lists none; models/*.pt, global_model.pt)")
    if max_images is not None and max_images < 1:
        raise ValueError(f"max_images must be >= 1, got {max_images}")
    _check_model_headers(models, labels)  # before the data are read and before an earlier result is replaced
    records, report, overlap, n_probe, probe_source = _external_records(run, data, labels, part, force, log)
    records = stratified_subset(records, max_images)
    name = external_name(data, part)
    out_dir = run / "external" / name
    opts = {"n_images": len(records), "max_images": max_images, "labels": labels, "forced": bool(force),
            "n_boot": n_boot, "global_sizes": global_sizes}
    _clear_earlier(out_dir, opts, audit, overwrite, log)
    scorer = _Scorer(run, records, data, part, labels, n_boot)
    results: dict[str, dict] = {}
    preds: dict[str, np.ndarray] = {}
    for m in models:
        res, preds[m["name"]] = scorer.score(m)
        res["overlap"] = overlap
        (out_dir / f"{m['name']}.json").write_text(json.dumps(res, indent=1))
        results[m["name"]] = res
        log(_line(m["name"], res["input_size"], res))
    np.savez_compressed(out_dir / "predictions.npz", paths=np.asarray([r["path"] for r in records]),
                        y=np.asarray(scorer.y, dtype=np.int64), **preds)
    summ_models = _summary_models(results, run, global_sizes, len(records), log)
    _references(summ_models, preds, results, scorer.y, scorer.C, len(records), log)
    summary = {"run": str(run), "data": str(Path(data).resolve()), "part": part, "name": name, "labels": labels,
               "n_images": len(records), "max_images": max_images, "n_boot": n_boot, "global_sizes": global_sizes,
               "probe_images_excluded": n_probe,
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


def _clear_earlier(out_dir: Path, opts: dict, audit: bool, overwrite: bool, log) -> None:
    """Make ``out_dir`` empty for a new evaluation: an earlier one made with other options is refused unless
    ``overwrite`` (ValueError, :func:`replace_problem`'s line); adding the audit to an earlier one without it is
    allowed (the same options: nothing is lost) and said in one ``log`` line."""
    why = replace_problem(out_dir, opts, audit)
    if why and not overwrite:
        raise ValueError(why)
    if not why and audit and (out_dir / "summary.json").is_file() and not (out_dir / "audit.json").is_file():
        log(f"adding the shortcut audit to the earlier evaluation in {out_dir} (it has none; its results are "
            "recomputed with the same options)")
    if out_dir.is_dir():  # a rerun on the same data set replaces its own folder, never another data set's
        import shutil

        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)


def replace_problem(out_dir: Path, opts: dict, audit: bool) -> str | None:
    """One line refusing to replace the earlier evaluation in ``out_dir`` (``RUN/external/<name>/``) by one made with
    other options, or None (no earlier evaluation, or the same options: a rerun). ``opts`` holds the new
    evaluation's ``n_images``, ``max_images``, ``labels``, ``forced``, ``n_boot`` and ``global_sizes``; an option the
    earlier ``summary.json`` does not record (written before it was) is not compared. Without ``audit``, an earlier
    audit (``audit.json``) would be deleted: refused too. A folder without ``summary.json`` (an evaluation that
    stopped) is no objection; an unreadable one is."""
    summ = Path(out_dir) / "summary.json"
    if not summ.is_file():
        return None
    try:
        old = json.loads(summ.read_text())
        if not isinstance(old, dict):
            raise ValueError(f"expected a JSON object, found {type(old).__name__}")
    except (OSError, ValueError) as e:
        return (f"{summ} is unreadable ({str(e).splitlines()[0] if str(e) else type(e).__name__}), so it cannot be "
                "told with which options that evaluation was made: give --overwrite to replace it")
    show = {"max_images": "max-images", "n_boot": "n-boot", "global_sizes": "global-sizes", "labels": "labels",
            "forced": "force"}
    def fmt(v):
        return "none" if v is None else str(v).lower() if isinstance(v, bool) else v

    diffs = [f"{v} images (was {old['n_images']})" if k == "n_images" else f"{show[k]} {fmt(v)} (was {fmt(old[k])})"
             for k, v in opts.items() if k in old and old[k] != v]
    if not audit and (Path(out_dir) / "audit.json").is_file():
        diffs.append("no audit (it has audit.json)")
    if not diffs:
        return None
    return (f"{out_dir} already holds an evaluation of this set made with other options ({'; '.join(diffs)}); "
            "give --overwrite to replace it (its results and audit are deleted), or keep it")


def _external_records(run: Path, data, labels: str, part, force: bool, log) -> tuple:
    """The external set's records without the probe pool's images, after the leakage check. Returns
    ``(records, scan report, overlap, images left out as probe images, probe source)``. Raises LeakageError
    (unless ``force``) or ValueError (every image in the probe pool)."""
    records, report = load_external(data, labels, part)
    if (missing := missing_run_manifests(run)) and not force:  # else the check below would pass unseen sites
        raise FileNotFoundError(f"{run}: cannot check {data} for shared images: the training manifest of "
                                f"{', '.join(missing)} is neither where its resolved config says nor in "
                                f"{run / 'partition' / 'sites'}; restore it, or --force to evaluate unchecked")
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
    records = [r for r in records if name_key(r["path"]) not in probe_names]
    n_probe = n_before - len(records)
    overlap["probe_file_names"] = n_probe
    if n_probe:
        log(f"note: left out {n_probe} of {n_before} images: they are in the probe pool the run's server used "
            f"({probe_source})")
    if not records:
        raise ValueError(f"all {n_before} images of {data} are in the probe pool the run's server used "
                         f"({probe_source}); evaluate on images outside it (e.g. --part evaluation of chest_xray_224)")
    return records, report, overlap, n_probe, probe_source


class _Scorer:
    """Scores one run's saved models on the external records: argmax metrics, the binary decision threshold chosen
    on the model's own site's validation split (the global model: every site's), pooled bootstrap CIs."""

    def __init__(self, run: Path, records: list[dict], data, part, labels: str, n_boot: int):
        from chest_xray import CLASS_NAMES

        self.run, self.records, self.data, self.part, self.labels, self.n_boot = run, records, data, part, labels, n_boot
        self.names = CLASS_NAMES[labels]
        self.C = len(self.names)
        self.val_rows = {s: [r for r in rs if r["split"] == "val"] for s, rs in site_rows(run).items()}
        self.run_labels = run_labels(run) or labels
        self.cache = ProbCache()
        self.y = None

    def score(self, m: dict) -> tuple[dict, np.ndarray]:
        """``(result dict, float32 probabilities (N, C))`` of one model of :func:`list_run_models`."""
        from hfl_components.training import choose_threshold, compute_metrics, pooled_metrics_with_ci, predict_proba

        C, run = self.C, self.run
        model, blob = load_model_file(m["path"])
        size = int(m["input_size"] or blob.get("input_size") or 64)
        mc = int(blob["spec"].get("num_classes", C))
        aspect = model_aspect(blob, run)
        p, y = predict_proba(model, self.cache.loader("ext", self.records, size, aspect))
        self.y = y
        p = _collapse(p, mc, C)
        res: dict[str, Any] = {**({"own_size": True} if m.get("own_size") else {}),
                               "model": str(m["path"].relative_to(run)), "kind": m["kind"], "site": m["site"],
                               "spec": blob["spec"], "input_size": size, "aspect": aspect,
                               "data": str(Path(self.data).resolve()), "part": self.part, "labels": self.labels,
                               "class_names": list(self.names), "n": int(len(y)), "test": compute_metrics(y, p, C)}
        # threshold from the validation split of the model's own site (global: every site's validation split)
        vrows = (self.val_rows.get(m["site"], []) if m["site"] else [r for rs in self.val_rows.values() for r in rs])
        thr = None
        if C == 2 and vrows and self.run_labels in ("binary", "subtype"):
            vlab = [{"path": r["path"], "label": r["label"] if self.run_labels == "binary" else int(r["label"] > 0)}
                    for r in vrows]
            vp, vy = predict_proba(model, self.cache.loader(f"val:{m['site']}", vlab, size, aspect))
            vp = _collapse(vp, mc, C)
            thr = choose_threshold(vy, vp[:, 1])
            res["val_n"] = int(len(vy))
            res["test_at_val_threshold"] = compute_metrics(y, p, C, threshold=thr)
        res["val_threshold"] = thr
        if C == 2 and (blob.get("operating_point") or {}).get("threshold") is not None:  # the federated threshold
            from hfl_components.operating_point import metrics_at_operating_point

            res["operating_point"] = metrics_at_operating_point(p, y, blob["operating_point"], n_boot=self.n_boot)
        res["pooled_ci"] = pooled_metrics_with_ci(y, p, C, n_boot=self.n_boot, threshold=None)
        return res, p.astype(np.float32)


def _summary_models(results: dict, run: Path, global_sizes: str, n_images: int, log) -> dict:
    """``summary.json``'s ``models``: each model's headline metrics, and the global model's site mean."""
    summ_models = {k: {key: v["test"].get(key) for key in SUMMARY_METRICS}
                   | {"kind": v["kind"], "site": v["site"], "input_size": v["input_size"],
                      "val_threshold": v["val_threshold"],
                      **({"sensitivity_at_val_threshold": v["test_at_val_threshold"]["sensitivity"],
                          "specificity_at_val_threshold": v["test_at_val_threshold"]["specificity"]}
                         if "test_at_val_threshold" in v else {}),
                      **({"operating_point": v["operating_point"]} if "operating_point" in v else {})}
                   for k, v in results.items()}
    site_groups = {s: g for g, ss in run_groups(run).items() for s in ss} or None
    for kind in ("global", "fused"):
        g = global_site_mean(results, run_site_sizes(run), kind, site_groups) if global_sizes == "all" else None
        how = "each site's size, averaged over sites"
        own = [k for k, v in results.items() if v["kind"] == kind and v.get("own_size")]
        if g is None and len(own) == 1:  # a global model with its own input size (FENS) is scored once, at it
            g = {**{m: summ_models[own[0]][m] for m in SUMMARY_METRICS}, "input_size": results[own[0]]["input_size"],
                 "val_threshold": summ_models[own[0]]["val_threshold"]}
            how = f"at its own {g['input_size']} px"
        if g:
            summ_models[kind] = {**g, "kind": kind, "site": None}
            log(f"{kind:<18}{'site mean' if own == [] else '':>7}  n={n_images:<5} acc {_f3(g['accuracy'])}  bal_acc "
                f"{_f3(g['balanced_accuracy'])}  auc {_f3(g['auc'])}  ({how})")
    return summ_models


def ensemble_reference(preds: dict[str, np.ndarray], results: dict[str, dict], y, num_classes: int
                       ) -> dict[str, Any] | None:
    """The site ensemble, the upper reference of a one-shot run: the equally weighted mean of the class
    probabilities of every site's uploaded (``local``) model, each at its own input size, scored like any model
    (``compute_metrics``). None when the run saved fewer than two local models."""
    from hfl_components.training import compute_metrics

    names = sorted(n for n, r in results.items() if r["kind"] == "local")
    if len(names) < 2 or y is None:
        return None
    m = compute_metrics(y, np.mean([preds[n] for n in names], axis=0), num_classes)
    return {**{k: m.get(k) for k in SUMMARY_METRICS}, "kind": "ensemble", "site": None, "input_size": "per site",
            "members": names, "val_threshold": None}


def _references(summ_models: dict, preds: dict, results: dict, y, num_classes: int, n_images: int, log) -> None:
    """Add the site ensemble to ``summ_models`` and each of ``global`` / ``fused``'s AUC gap to it."""
    ens = ensemble_reference(preds, results, y, num_classes)
    if ens is None:
        return
    summ_models["ensemble"] = ens
    log(f"{'ensemble':<18}{'':>7}  n={n_images:<5} acc {_f3(ens['accuracy'])}  bal_acc "
        f"{_f3(ens['balanced_accuracy'])}  auc {_f3(ens['auc'])}  (the uploads' averaged probabilities)")
    for kind in ("global", "fused"):
        if kind in summ_models and summ_models[kind].get("auc") is not None and ens.get("auc") is not None:
            summ_models[kind]["gap_to_ensemble_auc"] = float(ens["auc"] - summ_models[kind]["auc"])


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
