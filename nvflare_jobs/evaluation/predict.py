"""Prediction on unlabelled images (``cxr-hfl predict``): :func:`predict_files`."""
from __future__ import annotations

import csv
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from chest_xray.io import SUPPORTED_SUFFIXES
from chest_xray.population import image_statistics
from chest_xray.screening import MIN_IMAGE_SIDE, screen_image
from nvflare_jobs.evaluation.run_folder import load_model_file, model_aspect
from nvflare_jobs.evaluation.population import batch_check, load_reference

def collect_files(inputs: list[str], skipped: list[dict] | None = None) -> list[Path]:
    """Files to predict on: each input is a file (any suffix: DICOM without suffix is sniffed) or a folder,
    searched recursively, following symbolic links to folders (each real folder once, as ``partition`` does), for
    .jpg/.jpeg/.png/.dcm/.dicom and for files with any other name that carry the DICOM ``DICM`` marker, as PACS
    and CD exports name them (``IM000001``, ``1.2.840.10008....``). Broken symbolic links with an image suffix are
    returned too, so that they are reported as skipped rather than silently left out.

    Args:
        skipped: when given, receives ``{"path", "reason", "kind"}`` for what the folder walk could not enter: a
            symbolic-link cycle or second link to a folder already searched, a folder that cannot be listed, a
            broken link without an image suffix, a file without a suffix that is not DICOM (operating-system junk
            folders such as ``__MACOSX``, hidden files and files with another suffix are left out silently).
    """
    from chest_xray import dir_key, walk_files
    from chest_xray.io import sniff_dicom

    def wanted(f: Path) -> bool:
        if f.suffix.lower() in SUPPORTED_SUFFIXES:
            return True
        return sniff_dicom(f)  # IM000001, or a UID name 1.2.840....1234

    out: list[Path] = []
    seen: set[tuple[int, int]] = set()
    for s in inputs:
        p = Path(s)
        if p.is_dir():
            walk_skips: list[dict] = []
            real = Path(os.path.realpath(p))  # a link up to the folder or a parent would leave the input: not followed
            blocked = {k for k in map(dir_key, [real, *real.parents]) if k}
            files = []
            for f in walk_files(p, walk_skips, seen, blocked):
                if wanted(f):
                    files.append(f)
                elif not f.suffix and not f.name.startswith(".") and skipped is not None:  # an export named IM-0001
                    skipped.append({"path": str(f), "reason": "unsupported file type (no suffix, not DICOM)",
                                    "kind": "unsupported file type"})
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
                  allow_lateral: bool = False, size: int | None = None, population=None) -> dict[str, Any]:
    """Write per-image class probabilities and the predicted class to ``out_csv``.

    Columns: ``path, status (ok|skipped), reason, p_<class>..., predicted``. A file that cannot be read is
    written with status ``skipped`` and the reason; it never stops the run. So is an image that is not a plausible
    chest radiograph: shorter side under :data:`MIN_IMAGE_SIDE` px, or colourful (see :func:`screen_image`), and
    a broken symbolic link.

    Raises:
        FileNotFoundError: no input exists. ValueError: ``out_csv`` is a folder, no image files in the inputs,
            or ``model_path`` is not a cxr-hfl model file, or a ``threshold`` for a model that is not binary (all
            checked before inference). DICOM objects that are not CR/DX/DR
    projections or are lateral views are skipped as in training (``allow_*`` to keep them). ``threshold`` (binary
    only): predict PNEUMONIA when p >= threshold; default argmax, or for a deployed model that carries a federated
    operating point (:mod:`hfl_components.operating_point`) its threshold, with the probabilities written
    calibrated by its temperature; a model whose federation set no threshold (or a legacy threshold of 0, which
    would call every image positive) gets one warning line on stderr with the reason, then argmax of the
    calibrated probabilities. Images are scored at the input size :func:`input_size_for` chooses (``size``: for a
    global model only); the result's ``input_size`` and ``size_from`` say which and why.

    Population check (:mod:`hfl_components.shift`): the images predicted are one batch, compared with the training
    population the model file records (header ``population``; ``population``: a reference dict, a JSON file of one
    or another model file instead). When they differ, one ``WARNING: population shift: ...`` line on stderr; the
    result's ``population`` holds the outcome (``warn``, ``line``, per-group scores, per-image flag counts), also
    when no reference exists (``checked`` False and why).
    """
    import torch

    from chest_xray import build_transforms, class_names, scheme_for_num_classes
    from hfl_components.training import predict_labels

    check_predict_args(inputs, out_csv)
    model, blob = load_model_file(model_path)
    size, size_from = input_size_for(Path(model_path), blob, size)
    labels = blob.get("labels") or scheme_for_num_classes(int(blob["spec"].get("num_classes", 2)))
    names = class_names(labels)
    op, threshold = _decision(model_path, blob, names, labels, threshold)
    reference = load_reference(population, blob)
    tf = build_transforms(size, "eval", aspect=model_aspect(blob, _run_of(Path(model_path))))
    pop_stats: list[np.ndarray] = []
    pop_feats: list[np.ndarray] = []
    pop_facts: list[dict] = []
    folder_skips: list[dict] = []
    files = collect_files(inputs, folder_skips)
    rows: list[dict] = []
    batch: list[tuple[int, torch.Tensor, dict]] = []

    def flush():
        if not batch:
            return
        with torch.no_grad():
            x = torch.stack([t for _, t, _ in batch])
            z = model.features(x)
            p = torch.softmax(model.head(z), dim=1).numpy().astype(np.float64)
        if reference:
            pop_stats.append(image_statistics(x))
            pop_feats.append(z.reshape(len(batch), -1).double().numpy())
            pop_facts.extend(facts for _, _, facts in batch)
        if op:
            from hfl_components.operating_point import calibrate

            p = calibrate(p, op)
        pred = predict_labels(p, threshold)
        for (i, _, _), pi, ci in zip(batch, p, pred):
            rows[i].update({f"p_{n}": round(float(v), 5) for n, v in zip(names, pi)})
            rows[i]["predicted"] = names[int(ci)]
        batch.clear()

    for f in files:
        row = {"path": str(f), "status": "ok", "reason": ""}
        rows.append(row)
        x = _read_one(f, tf, row, allow_any_modality, allow_lateral)
        if x is None:
            continue
        batch.append((len(rows) - 1, x, _facts(f) if reference else {}))
        if len(batch) >= batch_size:
            flush()
    flush()
    rows.extend({"path": e["path"], "status": "skipped", "reason": e["reason"]} for e in folder_skips)
    _write_rows(Path(out_csv), rows, ["path", "status", "reason", *[f"p_{n}" for n in names], "predicted"])
    n_ok = sum(r["status"] == "ok" for r in rows)
    pop = batch_check(reference, pop_stats, pop_facts, pop_feats)
    if pop.get("warn"):
        print(f"{pop['line']} (model {model_path})", file=sys.stderr)
    return {"n_files": len(rows), "n_ok": n_ok, "n_skipped": len(rows) - n_ok, "input_size": size,
            "size_from": size_from, "threshold": threshold, "calibrated": bool(op),
            "population": {k: pop.get(k) for k in ("checked", "warn", "line", "n", "groups", "flags")}}


