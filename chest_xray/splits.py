"""Fixed, committed parts of the shared ``chest_xray_224`` pool: probe / tuning / evaluation.

The 2,770 images of ``chest_xray_224`` (patient-disjoint from ``chest_xray_original``) play three roles, and no image
plays two:

- ``probe`` (320 images): the only images an OHFL server may use as its unlabelled public probe (CKA, ``acts``
  ground metric, activation repair). Never scored.
- ``tuning``: the only labelled images on which defaults (fusion levers, learning rates, epochs) may be chosen.
- ``evaluation``: the external evaluation part. Nothing is tuned on it; the README's and results files' headline
  numbers are measured on it.

The parts are patient-grouped (all images of a patient in one part) and stratified by subtype (NORMAL / bacteria /
virus); they were drawn once with ``python -m chest_xray.splits --make ROOT`` (seed 0) from the file names alone and
are committed as CSV file lists (``chest_xray/splits/chest_xray_224_<part>.csv``, paths relative to the
``chest_xray_224`` root), so every session and every hospital sees the same parts.
"""
from __future__ import annotations

import csv
import random
from pathlib import Path

PARTS = ("probe", "tuning", "evaluation")
POOL = "chest_xray_224"
_DIR = Path(__file__).with_name("splits")
PROBE_SIZE = 320
TUNING_FRACTION = 0.30  # of what is left after the probe


def split_csv(part: str, pool: str = POOL) -> Path:
    """Path of the committed CSV file list of ``part`` (one of ``PARTS``).

    Raises:
        ValueError: unknown part. FileNotFoundError: no committed list for ``pool``.
    """
    if part not in PARTS:
        raise ValueError(f"unknown split part {part!r}; choose one of {', '.join(PARTS)}")
    p = _DIR / f"{pool}_{part}.csv"
    if not p.is_file():
        raise FileNotFoundError(f"no committed {part} list for pool {pool!r} (expected {p})")
    return p


def split_rows(part: str, pool: str = POOL) -> list[dict[str, str]]:
    """Rows (``path``, ``label``, ``subtype``, ``patient_id``) of a committed part; ``path`` relative to the pool root."""
    with split_csv(part, pool).open(newline="") as f:
        return list(csv.DictReader(f))


