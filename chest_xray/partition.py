"""Splitting scanned records into simulated hospital sites, each with patient-grouped train/val/test splits.

Schemes:

- ``width`` (OHFL, Table 1): within each class, patients are sorted by the median width of their images and cut
  into N contiguous groups of near-equal image count; group k of every class goes to site k. Site 1 holds the
  narrowest images, site N the widest, and every site has the same class ratio.
- ``dirichlet``: per class, site proportions ~ Dir(alpha * 1_N), re-drawn until every site has at least
  ``min_per_site`` images (alpha = 0.1 strong label skew, 0.5 mild).
- ``pathological``: every site holds only ``classes_per_site`` classes (assigned round-robin over a seeded class
  order); each class is shared equally among the sites that hold it.

The unit of assignment is always the patient: a patient belongs to one site (and to one split within it). A
patient whose images carry different labels is stratified by the majority label (ties -> smaller index).
Splits are cut by image count per class; a site with at least 3 patients always gets at least one patient in val
and one in test (taken from train when the cut leaves them empty, as it does for classes with < ~10 patients);
:func:`partition_warnings` names sites with fewer than 3 patients and every empty split.
Everything is a pure function of (records, arguments, seed): the same seed gives byte-identical output files.
"""
from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ._assign import (
    assign_dirichlet,
    assign_pathological,
    assign_width,
    majority_label,
    move_to_eval_per_class,
    patients_by_id,
    probe_pool,
    split_patients,
)

SCHEMES = ("width", "dirichlet", "pathological")
SPLITS = ("train", "val", "test")
MANIFEST_COLUMNS = ("path", "label", "split", "patient_id", "width", "height")
#: Columns a site manifest must have (the others are optional when it is written by hand).
REQUIRED_MANIFEST_COLUMNS = ("path", "label", "split")


@dataclass
class PartitionResult:
    """Output of :func:`partition_records`.

    Attributes:
        scheme, seed, alpha: as requested.
        class_names: names of the label indices (``str(k)`` when not given).
        sites: ``site-1`` .. ``site-N`` -> rows (dicts with the :data:`MANIFEST_COLUMNS`), sorted by path.
        probe: probe-pool rows (``split == "probe"``), empty unless ``probe_fraction > 0``.
        params: the remaining arguments (JSON-safe), recorded in ``partition.json``.
    """

    scheme: str
    seed: int
    alpha: float
    class_names: list[str]
    sites: dict[str, list[dict[str, Any]]]
    probe: list[dict[str, Any]] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)