def _read_one(f: Path, tf, row: dict, allow_any_modality: bool, allow_lateral: bool):
    """The transformed image of ``f``, or None with ``row`` marked skipped and the one-line reason (one bad file
    never stops the run)."""
    try:
        _screen(f, allow_any_modality, allow_lateral)
        return tf({"image": str(f), "label": 0})["image"]
    except Exception as e:  # noqa: BLE001 -- one bad file never stops the run
        cause = e
        while cause.__cause__ is not None:
            cause = cause.__cause__
        reason = getattr(cause, "reason", None) or f"{type(cause).__name__}: {cause}"
        row.update({"status": "skipped", "reason": str(reason).replace("\n", " ")[:300]})
        return None


def _facts(f: Path) -> dict:
    """:func:`chest_xray.population.population_facts` of a file that was read, or ``{}`` when its header says
    nothing more (the population check then uses its pixels only)."""
    from chest_xray.population import population_facts

    try:
        return population_facts(f)
    except Exception:  # noqa: BLE001 -- the file was decoded; a header fact missing only narrows the check
        return {}


def input_size_for(model_path: Path, header: dict, size: int | None = None) -> tuple[int, str]:
    """``(side in px, where it comes from)`` at which ``predict`` scores a model: the input size its file records
    (a site's local or deployed model, FENS's ensemble); a global model records none (it serves sites of several
    sizes), so ``size`` when given, else the largest input size of its run's sites (``RUN/resolved_configs``), as
    ``evaluate --global-sizes largest`` scores it. The global model of one architecture group of a mixed-family
    OHFL run (``RUN/global_models/<group>.pt``, listed in ``groups.json``) serves only that group's sites, so only
    their sizes count.

    Raises:
        ValueError: ``size`` differs from the size the model file records, or is not one of the input sizes the
            global model's sites trained at, or a global model without ``size`` has no run folder beside it that
            records its sites' sizes (one line naming the file and ``--size``).
    """
    own = header.get("input_size")
    if own:
        if size is not None and int(size) != int(own):
            raise ValueError(f"--size {size}: {model_path} was trained at {own} px (its file records it); --size "
                             "is for a global model, which has no input size of its own")
        return int(own), "the size the model file records"
    sizes, whose = _global_sizes(model_path)
    if size is not None:
        if sizes and int(size) not in sizes:
            raise ValueError(f"--size {size}: {model_path} serves sites that trained at {', '.join(map(str, sizes))} "
                             f"px ({whose}); give one of these")
        return int(size), "--size"
    if not sizes:
        raise ValueError(f"{model_path}: a global model has no input size of its own and no run folder beside it "
                         "records its sites' sizes; give --size (one of the input sizes its sites trained at)")
    return sizes[-1], f"global model: the largest input size of {whose} ({', '.join(map(str, sizes))} px)"


