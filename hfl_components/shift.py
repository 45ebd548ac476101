"""Population-shift warning: does a batch of a site's images come from the population the model was trained on?

A model trained on paediatric radiographs of one centre says nothing trustworthy about adult films, another
scanner's tone curve or another geometry, and its scores give no sign of it. This module compares a *batch* (the
images ``predict`` or ``site check`` is given) with a *reference*: a summary of the model's training images that
the site computes once (:func:`build_reference`) and that travels in the model file. Three kinds of evidence:

1. **Image statistics** (:func:`chest_xray.population.image_statistics`, on the model's input tensors): for each
   statistic j a two-sample z of the batch mean against the reference mean, z_j = (mean_batch - mu_j) /
   (sd_j sqrt(1/n + 1/m)) (n batch images, m reference images); the group's score is max_j |z_j|. **Geometry**
   (log height, log width, log aspect of the files): the same, with the reference sd floored at
   :data:`GEOMETRY_SD_FLOOR` (a pool of one size has sd 0).
2. **A feature-space distance under the model**: each image's mean squared standardised distance from the
   reference's per-dimension feature means, r(x) = log mean_k ((f_k(x) - mu_k) / sd_k)^2 (the log of a diagonal
   Mahalanobis distance; Lee et al. 2018, arXiv:1807.03888 use the full covariance per class), and the one-sided z
   of the batch mean of r against the reference's own distribution of r. The reference's r is cross-fitted (each image's
   distance from means and sds fitted without its fold) or computed on held-out images, because a training
   image's features sit closer to the training means than a new image's.
3. **DICOM attributes where present**: the share of images whose ``PatientAge`` lies outside the training
   population's age range (widened by :data:`AGE_MARGIN_YEARS`), and, where the reference recorded them, the share
   of images from a ``Manufacturer`` or with a ``ViewPosition`` not seen in training.

The batch warns (one line, :func:`check_batch`'s ``line``) when any group's score exceeds its threshold
(:data:`DEFAULT_THRESHOLDS`, set on random subsets of the ``tuning`` part of ``chest_xray_224`` at the batch sizes
the check supports, ``studies/shift/``). It never warns on one image: per image it counts flags (distance above
the reference's 99th percentile, geometry more than :data:`IMAGE_FLAG_Z` sds off, age out of range) and reports
the count only. Batches smaller than :data:`MIN_BATCH` are not judged. Two-sample testing of summary statistics
for dataset shift: Rabanser et al. 2019, "Failing Loudly", arXiv:1810.11953.

What the reference holds: counts, means, standard deviations and quantiles over the training images (per image
statistic, per feature dimension, of the distances), the formats / manufacturers / views seen with their counts,
an age range (2.5 and 97.5 % quantiles) and the declared population; no image and no image's value.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

REFERENCE_VERSION = 1
#: Batches smaller than this are not judged (the thresholds were set at this size and above).
MIN_BATCH = 16
#: Batch-level thresholds: image statistics and geometry on max |z|, features on the one-sided z of the mean
#: distance, DICOM attributes on the share of images out of the training range (at least MIN_ATTRIBUTE_IMAGES).
DEFAULT_THRESHOLDS = {"image": 5.0, "geometry": 5.0, "features": 3.0, "age_share": 0.25, "manufacturer_share": 0.25,
                      "view_share": 0.25}
MIN_ATTRIBUTE_IMAGES = 3
GEOMETRY_SD_FLOOR = 0.05  # log units: a 5 % change of a side
STAT_SD_FLOOR = 1e-3
FEATURE_SD_MIN = 1e-6  # feature dimensions with a smaller reference sd (dead units) are left out
FEATURE_SD_SHARE = 0.1  # each kept dimension's sd floored at this share of the median sd
IMAGE_FLAG_Z = 4.0
AGE_MARGIN_YEARS = 1.0
FLAG_QUANTILE = 0.99
GEOMETRY_NAMES = ("log_height", "log_width", "log_aspect")
#: The declared population of models trained on the Kermany images (the consortium's data; Kermany et al. 2018,
#: Cell 172:1122): paediatric patients aged one to five years, one centre.
KERMANY_POPULATION = {"description": "paediatric chest radiographs (patients aged 1-5 years) from one centre "
                                     "(Guangzhou Women and Children's Medical Center; Kermany et al. 2018)",
                      "age_years": [1.0, 5.0], "centres": 1}


def _arr(x) -> np.ndarray:
    return np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x, np.float64)


def _mean_sd(v: np.ndarray, floor: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    sd = v.std(0, ddof=1) if v.shape[0] > 1 else np.zeros(v.shape[1])
    return v.mean(0), np.maximum(sd, floor)


def _distance(v: np.ndarray, mean: np.ndarray, sd: np.ndarray) -> np.ndarray:
    """log of the mean over the kept columns of ((v - mean) / sd)^2, per row. Kept: sd >= FEATURE_SD_MIN (dead
    units out); each sd is floored at FEATURE_SD_SHARE x the median sd of the kept columns, so that a nearly
    constant unit (a ReLU output almost always 0) cannot dominate; the log makes the per-image distance nearly
    symmetric, so that a batch mean of it behaves."""
    keep = sd >= FEATURE_SD_MIN
    if not keep.any():
        return np.zeros(v.shape[0])
    s = np.maximum(sd[keep], FEATURE_SD_SHARE * np.median(sd[keep]))
    return np.log((((v[:, keep] - mean[keep]) / s) ** 2).mean(1) + 1e-12)


def _crossfit_distance(v: np.ndarray, floor: float, k: int = 5, seed: int = 0) -> np.ndarray:
    """Each row's :func:`_distance` from means and sds fitted on the other folds (k folds, random)."""
    n = v.shape[0]
    folds = np.random.default_rng(seed).permutation(n) % min(k, n)
    out = np.zeros(n)
    for f in np.unique(folds):
        held = folds == f
        mu, sd = _mean_sd(v[~held], floor)
        out[held] = _distance(v[held], mu, sd)
    return out