def partition_records(
    records: list[dict[str, Any]],
    n_sites: int,
    scheme: str,
    alpha: float = 0.5,
    seed: int = 0,
    probe_fraction: float = 0.0,
    *,
    class_names: list[str] | None = None,
    classes_per_site: int | None = None,
    min_per_site: int = 10,
    split_fractions: tuple[float, float, float] = (0.8, 0.1, 0.1),
    max_tries: int = 1000,
    min_eval_per_class: int = 0,
) -> PartitionResult:
    """Partition records into ``n_sites`` hospital sites with per-site patient-grouped 80/10/10 splits.

    Args:
        records: dicts with at least ``path``, ``label`` (int), ``patient_id``, ``width``, ``height``
            (as from :func:`chest_xray.scan_dataset`).
        n_sites: number of sites N >= 1, named ``site-1`` .. ``site-N``.
        scheme: ``"width"``, ``"dirichlet"`` or ``"pathological"`` (see the module docstring).
        alpha: Dirichlet concentration (dirichlet only); smaller = more label skew.
        seed: seeds every random choice (probe pool, Dirichlet draws, class order, splits).
        probe_fraction: fraction in [0, 1) of the images reserved, stratified by class and patient-disjoint, as a
            probe pool that belongs to no site (chosen before sites are formed).
        class_names: label names for the outputs; default ``str(k)``.
        classes_per_site: pathological only; default ``max(1, C - 1)`` (1 for binary, 2 for subtype).
        min_per_site: dirichlet only: re-draw until every site holds at least this many images.
        split_fractions: train/val/test fractions of each site's images per class (by image count, patients kept
            whole, so the fractions are approximate for small sites). A site with >= 3 patients gets at least
            one patient in each split whose fraction is non-zero (moved from train when needed).
        max_tries: dirichlet re-draw limit.
        min_eval_per_class: m >= 0; after the split, every class a site holds at least 4 m images of gets at least
            m images in val and in test, moved from train patient by patient
            (:func:`chest_xray._assign.move_to_eval_per_class`; 0, the default: no change). The prototype methods'
            comparison uses 2.

    Returns:
        a :class:`PartitionResult`.

    Raises:
        ValueError: unknown scheme, n_sites < 1, more sites than patients, bad fractions, a pathological setting
            that leaves a class with no site, or no Dirichlet draw meeting ``min_per_site`` in ``max_tries``.
    """
    _check_arguments(records, n_sites, scheme, probe_fraction, split_fractions, min_eval_per_class)
    n_classes = max(int(r["label"]) for r in records) + 1
    if class_names is not None:
        if len(class_names) < n_classes:
            raise ValueError(f"class_names {class_names} has fewer entries than the labels present ({n_classes})")
        n_classes = len(class_names)
    names = list(class_names) if class_names is not None else [str(k) for k in range(n_classes)]
    rng = np.random.default_rng(seed)
    patients = patients_by_id(records)
    plabel = {p: majority_label(rows) for p, rows in patients.items()}

    # 1. probe pool: per class, a seeded random set of patients covering ~probe_fraction of the class's images
    probe_pids = probe_pool(patients, plabel, n_classes, probe_fraction, rng)
    pool = {p: rows for p, rows in patients.items() if p not in probe_pids}
    if len(pool) < n_sites:
        raise ValueError(f"{len(pool)} patients cannot fill {n_sites} sites")

    # 2. patients -> sites
    params: dict[str, Any] = {"n_sites": n_sites, "probe_fraction": probe_fraction,
                              "split_fractions": list(split_fractions)}
    if min_eval_per_class:
        params["min_eval_per_class"] = int(min_eval_per_class)
    if scheme == "width":
        site_of = assign_width(pool, plabel, n_classes, n_sites)
    elif scheme == "dirichlet":
        site_of = assign_dirichlet(pool, plabel, n_classes, n_sites, rng, alpha, min_per_site, max_tries, params)
    else:  # pathological
        site_of = assign_pathological(pool, plabel, n_classes, n_sites, rng, classes_per_site, params)

    # 3. per-site patient-grouped stratified splits (each site its own RNG stream, so sites are independent)
    sites = _split_sites(pool, site_of, n_sites, seed, split_fractions, int(min_eval_per_class), params)
    probe = sorted((_row(r, "probe") for p in sorted(probe_pids) for r in patients[p]), key=lambda r: r["path"])
    return PartitionResult(scheme=scheme, seed=int(seed), alpha=float(alpha), class_names=names, sites=sites,
                           probe=probe, params=params)


def _check_arguments(records, n_sites, scheme, probe_fraction, split_fractions, min_eval_per_class) -> None:
    """Raise ValueError (one line) on an argument :func:`partition_records` cannot use."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown partition scheme {scheme!r}; expected one of {SCHEMES}")
    if n_sites < 1:
        raise ValueError(f"n_sites must be >= 1, got {n_sites}")
    if not 0.0 <= probe_fraction < 1.0:
        raise ValueError(f"probe_fraction must be in [0, 1), got {probe_fraction}")
    if len(split_fractions) != 3 or abs(sum(split_fractions) - 1.0) > 1e-6 or min(split_fractions) < 0:
        raise ValueError(f"split_fractions must be three non-negative numbers summing to 1, got {split_fractions}")
    if not records:
        raise ValueError("no records to partition")
    if isinstance(min_eval_per_class, bool) or not isinstance(min_eval_per_class, int) or min_eval_per_class < 0:
        raise ValueError(f"min_eval_per_class must be a non-negative integer, got {min_eval_per_class!r}")


def _split_sites(pool: dict[str, list[dict[str, Any]]], site_of: dict[str, int], n_sites: int, seed: int,
                 split_fractions: tuple[float, float, float], min_eval_per_class: int,
                 params: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Site name -> manifest rows, each site split by its own RNG stream ``[seed, site index]``."""
    sites: dict[str, list[dict[str, Any]]] = {}
    for s in range(n_sites):
        sp = {p: pool[p] for p in pool if site_of.get(p) == s}
        split = split_patients(sp, np.random.default_rng([seed, s + 1]), split_fractions)
        moved = move_to_eval_per_class(split, sp, min_eval_per_class, split_fractions)
        if moved:
            params.setdefault("eval_moves", {})[f"site-{s + 1}"] = moved
        rows = [_row(r, split[p]) for p in sp for r in sp[p]]
        sites[f"site-{s + 1}"] = sorted(rows, key=lambda r: r["path"])
    return sites


#: ``width`` scheme: warn when the middle 90% of image widths (5th-95th percentile) spans less than this fraction of
#: the median width -- the images then have (nearly) one width and the width split is arbitrary, not a resolution
#: split (e.g. chest_xray_224, all 224 px wide).
MIN_WIDTH_SPREAD = 0.05