def _global_sizes(model_path: Path) -> tuple[list[int], str]:
    """``(sorted input sizes, whose)`` of the sites a global model serves: every site of its run, or for
    ``RUN/global_models/<group>[_fused].pt`` of a run with ``groups.json`` that group's sites only; ``([], "")``
    when no run folder beside the file records them."""
    from nvflare_jobs.evaluation.run_folder import run_groups, run_input_sizes, run_site_sizes

    run = _run_of(model_path)
    if run is None:
        return [], ""
    if model_path.parent.name == "global_models" and model_path.parent.parent == run:
        groups = run_groups(run)
        group = model_path.stem[:-len("_fused")] if model_path.stem.endswith("_fused") else model_path.stem
        if group in groups:
            site_sizes = run_site_sizes(run)
            sizes = sorted({site_sizes[s] for s in groups[group] if s in site_sizes})
            if sizes:
                return sizes, f"the {group} group's sites {', '.join(groups[group])}"
    return run_input_sizes(run), "its run's sites"


def _decision(model_path, blob: dict, names: list[str], labels: str, threshold: float | None):
    """``(operating point or None, threshold or None)`` of :func:`predict_files`: the given ``threshold`` (binary
    models only, else ValueError naming the file), or a deployed model's federated one (a warning line and argmax of
    the calibrated probabilities when the federation set none)."""
    if threshold is not None and len(names) != 2:
        raise ValueError(f"--threshold {threshold}: {model_path} is a {len(names)}-class ({labels}) model; a threshold "
                         "applies to binary (NORMAL / PNEUMONIA) models only")
    op = blob.get("operating_point") if len(names) == 2 else None
    if op and threshold is None:
        threshold = None if op.get("threshold") is None else float(op["threshold"])
        if threshold is None or threshold <= 0.0:  # the federation set no operating point (the reason is stored)
            why = op.get("unresolved") or "the federated threshold is 0, which would call every image PNEUMONIA"
            print(f"WARNING: {model_path}: no federated operating point ({why}); predicting at argmax of the "
                  "calibrated probabilities instead (pass --threshold to choose one)", file=sys.stderr)
            threshold = None
    return op, threshold


def _run_of(model_path: Path) -> Path | None:
    """The run folder of a model file (``RUN/global_model.pt``, ``RUN/global_models/<g>.pt``, ``RUN/models/x.pt``):
    the nearer of its folder and that folder's parent that holds ``resolved_configs/``; None elsewhere. A global
    model records no aspect of its own; as in ``evaluate``, it is squared as every site of its run was."""
    for run in (model_path.parent, model_path.parent.parent):
        if (run / "resolved_configs").is_dir():
            return run
    return None


def _screen(f: Path, allow_any_modality: bool, allow_lateral: bool) -> None:
    """Raise :class:`chest_xray.ImageReadError` for a file :func:`predict_files` skips: a broken link, a DICOM object
    the training scan would skip (not a CR/DX/DR projection, a lateral view) or too small, a JPEG/PNG that is no
    plausible chest radiograph (:func:`chest_xray.screening.screen_image`)."""
    from chest_xray import ImageReadError
    from chest_xray.io import is_dicom_file, dicom_header, dicom_skip_reason

    if f.is_symlink() and not f.exists():
        raise ImageReadError(f, f"broken symbolic link (its target {os.readlink(f)} does not exist)")
    if is_dicom_file(f) and f.is_file():  # same rule as the training scan: projection radiographs, no laterals
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


def _write_rows(out: Path, rows: list[dict], cols: list[str]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    # surrogateescape: a file name that is not UTF-8 (e.g. cp1252 from a Windows zip) is written as its exact bytes
    with out.open("w", newline="", encoding="utf-8", errors="surrogateescape") as fh:
        w = csv.DictWriter(fh, fieldnames=cols, restval="")
        w.writeheader()
        w.writerows(rows)
