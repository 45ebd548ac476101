"""The border study's probe and summary (``studies/border/RESULTS.md``): measurements 1-4 of every deployed model of
a comparison folder (one arm), written per model and summarised per seed.

For every ``SEED/ohfl`` run of the folder and every deployed model ``RUN/models/<site>_deployed.pt``, through the
model's own evaluation pipeline (its input size and aspect, :func:`nvflare_jobs.evaluation.model_aspect`; the
product's :func:`hfl_components.training.predict_proba`):

1. border change on the raw pipeline: ``build_transforms(size, "eval", aspect=..., raw_band=(0.06, v))`` for
   v = 0 / 0.5 / 1 (black / grey / white in the image's own grey scale), change = mean over images of
   p(PNEUMONIA | banded) - p(PNEUMONIA | original) with a 95 % percentile-bootstrap CI
   (:func:`hfl_components.audit.intervals.mean_ci`, 1,000 draws, seed 0), on the committed ``tuning`` part of
   ``chest_xray_224`` and on the site's own test split; ``within`` when every |change| <= 0.05;
2. the model's AUC on the tuning part;
3. the metadata baseline on the tuning part's file facts (:func:`hfl_components.audit.metadata.metadata_baseline`)
   and the margin of the seed's mean tuning AUC over it;
4. the pooled AUC and balanced accuracy of the deployed models on their own test splits, and the aspect probe there
   (p(PNEUMONIA) change when a model sees the other squaring: ``crop`` for a ``stretch`` model and vice versa).

Outputs under ``--out`` (paths in them relative to the data root, never absolute):
``seed<k>/<arm>/<site>.json`` per model and ``seed<k>/summary.csv`` (one row per arm, rows of other arms kept).
``--decide`` applies the rule's eligibility criteria (a)-(c) and its choice to the summaries of seeds 0-2.

``python -m studies.border.measure runs/border_default --arm default --data-root ../shared/data --out
studies/border/results``
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import numpy as np

FRACTION = 0.06
COLOURS = {"black": 0.0, "grey": 0.5, "white": 1.0}
TOLERANCE = 0.05
POOL = "chest_xray_224"
SUMMARY_COLUMNS = ["arm", "seed", "n_models", "n_within", "all_within", "worst_change", "mean_tuning_auc",
                   "metadata_auc", "margin", "own_test_auc", "own_test_bal_acc", "own_test_n",
                   "aspect_abs_dp_own_test"]


def p_positive(model, rows: list[dict], size: int, aspect: str, band: float | None = None,
               fraction: float = FRACTION, batch_size: int = 64) -> np.ndarray:
    """p(positive) of ``model`` on ``rows`` (``path``, int ``label``) through the evaluation pipeline at ``size`` and
    ``aspect``; ``band`` = v in [0, 1]: a band of ``fraction`` of each side on all four sides of the decoded image
    (``build_transforms(raw_band=(fraction, v))``). Returns (N,) float64: 1 - p(class 0) (a subtype model's
    pneumonia classes summed)."""
    import torch
    from monai.data import Dataset

    from chest_xray.transforms import build_transforms
    from hfl_components.training import predict_proba

    key = (tuple(str(r["path"]) for r in rows), int(size), aspect, band, fraction)
    if key not in _TENSORS:  # decoded once per image set, size, aspect and band; every model of that size reuses it
        tf = build_transforms(size, "eval", aspect=aspect, raw_band=None if band is None else (fraction, band))
        data = [{"image": str(r["path"]), "label": int(r["label"])} for r in rows]
        xs = [b["image"] for b in torch.utils.data.DataLoader(Dataset(data, tf), batch_size=batch_size,
                                                               shuffle=False, num_workers=0)]
        _TENSORS[key] = torch.cat(xs) if xs else torch.zeros(0, 1, size, size)
    x = _TENSORS[key]
    loader = [(x[i:i + batch_size], torch.zeros(len(x[i:i + batch_size]), dtype=torch.long))
              for i in range(0, len(x), batch_size)]
    p, _ = predict_proba(model, loader)
    return 1.0 - p[:, 0] if len(p) else np.zeros(0)


_TENSORS: dict = {}


def band_changes(model, rows: list[dict], size: int, aspect: str, p_orig: np.ndarray | None = None) -> dict:
    """Measurement 1 on one image set: per colour of :data:`COLOURS` the :func:`mean_ci` of p(banded) - p(original)
    over the images (``{"mean", "ci_low", "ci_high", "n"}``), plus ``within`` (every |mean| <= 0.05) and
    ``worst`` (the change of largest magnitude)."""
    from hfl_components.audit.intervals import mean_ci

    if p_orig is None:
        p_orig = p_positive(model, rows, size, aspect)
    out: dict = {}
    for name, v in COLOURS.items():
        out[name] = mean_ci(p_positive(model, rows, size, aspect, band=v) - p_orig, n_boot=1000, seed=0)
    means = [out[c]["mean"] for c in COLOURS]
    out["worst"] = float(max(means, key=abs))
    out["within"] = bool(all(abs(m) <= TOLERANCE for m in means))
    return out


def _auc(y, s) -> float | None:
    from sklearn.metrics import roc_auc_score

    y = np.asarray(y).astype(int)
    return float(roc_auc_score(y, s)) if 0 < y.sum() < y.size else None


def _bal_acc(y, s) -> float | None:
    y = np.asarray(y).astype(int)
    pred = np.asarray(s) >= 0.5  # argmax of a binary model
    if not 0 < y.sum() < y.size:
        return None
    return float((pred[y == 1].mean() + (~pred[y == 0]).mean()) / 2)


def tuning_rows(data_root: Path) -> list[dict]:
    """The committed tuning part (``chest_xray.splits.split_rows``) with absolute paths and labels 0/1."""
    from chest_xray.splits import split_rows

    root = data_root / POOL
    return [{"path": str(root / r["path"]), "label": int(r["label"] != "NORMAL"), "rel": f"{POOL}/{r['path']}"}
            for r in split_rows("tuning")]


def metadata_auc(rows: list[dict]) -> dict:
    """Measurement 3's baseline: cross-validated AUC of the file facts of ``rows``."""
    from chest_xray.file_facts import facts_for
    from hfl_components.audit.metadata import metadata_baseline

    facts, problems = facts_for([r["path"] for r in rows])
    keep = [i for i, f in enumerate(facts) if f is not None]
    mb = metadata_baseline([facts[i] for i in keep], [rows[i]["label"] for i in keep], seed=0, n_boot=1000)
    return {"auc": mb["auc"], "ci_low": mb["ci_low"], "ci_high": mb["ci_high"], "n": mb["n"],
            "features": mb["features"], "unreadable": len(problems)}