def _distance_summary(r: np.ndarray) -> dict:
    return {"mean": float(r.mean()), "sd": float(r.std(ddof=1)) if r.size > 1 else 0.0,
            "q99": float(np.quantile(r, FLAG_QUANTILE)), "n": int(r.size)}


def _geometry(facts: Sequence[Mapping[str, Any]]) -> np.ndarray:
    """(N, 3) log height, log width, log aspect of the facts (NaN rows where a size is missing)."""
    out = np.full((len(facts), 3), np.nan)
    for i, f in enumerate(facts):
        h, w = (f or {}).get("height"), (f or {}).get("width")
        if h and w:
            out[i] = np.log(float(h)), np.log(float(w)), np.log(float(w) / float(h))
    return out


def _counts(facts: Sequence[Mapping[str, Any]], key: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for f in facts:
        v = (f or {}).get(key)
        if v:
            out[str(v)] = out.get(str(v), 0) + 1
    return dict(sorted(out.items()))


def build_reference(stats, facts: Sequence[Mapping[str, Any]] | None = None, features=None, *,
                    held_out_features=None, population: Mapping[str, Any] | None = None,
                    stat_names: Sequence[str] | None = None, seed: int = 0) -> dict:
    """The training population's summary (JSON-safe) that :func:`check_batch` compares batches with.

    Args:
        stats: (m, K) :func:`chest_xray.population.image_statistics` of the training images (model input tensors).
        facts: m :func:`chest_xray.population.population_facts` dicts (None: no geometry / DICOM part).
        features: (m, d) the model's features of the same images (``model.features(x)``; None: no feature part).
        held_out_features: (h, d) features of images the model did not train on (the site's validation split):
            when given (h >= 5), the reference distribution of the distance r is measured on them; otherwise it is
            cross-fitted on ``features``.
        population: the declared population (e.g. :data:`KERMANY_POPULATION`): a ``description`` for the warning
            and the model card, and an ``age_years`` range used when the files carry no ages.
        stat_names: names of the K columns (default :data:`chest_xray.population.IMAGE_STATS`).

    Returns:
        ``{"version", "n", "image": {"names", "mean", "sd", "distance"}, "geometry", "features", "formats",
        "manufacturers", "views", "age_years", "sizes", "population"}`` (a part None when its input is absent).

    Raises:
        ValueError: fewer than 5 reference images, or inputs of different lengths.
    """
    s = _arr(stats)
    m = s.shape[0]
    if s.ndim != 2 or m < 5:
        raise ValueError(f"a population reference needs image statistics of at least 5 images, got shape {s.shape}")
    if stat_names is None:
        from chest_xray.population import IMAGE_STATS

        stat_names = IMAGE_STATS
    if len(stat_names) != s.shape[1]:
        raise ValueError(f"{len(stat_names)} statistic names for {s.shape[1]} columns")
    mu, sd = _mean_sd(s, STAT_SD_FLOOR)
    ref: dict[str, Any] = {
        "version": REFERENCE_VERSION, "n": int(m),
        "image": {"names": list(stat_names), "mean": mu.tolist(), "sd": sd.tolist(),
                  "distance": _distance_summary(_crossfit_distance(s, STAT_SD_FLOOR, seed=seed))},
        "geometry": None, "features": None, "formats": {}, "manufacturers": {}, "views": {}, "age_years": None,
        "sizes": None, "population": dict(population) if population else None}
    if facts is not None:
        if len(facts) != m:
            raise ValueError(f"{len(facts)} file facts for {m} images")
        g = _geometry(facts)
        g = g[~np.isnan(g).any(1)]
        if g.shape[0] >= 5:
            gm, gs = _mean_sd(g, GEOMETRY_SD_FLOOR)
            ref["geometry"] = {"names": list(GEOMETRY_NAMES), "mean": gm.tolist(), "sd": gs.tolist(), "n": int(len(g))}
            hw = np.exp(g[:, :2])
            ref["sizes"] = {k: {"min": int(round(hw[:, i].min())), "median": int(round(np.median(hw[:, i]))),
                                "max": int(round(hw[:, i].max()))} for i, k in enumerate(("height", "width"))}
        ref["formats"] = _counts(facts, "format")
        ref["manufacturers"] = _counts(facts, "manufacturer")
        ref["views"] = _counts(facts, "view")
        ages = np.array([f["age_years"] for f in facts if f and f.get("age_years") is not None], np.float64)
        if ages.size >= 5:
            ref["age_years"] = [float(np.quantile(ages, 0.025)), float(np.quantile(ages, 0.975))]
    if ref["age_years"] is None and population and population.get("age_years"):
        ref["age_years"] = [float(a) for a in population["age_years"]]
    if features is not None:
        f = _arr(features).reshape(m, -1) if _arr(features).shape[0] == m else None
        if f is None:
            raise ValueError(f"features of {_arr(features).shape[0]} images for {m} image statistics")
        fm, fs = _mean_sd(f)
        if held_out_features is not None and _arr(held_out_features).shape[0] >= 5:
            h = _arr(held_out_features).reshape(_arr(held_out_features).shape[0], -1)
            r, how = _distance(h, fm, fs), "held-out images"
        else:
            r, how = _crossfit_distance(f, 0.0, seed=seed), "cross-fitted on the training images"
        ref["features"] = {"mean": fm.tolist(), "sd": fs.tolist(), "n_dims": int(f.shape[1]),
                           "n_kept": int((fs >= FEATURE_SD_MIN).sum()), "distance": {**_distance_summary(r),
                                                                                       "from": how}}
    return ref


def _z(batch_mean: np.ndarray, mean, sd, n: int, m: int) -> np.ndarray:
    return (batch_mean - np.asarray(mean)) / (np.asarray(sd) * np.sqrt(1.0 / n + 1.0 / m))


def check_batch(reference: Mapping[str, Any], stats, facts: Sequence[Mapping[str, Any]] | None = None,
                features=None, thresholds: Mapping[str, float] | None = None) -> dict:
    """Compare a batch with the training population's reference (:func:`build_reference`).

    Args:
        stats: (n, K) image statistics of the batch (same columns as the reference).
        facts: n file facts (None: no geometry / DICOM part); features: (n, d) the model's features (None: none).
        thresholds: overrides of :data:`DEFAULT_THRESHOLDS`.

    Returns:
        ``{"n", "checked" (n >= MIN_BATCH), "warn" (bool), "line" (one line for the console / log), "groups":
        {name: {"score", "threshold", "fired", "detail"}}, "flags": {"image", "features", "geometry", "age",
        "any"} (per-image counts, never a warning by themselves), "population"}``.

    Raises:
        ValueError: statistics of another width than the reference's, or inputs of different lengths.
    """
    th = {**DEFAULT_THRESHOLDS, **(thresholds or {})}
    s = _arr(stats)
    n = int(s.shape[0]) if s.ndim == 2 else 0
    img = reference["image"]
    if s.ndim != 2 or s.shape[1] != len(img["mean"]):
        raise ValueError(f"batch statistics of shape {s.shape} against a reference of {len(img['mean'])} statistics")
    if facts is not None and len(facts) != n:
        raise ValueError(f"{len(facts)} file facts for {n} images")
    m = int(reference["n"])
    groups: dict[str, dict] = {}
    flags = np.zeros((n, 4), bool)  # image, features, geometry, age
    mu, sd = np.asarray(img["mean"]), np.asarray(img["sd"])
    flags[:, 0] = _distance(s, mu, sd) > img["distance"]["q99"]
    if n:
        z = _z(s.mean(0), mu, sd, n, m)
        j = int(np.argmax(np.abs(z)))
        groups["image"] = {"score": float(abs(z[j])), "threshold": th["image"], "detail": f"{img['names'][j]} z = "
                           f"{z[j]:+.1f}"}
    geo = reference.get("geometry")
    if facts is not None and geo:
        g = _geometry(facts)
        ok = ~np.isnan(g).any(1)
        gm, gs = np.asarray(geo["mean"]), np.asarray(geo["sd"])
        flags[ok, 2] = (np.abs((g[ok] - gm) / gs) > IMAGE_FLAG_Z).any(1)
        if ok.sum():
            z = _z(g[ok].mean(0), gm, gs, int(ok.sum()), int(geo["n"]))
            j = int(np.argmax(np.abs(z)))
            sizes = reference.get("sizes") or {}
            groups["geometry"] = {"score": float(abs(z[j])), "threshold": th["geometry"],
                                  "detail": f"{geo['names'][j]} z = {z[j]:+.1f}" + (
                                      f" (median {int(np.median(np.exp(g[ok, 0])))} x "
                                      f"{int(np.median(np.exp(g[ok, 1])))} px against "
                                      f"{sizes['height']['median']} x {sizes['width']['median']})" if sizes else "")}
    feat = reference.get("features")
    if features is not None and feat and n:
        f = _arr(features).reshape(n, -1)
        if f.shape[1] != feat["n_dims"]:
            raise ValueError(f"batch features of {f.shape[1]} dimensions against a reference of {feat['n_dims']}")
        r = _distance(f, np.asarray(feat["mean"]), np.asarray(feat["sd"]))
        d = feat["distance"]
        flags[:, 1] = r > d["q99"]
        z = (r.mean() - d["mean"]) / (max(d["sd"], 1e-12) * np.sqrt(1.0 / n + 1.0 / d["n"]))
        groups["features"] = {"score": float(z), "threshold": th["features"],
                              "detail": f"mean distance {r.mean():.2f} against {d['mean']:.2f}, z = {z:+.1f}"}
    if facts is not None:
        _attribute_groups(reference, facts, th, groups, flags)
    for g in groups.values():
        g["fired"] = bool(g["score"] > g["threshold"])
    checked = n >= MIN_BATCH
    fired = [k for k, g in groups.items() if g["fired"]] if checked else []
    out = {"n": n, "checked": checked, "warn": bool(fired), "groups": groups,
           "flags": {"image": int(flags[:, 0].sum()), "features": int(flags[:, 1].sum()),
                     "geometry": int(flags[:, 2].sum()), "age": int(flags[:, 3].sum()),
                     "any": int(flags.any(1).sum())},
           "population": reference.get("population")}
    out["line"] = _line(out, fired, reference)
    return out


def _attribute_groups(reference, facts, th, groups, flags) -> None:
    """The DICOM-attribute groups of :func:`check_batch`: age out of range, manufacturer / view not seen."""
    age = reference.get("age_years")
    ages = [(i, f.get("age_years")) for i, f in enumerate(facts) if f and f.get("age_years") is not None]
    if age and ages:
        lo, hi = age[0] - AGE_MARGIN_YEARS, age[1] + AGE_MARGIN_YEARS
        out = [i for i, a in ages if not lo <= a <= hi]
        flags[out, 3] = True
        share = len(out) / len(ages)
        med = float(np.median([a for _, a in ages]))
        groups["age"] = {"score": share if len(ages) >= MIN_ATTRIBUTE_IMAGES else 0.0, "threshold": th["age_share"],
                         "detail": f"{len(out)} of {len(ages)} images with a PatientAge outside "
                                   f"{age[0]:g}-{age[1]:g} years (median {med:.0f} years)"}
    for key, name, tag in (("manufacturers", "manufacturer", "Manufacturer"), ("views", "view", "ViewPosition")):
        seen = reference.get(key) or {}
        vals = [f.get(name) for f in facts if f and f.get(name)]
        if not seen or not vals:
            continue
        new = [v for v in vals if v not in seen]
        groups[name] = {"score": len(new) / len(vals) if len(vals) >= MIN_ATTRIBUTE_IMAGES else 0.0,
                        "threshold": th[f"{name}_share"],
                        "detail": f"{len(new)} of {len(vals)} images with a {tag} not seen in training"
                                  + (f" ({', '.join(sorted(set(new))[:3])})" if new else "")}


def _line(res: dict, fired: list[str], reference) -> str:
    n, fl = res["n"], res["flags"]["any"]
    who = ((reference.get("population") or {}).get("description") or "the model's training images")
    if not res["checked"]:
        return (f"population check: not judged, {n} images (fewer than {MIN_BATCH}); {fl} of {n} images flagged "
                "individually")
    if not fired:
        return (f"population check: {n} images consistent with the training population ({fl} of {n} flagged "
                "individually, no batch-level shift)")
    names = {"image": "image statistics", "geometry": "image geometry", "features": "features under the model",
             "age": "patient age", "manufacturer": "manufacturer", "view": "view"}
    parts = "; ".join(f"{names[k]}: {res['groups'][k]['detail']}" for k in fired)
    return (f"WARNING: population shift: these {n} images differ from the training population ({who}): {parts}; "
            f"{fl} of {n} images flagged individually. Predictions may not hold for them.")


def merge_references(refs: Sequence[Mapping[str, Any]], population: Mapping[str, Any] | None = None) -> dict:
    """The federation's reference from the sites' (:func:`build_reference`): image statistics and geometry pooled
    exactly (counts, means and variances), distance summaries pooled approximately (count-weighted means, the
    larger sd and q99), formats / manufacturers / views summed, the age range the union. No feature part (each
    site's features come from another model). For the model card of a global model and a consortium-wide
    ``site check``.

    Raises:
        ValueError: no references, or references of different statistics.
    """
    refs = [r for r in refs if r]
    if not refs:
        raise ValueError("no population references to merge")
    names = refs[0]["image"]["names"]
    if any(r["image"]["names"] != names for r in refs):
        raise ValueError("population references of different image statistics cannot be merged")

    def pool(parts, floor):
        ns = np.array([p[0] for p in parts], np.float64)
        mus = np.array([p[1] for p in parts])
        sds = np.array([p[2] for p in parts])
        n = ns.sum()
        mu = (ns[:, None] * mus).sum(0) / n
        ss = ((ns[:, None] - 1) * sds ** 2 + ns[:, None] * (mus - mu) ** 2).sum(0)
        return int(n), mu.tolist(), np.maximum(np.sqrt(ss / max(n - 1, 1)), floor).tolist()

    n, mu, sd = pool([(r["n"], r["image"]["mean"], r["image"]["sd"]) for r in refs], STAT_SD_FLOOR)
    ds = [r["image"]["distance"] for r in refs]
    dist = {"mean": float(np.average([d["mean"] for d in ds], weights=[d["n"] for d in ds])),
            "sd": float(max(d["sd"] for d in ds)), "q99": float(max(d["q99"] for d in ds)),
            "n": int(sum(d["n"] for d in ds))}
    out = {"version": REFERENCE_VERSION, "n": n, "image": {"names": list(names), "mean": mu, "sd": sd,
                                                           "distance": dist},
           "geometry": None, "features": None, "population": dict(population) if population else refs[0].get(
               "population")}
    geos = [r["geometry"] for r in refs if r.get("geometry")]
    if geos:
        gn, gm, gs = pool([(g["n"], g["mean"], g["sd"]) for g in geos], GEOMETRY_SD_FLOOR)
        out["geometry"] = {"names": list(GEOMETRY_NAMES), "mean": gm, "sd": gs, "n": gn}
    for key in ("formats", "manufacturers", "views"):
        tot: dict[str, int] = {}
        for r in refs:
            for k, v in (r.get(key) or {}).items():
                tot[k] = tot.get(k, 0) + int(v)
        out[key] = dict(sorted(tot.items()))
    ages = [r["age_years"] for r in refs if r.get("age_years")]
    out["age_years"] = [min(a[0] for a in ages), max(a[1] for a in ages)] if ages else None
    sizes = [r["sizes"] for r in refs if r.get("sizes")]
    out["sizes"] = {k: {"min": min(s[k]["min"] for s in sizes), "max": max(s[k]["max"] for s in sizes),
                        "median": int(np.median([s[k]["median"] for s in sizes]))} for k in ("height", "width")} \
        if sizes else None
    return out


def population_statement(reference: Mapping[str, Any] | None) -> str:
    """One sentence for the model card: the training population (declared description, image count, sizes,
    formats, age range)."""
    if not reference:
        return "Training population: not recorded in this model file."
    pop = reference.get("population") or {}
    parts = [pop.get("description") or "not declared", f"{reference['n']} training images"]
    sz = reference.get("sizes")
    if sz:
        parts.append(f"image sizes {sz['width']['min']}-{sz['width']['max']} px wide, {sz['height']['min']}-"
                     f"{sz['height']['max']} px high (median {sz['width']['median']} x {sz['height']['median']})")
    if reference.get("formats"):
        parts.append("formats " + ", ".join(f"{k} {v}" for k, v in reference["formats"].items()))
    if reference.get("age_years"):
        a = reference["age_years"]
        parts.append(f"ages {a[0]:g}-{a[1]:g} years")
    return "Training population: " + "; ".join(parts) + "."


def features_and_statistics(model, images, batch_size: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """``(image statistics (N, K), features (N, d))`` of images (N, 1, S, S) on the evaluation transform's scale
    under ``model`` (its ``features(x)``, eval mode, no gradients, on the images' device), batch by batch. The one
    call a site needs before :func:`build_reference` or :func:`check_batch` (plus the file facts)."""
    import torch

    from chest_xray.population import image_statistics

    x = torch.as_tensor(images, dtype=torch.float32)
    was = model.training
    model.eval()
    feats = []
    try:
        with torch.no_grad():
            for i in range(0, x.shape[0], batch_size):
                feats.append(model.features(x[i:i + batch_size]).reshape(min(batch_size, x.shape[0] - i), -1)
                             .double().cpu().numpy())
    finally:
        model.train(was)
    return image_statistics(x), (np.concatenate(feats) if feats else np.zeros((0, 0)))