def split_files(part: str, root: str | Path, pool: str = POOL) -> list[Path]:
    """Absolute paths of a part's images under the pool root ``root`` (e.g. ``../shared/data/chest_xray_224``).

    Raises:
        FileNotFoundError: ``root`` does not exist.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{pool} root {root} does not exist")
    return [(root / r["path"]).resolve() for r in split_rows(part, pool)]


TRAINING_PARTS = ("tuning", "probe")  # the labelled images a site may train on; never ``evaluation``


def write_pool_csv(parts: tuple[str, ...] | list[str], root: str | Path, out_csv: str | Path,
                   pool: str = POOL, extra_roots: tuple | list = ()) -> Path:
    """Write the images of committed ``parts`` as one manifest CSV (``path`` absolute, ``label``, ``patient_id``)
    that :func:`chest_xray.scan_dataset` reads like a data root.

    The prototype methods (FedSAF / FedProto / FedTopo) build their simulated sites from
    ``TRAINING_PARTS`` of ``chest_xray_224`` (1,055 images): the ``evaluation`` part is then never trained on and
    stays the external test set. ``extra_roots``: further data roots (e.g. the patient-disjoint
    ``chest_xray_original``) whose every image is appended (path, label, patient id from
    :func:`chest_xray.scan_dataset`); a root that holds an image of ``pool`` (same file name) is refused, so the
    evaluation part cannot come back through it. Raises ValueError when ``parts`` holds ``evaluation`` or an unknown
    part or an extra root overlaps the pool, and FileNotFoundError when ``root`` (or an extra root) does not exist;
    on any error ``out_csv`` is left as it was (written to ``<out_csv>.part`` and renamed when complete).
    """
    parts = list(parts)
    if "evaluation" in parts:
        raise ValueError("the evaluation part is never trained on; build sites from tuning/probe only")
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{pool} root {root} does not exist")
    extra_rows = []  # every extra root is scanned and checked before anything is written
    if extra_roots:
        from chest_xray.dataset import scan_dataset

        pool_names = {Path(r["path"]).name.lower() for part in PARTS for r in split_rows(part, pool)}
        for extra in extra_roots:
            if not Path(extra).exists():
                raise FileNotFoundError(f"extra data root {extra} does not exist")
            records, rep = scan_dataset(extra, labels="binary", verify=False)
            clash = [r["path"] for r in records if Path(r["path"]).name.lower() in pool_names]
            if clash:
                raise ValueError(f"extra data root {extra} holds {len(clash)} image(s) of the {pool} pool "
                                 f"(first: {clash[0]}); refusing to mix them into the training pool")
            names = rep["class_names"]
            extra_rows += [[str(Path(r["path"]).resolve()), names[r["label"]], r["patient_id"]] for r in records]
    out = Path(out_csv)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    with tmp.open("w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["path", "label", "patient_id"])
        for part in parts:
            for r in split_rows(part, pool):
                w.writerow([str((root / r["path"]).resolve()), r["label"], r["patient_id"]])
        w.writerows(extra_rows)
    tmp.replace(out)
    return out


def part_of(path: str | Path, pool: str = POOL) -> str | None:
    """Which committed part an image of the pool belongs to, by its file name (``None``: not in the pool)."""
    name = Path(path).name.lower()
    for part in PARTS:
        if name in {Path(r["path"]).name.lower() for r in split_rows(part, pool)}:
            return part
    return None


def parts_under(root: str | Path, pool: str = POOL, sample: int = 20) -> list[str]:
    """The committed parts (in ``PARTS`` order) of which the folder ``root`` holds images, looked up by each part's
    first ``sample`` paths relative to the pool root. Two or more: ``root`` is the pool root (or a copy of it), whose
    parts must be chosen one at a time. A missing folder or a file gives ``[]``."""
    root = Path(root)
    if not root.is_dir():
        return []
    return [p for p in PARTS if any((root / r["path"]).is_file() for r in split_rows(p, pool)[:sample])]


def make_splits(manifest_csv: str | Path, seed: int = 0) -> dict[str, list[dict[str, str]]]:
    """Draw the three parts from the pool's provenance MANIFEST.csv (patient-grouped, stratified by subtype)."""
    with open(manifest_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    by_patient: dict[str, list[dict[str, str]]] = {}
    for r in rows:
        by_patient.setdefault(r["patient_id"], []).append(r)
    strata: dict[str, list[str]] = {}
    for pid, rs in sorted(by_patient.items()):
        strata.setdefault(rs[0]["subtype"], []).append(pid)
    rng = random.Random(seed)
    out: dict[str, list[dict[str, str]]] = {p: [] for p in PARTS}
    n_total = len(rows)
    for subtype, pids in sorted(strata.items()):
        rng.shuffle(pids)
        n_sub = sum(len(by_patient[p]) for p in pids)
        want_probe = round(PROBE_SIZE * n_sub / n_total)
        want_tune = round(TUNING_FRACTION * (n_sub - want_probe))
        got = {"probe": 0, "tuning": 0}
        for pid in pids:
            part = ("probe" if got["probe"] < want_probe else "tuning" if got["tuning"] < want_tune else "evaluation")
            if part in got:
                got[part] += len(by_patient[pid])
            for r in by_patient[pid]:
                out[part].append({"path": r["relative_path"], "label": r["label"], "subtype": r["subtype"],
                                  "patient_id": r["patient_id"]})
    return {p: sorted(v, key=lambda r: r["path"]) for p, v in out.items()}


def write_splits(root: str | Path) -> None:  # pragma: no cover - the one-time maker of the committed lists
    """Write the committed part lists from the ``chest_xray_224`` root ``root`` (holding MANIFEST.csv)."""
    parts = make_splits(Path(root) / "MANIFEST.csv")
    _DIR.mkdir(exist_ok=True)
    for part, rows in parts.items():
        with (_DIR / f"{POOL}_{part}.csv").open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["path", "label", "subtype", "patient_id"], lineterminator="\n")
            w.writeheader()
            w.writerows(rows)
        print(f"{part}: {len(rows)} images")


if __name__ == "__main__":  # python -m chest_xray.splits --make ROOT
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--make", required=True, help="the chest_xray_224 root (holding MANIFEST.csv)")
    write_splits(ap.parse_args().make)