def _relative(path: str, data_root: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(data_root.resolve()))
    except ValueError:
        return Path(path).name


def measure_model(run: Path, site: str, tuning: list[dict], data_root: Path) -> dict | None:
    """Measurements 1, 2 and 4 of ``RUN/models/<site>_deployed.pt`` (None when the site deployed nothing), with the
    per-image own-test p's (``own_test``: relative path, label, p) for the pooled own-test AUC."""
    from nvflare_jobs.evaluation import load_model_file, model_aspect, site_rows

    f = run / "models" / f"{site}_deployed.pt"
    if not f.is_file():
        return None
    model, blob = load_model_file(f)
    size, aspect = int(blob["input_size"]), model_aspect(blob, run)
    test = [{"path": r["path"], "label": int(int(r["label"]) > 0)} for r in site_rows(run)[site] if r["split"] == "test"]
    p_tun = p_positive(model, tuning, size, aspect)
    p_test = p_positive(model, test, size, aspect)
    alt = "crop" if aspect != "crop" else "stretch"
    y_test = [r["label"] for r in test]
    return {"site": site, "input_size": size, "aspect": aspect, "kind": blob.get("kind"),
            "tuning": {"n": len(tuning), "auc": _auc([r["label"] for r in tuning], p_tun),
                       "border": band_changes(model, tuning, size, aspect, p_tun)},
            "own_test": {"n": len(test), "auc": _auc(y_test, p_test), "bal_acc": _bal_acc(y_test, p_test),
                         "border": band_changes(model, test, size, aspect, p_test),
                         "aspect_probe": {"other": alt, "mean_change": float(np.mean(
                             p_positive(model, test, size, alt) - p_test)) if test else None},
                         "images": [[_relative(r["path"], data_root), r["label"], round(float(p), 5)]
                                    for r, p in zip(test, p_test)]},
            "within": None}


