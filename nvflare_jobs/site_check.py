"""``cxr-hfl site check``: a hospital checks its own site before a job arrives.

:func:`check_site` validates the site config, reads the manifest, decodes every image it lists (with the same
reader the site uses in a job, :func:`chest_xray.read_image`), resolves the device and builds the model.
:func:`format_report` turns the result into one screen. Nothing here talks to the server; the report holds counts,
image sizes, the site's own paths of unreadable files and the model/device, never pixel data or DICOM patient
fields (the reader's reasons never contain them).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

SPLITS = ("train", "val", "test")
MAX_LISTED = 10  # unreadable files listed on the screen (all are in the report dict)
METADATA_MIN_PER_CLASS = 10  # training images per class below which the metadata check is not run


def check_site(config: str | os.PathLike, site: str | None = None, read_images: bool = True,
               workers: int | None = None) -> dict:
    """Check one site: config, manifest, every image, model and device.

    Args:
        config: the site's ``<site>.yaml``.
        site: the site name (default: the file's stem, the convention every site follows).
        read_images: decode every image of the manifest (False: only check that each file exists, plus the config,
            manifest and model).
        workers: reader processes, and threads for the existence check (default: the config's ``threads``).

    Returns:
        dict with ``site``, ``config`` (path), ``errors`` and ``warnings`` (lists of one-line messages; any error
        means the site would fail a job), ``bad_config`` (True when the config itself, or the manifest its
        ``data.manifest`` names, cannot be read: the check stopped there), and when the config could be read: ``labels``, ``class_names``,
        ``manifest``, ``counts`` ({split: {class: n}}), ``n_images``, ``n_patients``, ``unreadable`` ([{"line",
        "path", "split", "reason"}] in manifest order; with ``read_images=False``: ``missing`` instead, the rows
        whose file does not exist, same fields), ``formats`` ({format: n}), ``resolution`` ({"width"/"height":
        {min, median, max}} in pixels, of the images read), ``smaller_than_input`` (images whose shorter side is
        below ``input_size``), ``findings`` (one ``{"kind", "count", "examples", "text"}`` per data finding, see
        :func:`chest_xray.grouping.site_findings`), ``augment_classes`` (names of the classes augmented in training, resolved as the
        site does), ``augment_config`` (the config's value) and ``frame_augment`` (the config's ``augment`` when it
        frames every class whatever ``augment_classes`` says, e.g. ``zoom_out``; else None), ``model`` (spec), ``n_params``, ``input_size``,
        ``batch_size``, ``device`` (description), ``amp``.
    """
    from chest_xray import CLASS_NAMES
    from hfl_components.flare.site_config import SiteConfigError, load_site_config

    p = Path(config)
    site = site or p.stem
    rep: dict = {"site": site, "config": str(p), "errors": [], "warnings": []}
    try:
        cfg = load_site_config(site, p)
    except SiteConfigError as e:
        rep["errors"].append(str(e))
        rep["bad_config"] = True
        return rep
    labels = cfg["data"]["labels"]
    names = CLASS_NAMES[labels]
    rep.update(labels=labels, class_names=names, manifest=cfg["data"]["manifest"], input_size=cfg["input_size"],
               batch_size=cfg["batch_size"], amp=cfg["amp"], threads=cfg["threads"],
               augment_config=cfg["augment_classes"])
    _check_model(cfg, rep)
    _check_device(cfg, rep)
    rows = _read_manifest(cfg, rep)
    if rows is None:
        return rep
    _count(rows, names, rep, cfg)
    _check_dp_budget(cfg, rep)
    if read_images:
        _read_all(rows, cfg, rep, workers or int(cfg["threads"]))
        _metadata_check(rows, rep)
    else:
        _check_exist(rows, rep, workers or int(cfg["threads"]))
    if cfg.get("deployed_model") and read_images:  # the files the isolated read accepted: none can crash it here
        bad = {b["path"] for b in rep["unreadable"]}
        population_check(cfg["deployed_model"], [r["path"] for r in rows if r["path"] not in bad], rep)
    elif cfg.get("deployed_model"):  # no images read: no population check, but a file it cannot read is named
        _check_model_file(cfg["deployed_model"], rep)
    return rep


def _check_model_file(model_file: str, rep: dict) -> None:
    """One warning naming ``model_file`` when it is missing or not a cxr-hfl model file."""
    from hfl_components.models import load_model_file

    try:
        load_model_file(model_file)
    except (ValueError, OSError) as e:
        rep["warnings"].append(f"deployed_model {model_file}: cannot be read: {e}")


def population_check(model_file: str, files: list, rep: dict) -> None:
    """The site's images against the training population of the deployed model the config names
    (:func:`nvflare_jobs.evaluation.population.check_files`, batch level; per-image flags counted only): one warning
    line when they differ, ``rep["population"]`` the outcome. A model file without a reference, or one that cannot be
    read, is one warning line naming the file."""
    from hfl_components.models import load_model_file
    from nvflare_jobs.evaluation.population import check_files

    try:
        model, header = load_model_file(model_file)
    except (ValueError, OSError) as e:
        rep["warnings"].append(f"deployed_model {model_file}: cannot be read, no population check: {e}")
        return
    ref = header.get("population")
    if not ref:
        rep["warnings"].append(f"deployed_model {model_file}: records no training population; no population check")
        return
    res = check_files(files, ref, model=model, size=int(header.get("input_size") or 64), aspect=header.get("aspect"))
    rep["population"] = {k: res.get(k) for k in ("warn", "line", "checked", "flags", "n_unreadable")}
    if res.get("warn"):
        rep["warnings"].append(f"population shift against {model_file}: {res.get('line')}")


def _check_exist(rows: list[dict], rep: dict, workers: int) -> None:
    """Without decoding: the rows whose file does not exist (one stat each), in ``rep["missing"]`` and as one
    error, as a job would fail at this site on them."""
    with ThreadPoolExecutor(max_workers=max(1, workers)) as ex:
        exists = list(ex.map(lambda r: os.path.isfile(r["path"]), rows))
    bad = [{"line": r["line"], "path": r["path"], "split": r["split"],
            "reason": "a folder, not a file" if os.path.isdir(r["path"]) else "no such file"}
           for r, ok in zip(rows, exists) if not ok]
    rep["missing"] = bad
    if bad:
        rep["errors"].append(f"{len(bad)} of {len(rows)} image files do not exist (a job would fail at this site)")


def _metadata_check(rows: list[dict], rep: dict) -> None:
    """Warn when file-level facts alone predict the training labels (cross-validated AUC >= WARN_AUC,
    :mod:`hfl_components.audit.metadata`); ``rep["metadata"]`` keeps the AUC, its CI and the features (counts and
    feature names only)."""
    from chest_xray.file_facts import facts_for
    from hfl_components.audit.metadata import WARN_AUC, metadata_baseline

    train = [r for r in rows if r["split"] == "train"]
    facts, _ = facts_for([r["path"] for r in train])
    keep = [(f, int(r["label"] > 0)) for f, r in zip(facts, train) if f is not None]
    if min(sum(y for _, y in keep), sum(1 - y for _, y in keep)) < METADATA_MIN_PER_CLASS:
        return  # too few training images of a class for a cross-validated AUC worth a warning
    mb = metadata_baseline([f for f, _ in keep], [y for _, y in keep], n_boot=200)
    rep["metadata"] = {k: mb[k] for k in ("auc", "ci_low", "ci_high", "n", "features", "fact_aucs", "skipped")}
    if mb["auc"] is not None and mb["auc"] >= WARN_AUC:
        top = ", ".join(f"{k} {v:.2f}" for k, v in list(mb["fact_aucs"].items())[:3])
        rep["warnings"].append(f"file facts alone predict the training labels: cross-validated AUC {mb['auc']:.2f} "
                               f"[{mb['ci_low']:.2f}, {mb['ci_high']:.2f}] on {mb['n']} images (strongest: {top}); "
                               "a model may learn the acquisition, not the lungs")


def _check_model(cfg: dict, rep: dict) -> None:
    from hfl_components.models import build_model

    rep["model"] = {k: v for k, v in cfg["model"].items()}
    try:
        m = build_model(cfg["model"])
        rep["n_params"] = int(sum(t.numel() for t in m.parameters()))
        if cfg.get("dp"):  # whether DP-SGD trains this model as it is, after Opacus's fix, or not at all
            from hfl_components.privacy import compatibility_report

            rep["dp"] = f"epsilon {cfg['dp']['epsilon']}; {compatibility_report(m, int(cfg['input_size']))}"
    except Exception as e:  # noqa: BLE001 - reported, the check goes on
        rep["errors"].append(f"config {cfg['config_path']} key 'model': cannot build {cfg['model']}: {e}")


def _check_dp_budget(cfg: dict, rep: dict) -> None:
    """Under ``dp``: the budget a job would refuse before training (no training images, a batch above them,
    ``delta >= 1/n``, an epsilon out of reach), checked at one epoch over the training images a job uses (the
    least any job trains: a budget refused here is refused by every job), as one error naming the site."""
    if not cfg.get("dp"):
        return
    from hfl_components.privacy import DPBudgetError, DPSpec, check_budget

    n = sum(rep["counts"]["train"].values())
    if cfg.get("max_train_images"):
        n = min(n, int(cfg["max_train_images"]))
    try:
        check_budget(n, int(cfg["batch_size"]), 1, DPSpec.from_config(cfg["dp"], rep["site"], cfg["config_path"]),
                     rep["site"])
    except DPBudgetError as e:
        rep["errors"].append(str(e))


def _check_device(cfg: dict, rep: dict) -> None:
    from hfl_components.training.device import describe_device, resolve_device

    try:
        rep["device"] = describe_device(resolve_device(cfg["device"]))
    except ValueError as e:
        rep["device"] = f"{cfg['device']} (unavailable)"
        rep["errors"].append(f"config {cfg['config_path']} key 'device': {e}")


def _read_manifest(cfg: dict, rep: dict):
    from chest_xray import read_site_manifest

    man = cfg["data"]["manifest"]
    try:
        rows = read_site_manifest(man)
    except (OSError, ValueError) as e:
        rep["errors"].append(f"config {cfg['config_path']} key 'data.manifest': {e}")
        rep["bad_config"] = True
        return None
    for i, r in enumerate(rows):
        r["line"] = i + 2  # 1-based CSV line, the header is line 1
    ncls = len(rep["class_names"])
    bad = [r for r in rows if not 0 <= r["label"] < ncls]
    if bad:
        rep["errors"].append(f"manifest {man} line {bad[0]['line']}: label {bad[0]['label']} is outside 0..{ncls - 1} "
                             f"for labels {rep['labels']} ({len(bad)} such rows)")
    other = sorted({r["split"] for r in rows} - set(SPLITS))
    if other:
        rep["warnings"].append(f"manifest {man}: rows with split {other} are never used (splits: {', '.join(SPLITS)})")
    return rows


def _count(rows: list[dict], names: list[str], rep: dict, cfg: dict) -> None:
    from chest_xray.io import patient_id_key  # ids differing only in case / whitespace: one patient

    man = cfg["data"]["manifest"]
    counts = {sp: {n: sum(1 for r in rows if r["split"] == sp and r["label"] == k) for k, n in enumerate(names)}
              for sp in SPLITS}
    rep["counts"] = counts
    rep["n_images"] = len(rows)
    rep["n_patients"] = len({patient_id_key(r["patient_id"]) for r in rows if r.get("patient_id")})
    for sp in SPLITS:
        n = sum(counts[sp].values())
        if n == 0:
            rep["errors"].append(f"manifest {man}: the {sp} split is empty (every job trains, validates and tests)")
        elif sum(1 for v in counts[sp].values() if v) == 1:
            rep["warnings"].append(f"the {sp} split holds a single class ({next(k for k, v in counts[sp].items() if v)})"
                                   + ("; a model trained on it predicts that class for everything" if sp == "train"
                                      else "; AUC is undefined there"))
    by_patient: dict[str, set] = {}
    for r in rows:
        if r.get("patient_id"):
            by_patient.setdefault(patient_id_key(r["patient_id"]), set()).add(r["split"])
    leak = sum(1 for s in by_patient.values() if len(s & set(SPLITS)) > 1)
    if leak:
        rep["warnings"].append(f"{leak} patients have images in more than one split (test results would be optimistic)")
    from chest_xray import resolve_augment_classes
    from chest_xray.transforms import BORDER_AUGMENTS

    aug = resolve_augment_classes(cfg["augment_classes"], [r for r in rows if r["split"] == "train"], len(names))
    rep["augment_classes"] = [names[k] for k in aug]
    # a frame augmentation (border ... zoom_out) acts on every class whatever augment_classes says
    rep["frame_augment"] = cfg["augment"] if cfg["augment"] in BORDER_AUGMENTS else None
    cap = cfg.get("max_train_images")
    if cap and cap < sum(counts["train"].values()):
        rep["warnings"].append(f"max_train_images: {cap}: jobs train on {cap} of the "
                               f"{sum(counts['train'].values())} training images")


def _read_one(row: dict, size: int):
    """``(row, meta with the near-duplicate signature, None)`` or ``(row, None, reason)``: one file read (a worker
    process's task, :func:`chest_xray.io.worker.map_isolated`)."""
    from chest_xray import ImageReadError, read_image
    from chest_xray.grouping import near_duplicate_signature

    try:
        img, meta = read_image(row["path"], target_size=size)
        meta["signature"] = near_duplicate_signature(img)  # for the near-duplicate finding
        return row, meta, None
    except ImageReadError as e:
        return row, None, e.reason
    except Exception as e:  # noqa: BLE001 - any decoder failure is a finding, not a crash of the check
        return row, None, f"{type(e).__name__}: {e}"


def _read_all(rows: list[dict], cfg: dict, rep: dict, workers: int) -> None:
    from functools import partial

    from chest_xray.io.worker import Crash, map_isolated

    # the decoders run in worker processes: a file that crashes or hangs one is an unreadable file, not a dead check
    size = int(cfg["input_size"])
    out = map_isolated(partial(_read_one, size=size), rows, max(1, workers))
    results = [(row, None, r.reason) if isinstance(r, Crash) else r for row, r in zip(rows, out)]
    bad, formats, ws, hs = [], {}, [], []
    for row, meta, reason in results:
        if reason is not None:
            bad.append({"line": row["line"], "path": row["path"], "split": row["split"], "reason": reason})
            continue
        formats[meta.get("format", "?")] = formats.get(meta.get("format", "?"), 0) + 1
        ws.append(int(meta.get("original_width", meta.get("width", 0))))
        hs.append(int(meta.get("original_height", meta.get("height", 0))))
    rep["unreadable"] = bad
    rep["formats"] = dict(sorted(formats.items()))
    rep["findings"] = _findings(rows, [m for _, m, _ in results], cfg)
    from chest_xray.grouping import note_findings
    from chest_xray.screening import dicom_manifest_screen  # For Processing, laterals, other body parts

    warns, notes = dicom_manifest_screen([r["path"] for r in rows], [m for _, m, _ in results],
                                         cfg["keep_for_processing"], cfg["skip_other_body_parts"])
    rep["warnings"] += warns
    rep["findings"] += note_findings(notes)

    def stats(v):
        return {"min": int(min(v)), "median": float(np.median(v)), "max": int(max(v))} if v else None

    rep["resolution"] = {"width": stats(ws), "height": stats(hs)}
    rep["smaller_than_input"] = int(sum(1 for w, h in zip(ws, hs) if min(w, h) < size))
    if bad:
        rep["errors"].append(f"{len(bad)} of {len(rows)} images cannot be read (a job would fail at this site)")
    if rep["smaller_than_input"]:
        rep["warnings"].append(f"{rep['smaller_than_input']} images are smaller than the input size {size} px "
                               "(they are upsampled)")


def _findings(rows: list[dict], metas: list, cfg: dict) -> list[dict]:
    """The manifest's data findings (duplicates, untrusted patient ids, grey-scale rules applied), plus the files
    the scan skipped when the manifest sits in a partition folder (``OUT/sites/<site>.csv`` beside
    ``OUT/scan_report.json``). See :func:`chest_xray.grouping.site_findings`."""
    import json

    from chest_xray.grouping import site_findings

    scan = Path(cfg["data"]["manifest"]).resolve().parent.parent / "scan_report.json"
    try:
        report = json.loads(scan.read_text()) if scan.is_file() else None
    except (OSError, ValueError):
        report = None
    return site_findings(rows, metas, report)


def format_report(rep: dict) -> str:
    """One screen of text for a :func:`check_site` result (counts, sizes, model, device, problems); every line that
    may hold a file name is escaped to one line (:func:`chest_xray.io.printable`)."""
    from chest_xray.io import printable

    out = [f"cxr-hfl site check: site {rep['site']} (config {rep['config']})"]
    if "counts" in rep or "model" in rep:
        if "manifest" in rep:
            pat = f", {rep['n_patients']} patients" if rep.get("n_patients") else ""
            out.append(f"  manifest    {rep['manifest']}: {rep.get('n_images', '?')} images{pat}, labels {rep['labels']}")
        if "counts" in rep:
            names = rep["class_names"]
            w = max(9, *(len(n) + 1 for n in names))
            out.append("  " + f"{'split':<10}" + "".join(f"{n:>{w}}" for n in names) + f"{'total':>8}")
            for sp, c in rep["counts"].items():
                out.append("  " + f"{sp:<10}" + "".join(f"{c[n]:>{w}}" for n in names) + f"{sum(c.values()):>8}")
        if "augment_classes" in rep:
            aug = ", ".join(rep["augment_classes"]) or "none"
            frame = (f"; augment: {rep['frame_augment']} frames the training images of every class"
                     if rep.get("frame_augment") else "")
            out.append(f"  augment     training images of {aug} (augment_classes: {rep['augment_config']}){frame}")
        if "unreadable" in rep:
            n_ok = rep["n_images"] - len(rep["unreadable"])
            fm = ", ".join(f"{k} {v}" for k, v in rep["formats"].items()) or "none"
            out.append(f"  images      {n_ok} read, {len(rep['unreadable'])} unreadable ({fm})")
            r = rep.get("resolution") or {}
            if r.get("width"):
                out.append(f"  resolution  width {r['width']['min']}-{r['width']['max']} px (median "
                           f"{r['width']['median']:.0f}), height {r['height']['min']}-{r['height']['max']} px "
                           f"(median {r['height']['median']:.0f})")
        if "missing" in rep:
            out.append(f"  images      {rep['n_images'] - len(rep['missing'])} found, {len(rep['missing'])} missing "
                       "(not decoded: --no-images)")
        if "model" in rep:
            spec = rep["model"]
            desc = "/".join(str(spec[k]) for k in ("family", "depth") if k in spec)
            extra = ", ".join(f"{k} {spec[k]}" for k in ("width", "feature_dim") if k in spec)
            npar = f", {rep['n_params'] / 1e6:.2f} M parameters" if rep.get("n_params") else ""
            out.append(f"  model       {desc} ({extra}){npar}; input {rep['input_size']} x {rep['input_size']} px, "
                       f"batch {rep['batch_size']}")
        if "dp" in rep:
            out.append(f"  dp          {rep['dp']}")
        if "device" in rep:
            out.append(f"  device      {rep['device']}; mixed precision {'on' if rep.get('amp') else 'off'}; "
                       f"{rep.get('threads', 1)} CPU threads")
    bad = rep.get("unreadable") or rep.get("missing") or []
    if bad:
        out.append(f"  {'unreadable' if rep.get('unreadable') else 'missing'} files (manifest line: file: reason):")
        for b in bad[:MAX_LISTED]:
            out.append(printable(f"    line {b['line']}: {b['path']}: {b['reason']}"))
        if len(bad) > MAX_LISTED:
            out.append(f"    ... and {len(bad) - MAX_LISTED} more (cxr-hfl site check --json FILE lists all)")
    for f in rep.get("findings") or ():  # one line per finding: counts, example file names, no patient field
        out.append(printable(f"  finding: {f['text']}"))
    for w in rep["warnings"]:
        out.append(printable(f"  warning: {w}"))
    for e in rep["errors"]:
        out.append(printable(f"  ERROR: {e}"))
    out.append(f"  result: {'FAILED' if rep['errors'] else 'OK'} ({len(rep['errors'])} errors, "
               f"{len(rep['warnings'])} warnings)")
    return "\n".join(out)
