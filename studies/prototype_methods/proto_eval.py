"""Site-model evaluation of the personalised methods (Local, FedProto, FedSAF, FedTopo).

Each site's deployed model is scored (a) on its own test split (the run's ``test_predictions.csv``) and (b) on the
committed ``evaluation`` part of ``chest_xray_224`` (1,715 images, never trained on: the sites are built from the
tuning + probe parts) restricted to the classes that site holds in its training split. ``comparison.md`` gets a
section with per-method means, every single-class (majority-class) site flagged, the learning-floor check, and
paired differences against Local and against FedProto with seeds as clusters
(:func:`hfl_components.stats.paired_nested`: the external images drawn once per replicate for every site, each test
split on its own) and, from :data:`hfl_components.stats.MIN_SEEDS` seeds on, verdicts; one named primary endpoint,
every other verdict exploratory.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import numpy as np

FLOOR = 0.55  # the prototype methods' learning floor: mean site balanced accuracy on 3 classes (chance 1/3)
NOTES = [
    "With 3 classes the structural terms have little to align: FedSAF's GCSA compares 3 x 3 centred Gram matrices "
    "(a site holding 2 classes contributes a single off-diagonal entry), and FedTopo's top-q keeps every negative "
    "class (q >= C - 1 = 2), so its top-q selection is inactive.",
    "Seeds are the unit of training randomness: the sites of one seed share their global prototypes and are not "
    "independent replicates. An 'inconclusive' verdict is not evidence of equality.",
]


def eval_part_tensors(cache_dir: Path, size: int, data_root: Path | None = None):
    """``(X (N, 1, S, S) float32, y (N,) int64 subtype labels, names)`` of the committed evaluation part at input
    size ``size`` (the eval transform of :func:`chest_xray.make_site_dataset`), cached in
    ``cache_dir/evaluation_part_s<S>.pt``. Raises FileNotFoundError when no ``chest_xray_224`` root is found."""
    import torch

    from chest_xray import label_index
    from chest_xray.splits import split_rows

    f = Path(cache_dir) / f"evaluation_part_s{int(size)}.pt"
    if f.is_file():
        blob = torch.load(f, weights_only=True)
        return blob["X"], blob["y"].numpy(), None
    if data_root is None:
        from nvflare_jobs.profiles import resolve_data

        data_root = resolve_data(None).parent / "chest_xray_224"
    data_root = Path(data_root)
    if not data_root.is_dir():
        raise FileNotFoundError(f"no chest_xray_224 root at {data_root} for the evaluation part")
    rows = [{"path": str(data_root / r["path"]), "label": label_index(r["label"], r["path"], "subtype")}
            for r in split_rows("evaluation")]
    X = image_tensor(rows, int(size))
    y = torch.as_tensor([r["label"] for r in rows], dtype=torch.int64)
    f.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"X": X, "y": y}, f)
    return X, y.numpy(), None


def image_tensor(rows: list[dict], size: int):
    """``X (N, 1, S, S)`` float32: the images of manifest ``rows`` (``path``, ``label``) through a site's eval
    transform at input size ``size`` (:func:`chest_xray.make_site_dataset`), in row order."""
    import torch

    from chest_xray import make_site_dataset

    ds = make_site_dataset(rows, int(size), "eval")
    return torch.stack([torch.as_tensor(ds[i]["image"]) for i in range(len(ds))])


def load_site_model(f: Path):
    """``(model in eval mode, header)`` of a site model file (``RUN/models/<site>_<kind>.pt``), current or
    pre-safetensors format. Raises ValueError (one line naming the file) for a file that is not a cxr-hfl model."""
    from nvflare_jobs.evaluation import load_model_file

    return _load_site_model(Path(f), load_model_file)


def site_train_classes(run: Path) -> dict[str, list[int]]:
    """Site -> sorted class indices present in its training split (from the run's site manifests)."""
    from nvflare_jobs.evaluation import site_rows

    return {s: sorted({int(r["label"]) for r in rows if r["split"] == "train"}) for s, rows in site_rows(run).items()}


def external_site_predictions(run: Path, cache_dir: Path, data_root: Path | None = None) -> dict[str, dict]:
    """Each deployed site model on the evaluation part restricted to the site's training classes.

    Returns ``{site: {"ids": (n,) indices into the evaluation part, "y": (n,), "probs": (n, C)}}``, cached in
    ``RUN/external_sites.npz``."""
    import torch

    from nvflare_jobs.evaluation import load_model_file

    run = Path(run)
    cache = run / "external_sites.npz"
    if cache.is_file():
        z = np.load(cache)
        sites = sorted({k.split("|")[0] for k in z.files})
        return {s: {k: z[f"{s}|{k}"] for k in ("ids", "y", "probs")} for s in sites}
    classes = site_train_classes(run)
    out: dict[str, dict] = {}
    torch.set_num_threads(1)
    for f in sorted((run / "models").glob("*_deployed.pt")):
        site = f.stem.rpartition("_")[0]
        if site not in classes:
            continue
        model, blob = _load_site_model(f, load_model_file)
        X, y, _ = eval_part_tensors(cache_dir, int(blob.get("input_size") or 64), data_root)
        ids = np.flatnonzero(np.isin(y, classes[site]))
        with torch.no_grad():
            probs = torch.cat([torch.softmax(model(X[ids[i:i + 256]]), dim=1) for i in range(0, ids.size, 256)])
        out[site] = {"ids": ids, "y": y[ids], "probs": probs.numpy().astype(np.float32)}
    np.savez_compressed(cache, **{f"{s}|{k}": v for s, d in out.items() for k, v in d.items()})
    return out


def _load_site_model(f: Path, loader):
    """``(model in eval mode, header)`` of a deployed model file; files written before the safetensors model format
    (a ``torch.save`` dict of ``spec`` / ``state_dict`` / ``input_size``) are read with ``weights_only=True`` (plain
    tensors and containers, never arbitrary unpickling)."""
    try:
        return loader(f)
    except ValueError as e:
        if "old torch.save" not in str(e):
            raise
    import torch

    from hfl_components.models import build_model

    blob = torch.load(f, map_location="cpu", weights_only=True)
    model = build_model(blob["spec"])
    model.load_state_dict(blob["state_dict"])
    model.eval()
    return model, blob


def test_site_predictions(run: Path) -> dict[str, dict]:
    """``{site: {"ids", "y", "probs"}}`` from the run's ``test_predictions.csv`` (each site's own test split)."""
    out: dict[str, dict] = {}
    f = Path(run) / "test_predictions.csv"
    if not f.is_file():
        return out
    with f.open(newline="") as fh:
        for r in csv.DictReader(fh):
            d = out.setdefault(r["site"], {"ids": [], "y": [], "probs": []})
            d["ids"].append(int(r["index"]))
            d["y"].append(int(r["label"]))
            d["probs"].append([float(v) for k, v in r.items() if k.startswith("p_")])
    return {s: {k: np.asarray(v) for k, v in d.items()} for s, d in out.items()}


def single_class(y: np.ndarray, probs: np.ndarray) -> bool:
    """True when the images hold >= 2 classes but every prediction (argmax) is one class."""
    return len(np.unique(y)) >= 2 and len(np.unique(np.asarray(probs).argmax(axis=1))) == 1


def single_class_chance(test_y: np.ndarray, ext_y: np.ndarray, ext_probs: np.ndarray) -> float | None:
    """Chance that a site model predicts one class for every image of its test split, were each test image of class
    ``c`` predicted like the model predicts the external images of class ``c``.

    With ``R[c, k]`` the fraction of the external images of class ``c`` predicted ``k`` (argmax rule) and ``n_c`` the
    test split's images of class ``c``, it is ``sum_k prod_c R[c, k] ** n_c`` (images independent). A model that
    predicts the minority class for some of the external images but whose test split holds only one or two of them
    can land on "single-class" by chance alone; a value near 1 says the test-split check could hardly come out
    otherwise for this model, a value near 0 that the single-class test outcome is unusual for it. Not part of
    the learning floor: a diagnostic printed beside each single-class flag.

    Args:
        test_y: (n,) class indices of the site's test split. ext_y: (m,) class indices of the external images
            the model was scored on. ext_probs: (m, C) its class probabilities for them.

    Predictions use the arg-max rule of :func:`single_class` (ties -> the lower class index). Assumes the site's
    test images behave like the external images of their class, independently of each other.

    Returns:
        The probability in [0, 1]; None when the test split holds fewer than 2 classes or a test class has no
        external image (no rate to use).

    Raises:
        ValueError: ``test_y`` / ``ext_y`` not 1-D; ``ext_probs`` not (m, C) with m = len(ext_y), or holding
        non-finite values; labels not integer class indices in 0..C-1; complex input.
    """
    if any(np.iscomplexobj(v) for v in (test_y, ext_y, ext_probs)):
        raise ValueError("labels and probabilities must be real numbers")
    probs = np.asarray(ext_probs, np.float64)
    if np.ndim(test_y) != 1 or np.ndim(ext_y) != 1:
        raise ValueError(f"test_y and ext_y must be 1-D, got {np.ndim(test_y)}-D and {np.ndim(ext_y)}-D")
    if probs.ndim != 2 or probs.shape[0] != len(ext_y) or probs.shape[1] < 1:
        raise ValueError(f"ext_probs must be (len(ext_y), C) with C >= 1, got shape {probs.shape} for {len(ext_y)} "
                         "labels")
    if not np.isfinite(probs).all():
        raise ValueError("ext_probs holds non-finite values")
    n_cls = probs.shape[1]
    labels = []
    for name, v in (("test_y", test_y), ("ext_y", ext_y)):
        a = np.asarray(v)
        if a.size and (not np.issubdtype(a.dtype, np.number) or not np.all(np.equal(np.round(a), a))
                       or a.min() < 0 or a.max() >= n_cls):
            raise ValueError(f"{name} must hold integer class indices in 0..{n_cls - 1}")
        labels.append(a.astype(int))
    test_y, ext_y = labels
    pred = probs.argmax(axis=1)
    classes, counts = np.unique(test_y, return_counts=True)
    if classes.size < 2:
        return None
    log_r = np.zeros((classes.size, n_cls))
    for i, c in enumerate(classes):
        sel = ext_y == c
        if not sel.any():
            return None
        with np.errstate(divide="ignore"):
            log_r[i] = counts[i] * np.log(np.bincount(pred[sel], minlength=n_cls) / sel.sum())
    return float(np.exp(log_r.sum(axis=0)).sum())


def collect(out: Path, data_root: Path | None = None) -> dict[str, Any]:
    """Per (method, seed, site) predictions on both evaluation sets for every run under ``out``."""
    from hfl_components.stats import site_metric

    res: dict[str, Any] = {}
    for f in sorted(Path(out).glob("seed*/*/metrics.json")):
        run = f.parent
        seed = int(run.parent.name.removeprefix("seed"))
        sets = {"test": test_site_predictions(run), "external": external_site_predictions(run, Path(out), data_root)}
        for name, preds in sets.items():
            for site, d in preds.items():
                res.setdefault(run.name, {}).setdefault(name, {})[(seed, site)] = dict(
                    d, balanced_accuracy=site_metric("balanced_accuracy", d["y"], d["probs"]),
                    auc=site_metric("auc", d["y"], d["probs"]), single_class=single_class(d["y"], d["probs"]))
    return res


def _fmt(v) -> str:
    return "–" if v is None or (isinstance(v, float) and np.isnan(v)) else f"{v:.3f}"


def mean_ci(values: dict) -> tuple[float, float] | None:
    """95% seed-level t-interval of the mean site metric: ``values`` ``{(seed, site): value}`` averaged within each
    seed, then over seeds (:func:`hfl_components.stats.seed_mean_interval`; the sites of a seed are not
    independent). ``(low, high)``, or None with fewer than :data:`hfl_components.stats.MIN_SEEDS` seeds (no
    reliable interval)."""
    from hfl_components.stats import seed_mean_interval

    d = seed_mean_interval(values)
    return (d["ci_low"], d["ci_high"]) if d["ci_low"] is not None else None


def _ms(v: list[float]) -> str:
    v = [x for x in v if x is not None and not np.isnan(x)]
    if not v:
        return "–"
    return f"{np.mean(v):.3f} ± {np.std(v, ddof=1):.3f}" if len(v) > 1 else f"{v[0]:.3f}"


def paired(res: dict, a: str, b: str, evalset: str, metric: str, n_boot: int = 500) -> dict[str, Any] | None:
    """Paired A - B on one evaluation set (``test`` or ``external``) over their common (seed, site) pairs
    (:func:`hfl_components.stats.paired_nested`): the external part is one image pool shared by every site and
    seed (one draw per replicate), each (seed, site) test split a pool of its own."""
    from hfl_components.stats import paired_nested

    ra, rb = res.get(a, {}).get(evalset, {}), res.get(b, {}).get(evalset, {})
    keys = sorted(set(ra) & set(rb))
    if not keys:
        return None
    pairs = []
    for s, site in keys:
        da, db = ra[(s, site)], rb[(s, site)]
        if not np.array_equal(da["ids"], db["ids"]):
            continue  # not the same images (another partition): not a pair
        pool = "evaluation" if evalset == "external" else f"{s}/{site}"
        pairs.append({"seed": s, "site": site, "pool": pool, "ids": da["ids"], "y": da["y"], "pa": da["probs"],
                      "pb": db["probs"]})
    return paired_nested(pairs, metric, n_boot=n_boot, seed=0) if pairs else None


def section(out: Path, methods: list[str], n_boot: int = 500, data_root: Path | None = None,
            primary: tuple[str, str, str, str] | None = None) -> tuple[str, dict]:
    """Markdown section + JSON summary of the personalised-methods protocol for the runs under ``out``.
    ``primary``: the primary endpoint ``(method A, method B, "test"|"external", metric)`` (its verdict is marked
    primary, every other one exploratory); None: every verdict exploratory."""
    res = collect(out, data_root)
    methods = [m for m in methods if m in res]
    L = ["", "## Site models on their own test splits and on the external evaluation part", "",
         "Each site's deployed model, on (a) its own test split and (b) the committed `evaluation` part of "
         "`chest_xray_224` (1,715 images, patient-disjoint, never trained on) restricted to the classes that site "
         "holds in its training split. Balanced accuracy = mean recall over the classes present (argmax rule); AUC = "
         "macro one-vs-rest over the classes present. Mean ± std over (seed, site). `single-class` counts sites "
         "whose images hold >= 2 classes but whose predictions are one class (majority-class prediction). "
         f"Learning floor: mean balanced accuracy >= {FLOOR} on both sets and no single-class site.", "",
         "| method | pairs | test bal. acc. | test AUC | external bal. acc. | external AUC | single-class (test / "
         "external) | floor |", "|---|---|---|---|---|---|---|---|"]
    summary: dict[str, Any] = {"methods": {}, "paired": []}
    for m in methods:
        t, e = res[m].get("test", {}), res[m].get("external", {})
        sc_t = sum(v["single_class"] for v in t.values())
        sc_e = sum(v["single_class"] for v in e.values())
        bt = float(np.nanmean([v["balanced_accuracy"] for v in t.values()])) if t else float("nan")
        be = float(np.nanmean([v["balanced_accuracy"] for v in e.values()])) if e else float("nan")
        ok = bt >= FLOOR and be >= FLOOR and sc_t == 0
        summary["methods"][m] = {"pairs": len(t), "test_bal_acc": bt, "external_bal_acc": be,
                                 "test_bal_acc_ci": mean_ci({k: v["balanced_accuracy"] for k, v in t.items()}),
                                 "external_bal_acc_ci": mean_ci({k: v["balanced_accuracy"] for k, v in e.items()}),
                                 "test_auc": float(np.nanmean([v["auc"] for v in t.values()])) if t else None,
                                 "external_auc": float(np.nanmean([v["auc"] for v in e.values()])) if e else None,
                                 "single_class_test": sc_t, "single_class_external": sc_e, "floor_met": bool(ok)}
        L.append(f"| {m} | {len(t)} | {_ms([v['balanced_accuracy'] for v in t.values()])} | "
                 f"{_ms([v['auc'] for v in t.values()])} | {_ms([v['balanced_accuracy'] for v in e.values()])} | "
                 f"{_ms([v['auc'] for v in e.values()])} | {sc_t} / {sc_e} | {'met' if ok else 'NOT met'} |")
    flagged = [(m, s, site, k) for m in methods for k in ("test", "external")
               for (s, site), v in res[m].get(k, {}).items() if v["single_class"]]
    L += ["", "Single-class (majority-class) site models: " + (
        "none." if not flagged else "; ".join(f"**{m} seed {s} {site} ({k})**{_flag_detail(res[m], s, site, k)}"
                                               for m, s, site, k in flagged)), ""]
    if any(k == "test" for *_, k in flagged):
        L += ["For a test-split flag: the test split's images per class and P(single), the chance that the model "
              "predicts one class for the whole test split were each test image predicted like the external images "
              "of its class (`single_class_chance`; a diagnostic, not part of the floor). A high P(single) with a "
              "test split of one or two minority images says the flag is what this model gives most of the time on "
              "such a split; the external column says whether it predicts more than one class on 1,715 images.", ""]
    L += _paired_lines(res, methods, n_boot, primary, summary)
    L += ["", *[f"- {n}" for n in NOTES], ""]
    summary["rows"] = _rows(res, methods)
    return "\n".join(L), summary


def _paired_lines(res: dict, methods: list[str], n_boot: int, primary, summary: dict) -> list[str]:
    """The paired-differences table (each method against Local and against FedProto); its rows go to
    ``summary["paired"]``."""
    L: list[str] = []
    comps = [(m, "local") for m in methods if m != "local" and "local" in methods]
    comps += [(m, "fedproto") for m in methods if m not in ("fedproto", "local") and "fedproto" in methods]
    if comps:
        from hfl_components.stats import MARGINS, RULE_TEXT, endpoint_label, paired_cell, verdict_cell

        L += ["### Paired differences (A − B), seeds as clusters", "",
              "Mean over seeds of the seed's mean difference over its sites. 95% intervals, seeds − 1 degrees of "
              "freedom. External part (one image pool shared by every site and seed): cluster bootstrap-t "
              f"({n_boot} replicates: seeds resampled with their sites, one image draw within class per replicate "
              "for all), beside it the seed-level t-interval for these images only. Test splits (each seed's sites "
              "score images of their own, whose noise is inside the per-seed differences): the seed-level "
              "t-interval. Verdict: better / not worse (non-inferiority, margin "
              f"δ {MARGINS['balanced_accuracy']} balanced accuracy, {MARGINS['auc']} AUC) / worse / inconclusive. "
              + RULE_TEXT + " " + ("The primary endpoint is marked; every other verdict is exploratory (no "
                                   "multiplicity correction)." if primary else
                                   "No primary endpoint is named here: every verdict is exploratory."), "",
              "| A vs B | set | metric | pairs | A | B | Δ | verdict | endpoint |",
              "|---|---|---|---|---|---|---|---|---|"]
        for a, b in comps:
            for evalset in ("test", "external"):
                for metric in ("balanced_accuracy", "auc"):
                    d = paired(res, a, b, evalset, metric, n_boot)
                    if d is None:
                        continue
                    role = endpoint_label((a, b, evalset, metric) == primary)
                    summary["paired"].append({**d, "method_a": a, "method_b": b, "set": evalset, "endpoint": role})
                    L.append(f"| {a} vs {b} | {evalset} | {metric.replace('_', ' ')} | {d['n_pairs']} | "
                             f"{_fmt(d['a'])} | {_fmt(d['b'])} | {paired_cell(d)} | {verdict_cell(d)} | {role} |")
    return L


def _rows(res: dict, methods: list[str]) -> list[dict]:
    """One row per (method, set, seed, site) with class counts and, for test splits, the single-class chance."""
    rows = [{"method": m, "set": k, "seed": s, "site": site, "n": int(len(v["y"])),
             "balanced_accuracy": v["balanced_accuracy"], "auc": v["auc"], "single_class": v["single_class"]}
            for m in methods for k in ("test", "external") for (s, site), v in sorted(res[m].get(k, {}).items())]
    for r in rows:  # the chance of a single-class test split given the model's external rates (diagnostic)
        key = (r["seed"], r["site"])
        t, e = res[r["method"]].get("test", {}).get(key), res[r["method"]].get("external", {}).get(key)
        d = t if r["set"] == "test" else e
        r["class_counts"] = np.bincount(np.asarray(d["y"], int), minlength=np.asarray(d["probs"]).shape[1]).tolist()
        if r["set"] == "test" and t is not None and e is not None:
            r["single_class_chance"] = single_class_chance(t["y"], e["y"], e["probs"])
    return rows


def _flag_detail(res_m: dict, seed: int, site: str, evalset: str) -> str:
    """`` (test 15+1+0; P(single) 0.62)`` for a single-class test split: its images per class and
    :func:`single_class_chance` from the same model's external predictions; empty otherwise."""
    if evalset != "test":
        return ""
    t = res_m.get("test", {}).get((seed, site))
    e = res_m.get("external", {}).get((seed, site))
    if t is None:
        return ""
    n = np.bincount(np.asarray(t["y"], int), minlength=np.asarray(t["probs"]).shape[1])
    p = None if e is None else single_class_chance(t["y"], e["y"], e["probs"])
    return f" (test {'+'.join(str(int(c)) for c in n)}; P(single) {_fmt(p)})"


def write_section(out: Path, methods: list[str], n_boot: int = 500) -> dict:
    """Append the section to ``OUT/comparison.md`` and write ``OUT/site_models.json``; returns the summary."""
    text, summary = section(Path(out), methods, n_boot)
    md = Path(out) / "comparison.md"
    md.write_text((md.read_text() if md.is_file() else "") + text)
    (Path(out) / "site_models.json").write_text(json.dumps(summary, indent=1, default=float))
    return summary