def write_outcomes(run: Path, out_dir: Path) -> dict:
    """``out_dir/acceptance.json``: each site's acceptance outcome and what it deployed (``metrics.json``), so that
    a deployed file of a refused site (``nothing deployed``: the federated weights kept without a threshold) is
    told apart; the probe measures every deployed file all the same."""
    acc = json.loads((run / "metrics.json").read_text()).get("acceptance") or {}
    res = {"line": acc.get("line"), "refusal_rate": acc.get("refusal_rate"),
           "sites": {s: {"outcome": v.get("outcome"), "deployed": v.get("deployed")}
                     for s, v in (acc.get("per_site") or {}).items()}}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "acceptance.json").write_text(json.dumps(res, indent=1))
    return res


def measure_run(run: Path, arm: str, seed: int, tuning: list[dict], meta: dict, data_root: Path,
                out_dir: Path) -> dict:
    """All deployed models of one run: per-model JSON under ``out_dir/<arm>/`` and the seed's summary row."""
    from nvflare_jobs.evaluation import site_rows

    models = {}
    write_outcomes(run, out_dir / arm)
    for site in sorted(site_rows(run)):
        m = measure_model(run, site, tuning, data_root)
        if m is None:
            print(f"[measure] {arm} seed {seed} {site}: no deployed model", flush=True)
            continue
        m["within"] = bool(m["tuning"]["border"]["within"] and m["own_test"]["border"]["within"])
        models[site] = m
        (out_dir / arm).mkdir(parents=True, exist_ok=True)
        (out_dir / arm / f"{site}.json").write_text(json.dumps({"arm": arm, "seed": seed, **m}, indent=1))
        print(f"[measure] {arm} seed {seed} {site}: tuning AUC {m['tuning']['auc']:.3f} worst change tuning "
              f"{m['tuning']['border']['worst']:+.3f} own {m['own_test']['border']['worst']:+.3f}", flush=True)
    imgs = [i for m in models.values() for i in m["own_test"]["images"]]
    y, s = [i[1] for i in imgs], [i[2] for i in imgs]
    aucs = [m["tuning"]["auc"] for m in models.values()]
    worst = [w for m in models.values() for w in (m["tuning"]["border"]["worst"], m["own_test"]["border"]["worst"])]
    mean_auc = float(np.mean(aucs)) if aucs else None
    return {"arm": arm, "seed": seed, "n_models": len(models), "n_within": sum(m["within"] for m in models.values()),
            "all_within": bool(models) and all(m["within"] for m in models.values()),
            "worst_change": float(max(worst, key=abs)) if worst else None, "mean_tuning_auc": mean_auc,
            "metadata_auc": meta["auc"], "margin": None if mean_auc is None else mean_auc - meta["auc"],
            "own_test_auc": _auc(y, s) if imgs else None, "own_test_bal_acc": _bal_acc(y, s) if imgs else None,
            "own_test_n": len(imgs),
            "aspect_abs_dp_own_test": float(np.mean([abs(m["own_test"]["aspect_probe"]["mean_change"])
                                                     for m in models.values()])) if models else None}


def write_summary(path: Path, row: dict) -> None:
    """Add or replace ``row``'s arm in the seed's ``summary.csv``."""
    rows = []
    if path.is_file():
        with path.open(newline="") as f:
            rows = [r for r in csv.DictReader(f) if r["arm"] != row["arm"]]
    rows.append({k: ("" if row.get(k) is None else row[k]) for k in SUMMARY_COLUMNS})
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=SUMMARY_COLUMNS)
        w.writeheader()
        w.writerows(sorted(rows, key=lambda r: r["arm"]))


ORDER = ["default", "border", "crop", "border_crop"]  # the tie order: stretch before crop, then no border