def width_spread(widths: list[int]) -> float | None:
    """(95th - 5th percentile) / median of the widths; None when there are none."""
    if not widths:
        return None
    w = np.asarray(widths, dtype=np.float64)
    med = float(np.median(w))
    return float((np.percentile(w, 95) - np.percentile(w, 5)) / med) if med > 0 else 0.0


def partition_warnings(sites: dict[str, list[dict[str, Any]]], scheme: str | None = None) -> list[str]:
    """Human-readable warnings about a partition's sites (empty list when there is nothing to say).

    - a site with fewer than 3 patients (it cannot have a patient in each of train, val and test);
    - every empty split of every site (named: site and split);
    - ``scheme == "width"`` and the images have (nearly) the same width (see :data:`MIN_WIDTH_SPREAD`).
    """
    out: list[str] = []
    for name, rows in sites.items():
        n_pat = len({r["patient_id"] for r in rows})
        if n_pat < 3:
            out.append(f"WARNING: {name} has only {n_pat} patient(s); a site needs at least 3 for non-empty "
                       "train, val and test splits (use fewer sites or more data)")
        empty = [sp for sp in SPLITS if not any(r["split"] == sp for r in rows)]
        for sp in empty:
            out.append(f"WARNING: {name} has no {sp} images (split {sp!r} of {name} is empty; "
                       f"{len(rows)} images, {n_pat} patients in the site)")
    if scheme == "width":
        spread = width_spread([int(r["width"]) for rows in sites.values() for r in rows])
        if spread is not None and spread < MIN_WIDTH_SPREAD:
            ws = sorted({int(r["width"]) for rows in sites.values() for r in rows})
            shown = f"{ws[0]} px" if len(ws) == 1 else f"{ws[0]}-{ws[-1]} px"
            out.append(f"WARNING: --scheme width on images that (nearly) all have the same width ({shown}; "
                       f"5th-95th percentile spread {100 * spread:.1f}% of the median, under "
                       f"{100 * MIN_WIDTH_SPREAD:.0f}%): the width split is then meaningless (sites differ in no "
                       "resolution); use original-resolution images, or --scheme dirichlet/pathological")
    return out


def crossing_pairs(result: PartitionResult, pairs: list) -> list[dict[str, Any]]:
    """The near-duplicate pairs (``[path, path, similarity]``, as a scan report's ``near_pairs``) whose two images
    the partition puts in different sites, or in different splits (the probe pool counts as a site): the same
    radiograph on both sides of a split makes test results optimistic.

    Returns:
        one dict per such pair, in the order given: ``a``, ``b`` (paths), ``similarity``, ``where_a``, ``where_b``
        (``"site-1/train"``, ``"probe"``). Pairs with an image the partition does not hold are left out.
    """
    where = {r["path"]: f"{name}/{r['split']}" for name, rows in result.sites.items() for r in rows}
    where.update({r["path"]: "probe" for r in result.probe})
    out = []
    for a, b, sim in pairs:
        if a in where and b in where and where[a] != where[b]:
            out.append({"a": a, "b": b, "similarity": float(sim), "where_a": where[a], "where_b": where[b]})
    return out


def _row(r: dict[str, Any], split: str) -> dict[str, Any]:
    return {"path": str(r["path"]), "label": int(r["label"]), "split": split, "patient_id": str(r["patient_id"]),
            "width": int(r["width"]), "height": int(r["height"])}


def site_summary(rows: list[dict[str, Any]], class_names: list[str]) -> dict[str, Any]:
    """Counts and width statistics of one site's (or the probe pool's) rows.

    Returns:
        JSON-safe dict: ``n_images``, ``n_patients``, ``per_class`` (name -> images), ``per_split`` (split ->
        name -> images), ``width`` and ``height`` (``min``/``median``/``max`` in pixels; None when empty).
    """
    def stats(vals):
        if not vals:
            return {"min": None, "median": None, "max": None}
        return {"min": int(min(vals)), "median": float(np.median(vals)), "max": int(max(vals))}

    per_split: dict[str, dict[str, int]] = {}
    for sp in sorted({r["split"] for r in rows}, key=lambda x: (SPLITS + ("probe",)).index(x)
                     if x in SPLITS + ("probe",) else 99):
        per_split[sp] = {n: sum(1 for r in rows if r["split"] == sp and r["label"] == k)
                         for k, n in enumerate(class_names)}
    return {
        "n_images": len(rows),
        "n_patients": len({r["patient_id"] for r in rows}),
        "per_class": {n: sum(1 for r in rows if r["label"] == k) for k, n in enumerate(class_names)},
        "per_split": per_split,
        "width": stats([r["width"] for r in rows]),
        "height": stats([r["height"] for r in rows]),
    }