def decide(results: Path, seeds=(0, 1, 2)) -> dict:
    """The rule's decision from ``results/seed<k>/summary.csv``: per arm and seed the criteria (a) all within,
    (b) mean tuning AUC >= default's - 0.01, (c) margin >= 0.12; the chosen arm among the eligible (highest mean
    pooled own-test AUC, ties within 0.005 broken by :data:`ORDER`), or None. ``complete`` is False (and nothing
    is chosen) unless every arm has a row at every seed."""
    table: dict = {}
    for k in seeds:
        f = results / f"seed{k}" / "summary.csv"
        rows = {r["arm"]: r for r in csv.DictReader(f.open(newline=""))} if f.is_file() else {}
        for arm in ORDER:
            r = rows.get(arm)
            d = rows.get("default")
            if r is None or d is None:
                table.setdefault(arm, {})[k] = None
                continue
            table.setdefault(arm, {})[k] = {
                "a": r["all_within"] == "True",
                "b": float(r["mean_tuning_auc"]) >= float(d["mean_tuning_auc"]) - 0.01,
                "c": float(r["margin"]) >= 0.12, "own_test_auc": float(r["own_test_auc"])}
    complete = all(v is not None for t in table.values() for v in t.values())
    eligible = [a for a in ORDER if complete and all(v["a"] and v["b"] and v["c"] for v in table[a].values())]
    score = {a: float(np.mean([v["own_test_auc"] for v in table[a].values()])) for a in ORDER if complete}
    chosen = None
    if eligible:
        best = max(score[a] for a in eligible)
        chosen = next(a for a in ORDER if a in eligible and score[a] >= best - 0.005)
    return {"complete": complete, "criteria": table, "eligible": eligible, "own_test_auc_mean": score,
            "chosen": chosen}


def table(results: Path, seeds=(0, 1, 2)) -> str:
    """Markdown: one row per seed and arm of ``results/seed<k>/summary.csv`` with the rule's criteria (a)-(c)."""
    crit = decide(results, seeds)["criteria"]
    out = ["| seed | arm | models within +-0.05 | worst change | mean tuning AUC | metadata AUC | margin | pooled "
           "own-test AUC / bal. acc. (n) | mean abs. aspect change, own test | (a) (b) (c) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for k in seeds:
        f = results / f"seed{k}" / "summary.csv"
        rows = {r["arm"]: r for r in csv.DictReader(f.open(newline=""))} if f.is_file() else {}
        for arm in ORDER:
            r = rows.get(arm)
            if r is None:
                continue
            c = crit[arm][k]
            abc = " ".join("-" if c is None else ("yes" if c[x] else "no") for x in "abc")
            out.append(f"| {k} | {arm} | {r['n_within']} / {r['n_models']} | {float(r['worst_change']):+.3f} | "
                       f"{float(r['mean_tuning_auc']):.3f} | {float(r['metadata_auc']):.3f} | {float(r['margin']):+.3f}"
                       f" | {float(r['own_test_auc']):.3f} / {float(r['own_test_bal_acc']):.3f} ({r['own_test_n']}) | "
                       f"{float(r['aspect_abs_dp_own_test']):.3f} | {abc} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("compare", nargs="?", help="a comparison folder of one arm (SEED/ohfl runs)")
    ap.add_argument("--arm", help="the arm's name (default: the folder name without 'border_')")
    ap.add_argument("--seeds", default=None, help="comma-separated seeds to measure (default: every finished one)")
    ap.add_argument("--data-root", default="../shared/data")
    ap.add_argument("--out", default="studies/border/results")
    ap.add_argument("--outcomes-only", action="store_true", help="only write each run's acceptance.json")
    ap.add_argument("--decide", action="store_true", help="apply the rule to the summaries of seeds 0-2")
    ap.add_argument("--table", action="store_true", help="print the per-seed markdown table of the summaries")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.table:
        print(table(out))
        return 0
    if args.decide:
        print(json.dumps(decide(out), indent=1))
        return 0
    import torch

    torch.set_num_threads(1)
    folder, root = Path(args.compare), Path(args.data_root)
    arm = args.arm or folder.name.removeprefix("border_")
    want = None if args.seeds is None else {int(s) for s in args.seeds.split(",")}
    tuning = tuning_rows(root)
    meta = None
    for run in sorted(folder.glob("seed*/ohfl")):
        seed = int(run.parent.name.removeprefix("seed"))
        if (want is not None and seed not in want) or not (run / "metrics.json").is_file():
            continue
        if args.outcomes_only:
            write_outcomes(run, out / f"seed{seed}" / arm)
            continue
        meta = meta or metadata_auc(tuning)
        row = measure_run(run, arm, seed, tuning, meta, root, out / f"seed{seed}")
        (out / f"seed{seed}" / "metadata_baseline.json").write_text(json.dumps(meta, indent=1))
        write_summary(out / f"seed{seed}" / "summary.csv", row)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