def _write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    # surrogateescape: a file name that is not UTF-8 (e.g. cp1252 from a Windows zip) is written as its exact bytes
    with open(path, "w", newline="", encoding="utf-8", errors="surrogateescape") as fh:
        w = csv.DictWriter(fh, fieldnames=list(MANIFEST_COLUMNS), lineterminator="\n")
        w.writeheader()
        for r in rows:
            w.writerow({c: r[c] for c in MANIFEST_COLUMNS})


#: Entries of a partition folder that :func:`write_partition` owns (and replaces as a whole).
PARTITION_ENTRIES = ("partition.json", "sites", "probe.csv", "scan_report.json")


def write_partition(result: PartitionResult, out_dir: str | os.PathLike, extra: dict[str, Any] | None = None,
                    *, scan_report: dict[str, Any] | None = None) -> Path:
    """Write a partition to disk, atomically: nothing half-written is ever left behind.

    Files: ``OUT/partition.json`` (scheme, seed, alpha, class names, parameters, and per site: counts per class
    and split, patients, width/height ranges), ``OUT/sites/<site>.csv`` with columns
    ``path,label,split,patient_id,width,height`` (absolute paths, sorted; UTF-8, except that a path whose name is
    not UTF-8 keeps its exact bytes), ``OUT/probe.csv`` when a probe pool exists, and ``OUT/scan_report.json``
    when ``scan_report`` is given. No timestamps are written, so the same result gives byte-identical files.

    Everything is first written into a temporary folder next to ``OUT``; only when every file is complete are the
    entries of :data:`PARTITION_ENTRIES` swapped in by rename (a whole new ``OUT`` is one rename). A failure while
    writing (e.g. a disk full, an unencodable value) leaves ``OUT`` exactly as it was. Entries of an earlier run
    that this result does not have (stale site CSVs, a probe pool) are removed; other files in ``OUT`` are kept.

    Args:
        result: from :func:`partition_records`.
        out_dir: created if missing.
        extra: additional JSON-safe fields for ``partition.json`` (e.g. data root, label scheme, scan report
            summary).
        scan_report: the scan report (from :func:`chest_xray.scan_dataset`) to write as ``scan_report.json``.

    Returns:
        the path of ``partition.json``.

    Raises:
        OSError: ``OUT`` cannot be written (``OUT`` unchanged).
    """
    import shutil
    import tempfile

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; a renamed-in OUT gets the usual permissions
    try:
        (tmp / "sites").mkdir()
        for name, rows in result.sites.items():
            _write_rows(tmp / "sites" / f"{name}.csv", rows)
        if result.probe:
            _write_rows(tmp / "probe.csv", result.probe)
        doc = {
            "scheme": result.scheme,
            "seed": result.seed,
            "alpha": result.alpha if result.scheme == "dirichlet" else None,
            "class_names": result.class_names,
            "params": result.params,
            "sites": {n: site_summary(rows, result.class_names) for n, rows in result.sites.items()},
            "probe": site_summary(result.probe, result.class_names) if result.probe else None,
        }
        if extra:
            doc.update(extra)
        (tmp / "partition.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        if scan_report is not None:
            # ensure_ascii (the default) writes a non-UTF-8 name's surrogate escapes as \\udcXX: valid JSON
            (tmp / "scan_report.json").write_text(json.dumps(scan_report, indent=2, sort_keys=True) + "\n")
        if not out.exists():
            os.rename(tmp, out)
            return out / "partition.json"
        _swap_in(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out / "partition.json"


def _swap_in(tmp: Path, out: Path) -> None:
    """Move the :data:`PARTITION_ENTRIES` of ``tmp`` into ``out`` (old ones to ``tmp/.old``, restored on error)."""
    import shutil

    old = tmp / ".old"
    old.mkdir()
    moved: list[str] = []
    try:
        for name in PARTITION_ENTRIES:
            if (out / name).exists() or (out / name).is_symlink():
                os.rename(out / name, old / name)
                moved.append(name)
        for name in PARTITION_ENTRIES:
            if (tmp / name).exists():
                os.rename(tmp / name, out / name)
    except OSError:
        for name in PARTITION_ENTRIES:  # put the earlier run back
            if (old / name).exists():
                if (out / name).is_dir():
                    shutil.rmtree(out / name)
                elif (out / name).exists():
                    (out / name).unlink()
                os.rename(old / name, out / name)
        raise


def read_site_manifest(csv_path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read a site manifest written by :func:`write_partition`.

    A hand-written manifest needs only ``path,label,split`` (:data:`REQUIRED_MANIFEST_COLUMNS`; label an integer
    index, split train / val / test in any case; a path matching a file only after Unicode normalisation is
    that file, :func:`chest_xray._manifest.match_normalised`); without ``patient_id`` the id comes from the file name
    (:func:`chest_xray.dataset.patient_id_from_name`), without ``width`` / ``height`` they are 0 (unknown).

    Returns:
        rows as dicts: ``path`` (str; a relative path is resolved against the CSV's folder), ``label`` (int),
        ``split`` (str), ``patient_id`` (str), ``width``, ``height`` (int).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a required column is missing or a value is malformed (the message names the file and line).
    """
    from ._manifest import match_normalised, read_csv_rows
    from .dataset import patient_id_from_name

    p = Path(csv_path)
    rows: list[dict[str, Any]] = []
    fields, table = read_csv_rows(p)
    missing = set(REQUIRED_MANIFEST_COLUMNS) - set(fields)
    if missing:
        raise ValueError(f"{p}: manifest lacks columns {sorted(missing)} (needs {', '.join(REQUIRED_MANIFEST_COLUMNS)}"
                         f"; optional {', '.join(c for c in MANIFEST_COLUMNS if c not in REQUIRED_MANIFEST_COLUMNS)})")
    for i, r in enumerate(table, start=2):
        try:
            path = Path(r["path"])
            if not r["path"]:
                raise ValueError("empty path")
            if not path.is_absolute():
                path = p.parent / path
            found = match_normalised(path)  # a name typed in NFC for a file written in NFD (macOS), or back
            path = found[0] if found else path
            split = r["split"].strip().lower()  # "Train" from a spreadsheet is train, never silently no split
            if split not in SPLITS + ("probe",):
                raise ValueError(f"split {r['split']!r} is not one of {', '.join(SPLITS)}")
            rows.append({"path": str(path), "label": int(r["label"]), "split": split,
                         "patient_id": r.get("patient_id") or patient_id_from_name(path),
                         "width": int(r.get("width") or 0), "height": int(r.get("height") or 0)})
        except (TypeError, ValueError) as e:
            raise ValueError(f"{p}:{i}: malformed row ({e})") from None
    return rows


def load_partition(out_dir: str | os.PathLike) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """Read ``OUT/partition.json`` and every ``OUT/sites/*.csv``.

    Returns:
        ``(info, sites)``: the JSON document and site name -> rows (sites in natural order site-1, site-2, ...).

    Raises:
        FileNotFoundError: ``out_dir`` is not a folder, or ``partition.json``, the ``sites`` folder or the manifest
            of a site that ``partition.json`` lists is missing.
        ValueError: ``partition.json`` is not JSON or not a partition document (a scheme and a list of class
            names); a manifest is malformed or holds a label outside the class names (file and line named).
    """
    out = Path(out_dir)
    if not out.is_dir():
        raise FileNotFoundError(f"{out}: not a folder" if out.exists() else f"{out}: no such folder")
    try:
        info = json.loads((out / "partition.json").read_text())
    except (ValueError, UnicodeDecodeError) as e:  # truncated or edited
        raise ValueError(f"{out / 'partition.json'}: not readable as JSON ({e})") from None
    names = info.get("class_names") if isinstance(info, dict) else None
    if (not isinstance(info, dict) or not isinstance(info.get("scheme"), str) or not isinstance(names, list)
            or not names or not all(isinstance(n, str) for n in names)):
        raise ValueError(f"{out / 'partition.json'}: not a partition document (needs a scheme and a list of "
                         "class_names)")
    files = sorted((out / "sites").glob("*.csv"), key=lambda f: (len(f.stem), f.stem))
    if not files:
        raise FileNotFoundError(f"{out / 'sites'}: no site manifests")
    listed = info.get("sites") if isinstance(info.get("sites"), dict) else {}
    if missing := [s for s in listed if not (out / "sites" / f"{s}.csv").is_file()]:
        raise FileNotFoundError(f"{out / 'sites' / (missing[0] + '.csv')}: missing (partition.json lists "
                                f"{len(missing)} site(s) without a manifest: {', '.join(missing)})")
    sites = {f.stem: read_site_manifest(f) for f in files}
    for f in files:
        for i, r in enumerate(sites[f.stem], start=2):
            if not 0 <= r["label"] < len(names):
                raise ValueError(f"{f}:{i}: label {r['label']} is not one of the {len(names)} classes {names} "
                                 "of partition.json")
    return info, sites
