"""Does a site model read augmentation artefacts as a label? A shortcut probe on labelled images no site trained on.

With ``augment_classes: auto`` only a site's minority classes are flipped / rotated / shifted during training (zero
padding at the borders), so a flipped or black-bordered image is, in training, always a minority-class image. A model
that learnt that shortcut moves its probabilities towards those classes when a *real* image is flipped or shifted.
This script measures that move: every site model of one or more runs (``RUN/models/<site>_<kind>.pt``; ``--kinds``,
default ``local`` = trained on the site's data alone and ``deployed`` = the model each site keeps) scores the committed ``tuning`` part of ``chest_xray_224`` (the labelled part on which
defaults may be chosen; never the ``evaluation`` part) as it is and transformed like the training augmentation. For
the main job (sites on ``chest_xray_original``) no site trained on these images; the prototype methods' sites are built
from the tuning + probe parts, so for them the probe includes their own training images (the changes still measure a
shortcut; the untransformed scores are then not held out):

- ``flip``: horizontal flip;
- ``shift``: translation by 6 % of the side along both axes at once (the augmentation's per-axis maximum; the
  content moves up-left, black bands at the right and bottom) with zero fill;
- ``rotate+shift``: 10 degrees and the same shift, zero fill.

Reported per run, model kind and transform: the change of p(the site's training minority classes, as ``auto``
resolves them from the site's manifest; summed when several), averaged over the images, then over the sites that
have a minority class, with a 95 % percentile-bootstrap interval over the images only (one image draw per replicate,
within class, shared by every site, since every site scores the same images; the run's models fixed: one run is one
seed and says nothing about training randomness, so this interval gives no verdict); the runs' ``augment_classes``
setting; and the untransformed images' balanced accuracy / AUC. ``--pair-arms``: two arms' untransformed scores
paired by (seed, site), seeds as clusters (:func:`hfl_components.stats.paired_nested` with the tuning images as one
shared pool: the crossed design). No shortcut: changes near 0 and of no consistent sign.

    python -m studies.shortcut.shortcut_probe runs/ohfl_auto_s0 runs/ohfl_all_s0 --labels binary
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


TRANSFORMS = ("flip", "shift", "rotate+shift")


def transform(X, name: str):
    """``X (N, 1, S, S)`` flipped / shifted by 6 % of S / rotated 10 degrees and shifted, zero fill."""
    import math

    import torch
    import torch.nn.functional as F

    if name == "flip":
        return torch.flip(X, dims=[-1])
    angle = math.radians(10.0) if name == "rotate+shift" else 0.0
    t = 2 * 0.06  # 6 % of the side in normalised [-1, 1] coordinates
    theta = torch.tensor([[math.cos(angle), -math.sin(angle), t], [math.sin(angle), math.cos(angle), t]],
                         dtype=X.dtype).expand(X.shape[0], 2, 3)
    grid = F.affine_grid(theta, list(X.shape), align_corners=False)
    return F.grid_sample(X, grid, padding_mode="zeros", align_corners=False)


def site_shifts(run: Path, labels: str, data_root: Path, kind: str = "deployed") -> dict:
    """``{site: {"augment_classes", "minority", "y", "p": {name: (N, C) probabilities}}}`` for every site model of
    ``kind`` (``RUN/models/<site>_<kind>.pt``: deployed / local / federated)."""
    import torch

    from chest_xray import default_augment_classes, label_index, read_site_manifest
    from chest_xray.splits import split_rows
    from studies.prototype_methods.proto_eval import image_tensor, load_site_model

    rows = [{"path": str(data_root / r["path"]), "label": label_index(r["label"], r["path"], labels)}
            for r in split_rows("tuning")]
    y = np.array([r["label"] for r in rows])
    xs: dict[tuple[int, str], torch.Tensor] = {}  # (input size, transform) -> images, shared by the site models
    out = {}
    for f in sorted((run / "models").glob(f"*_{kind}.pt")):
        site = f.stem.rpartition("_")[0]
        try:
            model, header = load_site_model(f)
        except (ValueError, OSError, RuntimeError, KeyError) as e:
            print(f"shortcut_probe: {f}: cannot load the model ({str(e).splitlines()[0] if str(e) else e!r})",
                  file=sys.stderr)
            raise SystemExit(2)
        size = int(header.get("input_size") or 64)
        if (size, "none") not in xs:
            xs[(size, "none")] = image_tensor(rows, size)
            for name in TRANSFORMS:
                xs[(size, name)] = transform(xs[(size, "none")], name)
        cfg = run / "resolved_configs" / f"{site}.json"
        conf = json.loads(cfg.read_text()) if cfg.is_file() else {}
        aug = conf.get("augment_classes")
        man = (conf.get("data") or {}).get("manifest")
        minority = []
        if man and Path(man).is_file():  # the classes `auto` augments at this site (same partition in every arm)
            minority = default_augment_classes([r for r in read_site_manifest(man) if r["split"] == "train"])
        p = {}
        with torch.no_grad():
            for name in ("none", *TRANSFORMS):
                X = xs[(size, name)]
                p[name] = torch.cat([torch.softmax(model(X[i:i + 256]), 1) for i in range(0, len(X), 256)]).numpy()
        out[site] = {"augment_classes": aug, "minority": minority, "y": y, "p": p}
        print(f"[shortcut_probe] {run.name} {site} ({kind}): {size} px, augment_classes {aug}, training minority {minority}",
              flush=True)
    return out


def summary(sites: dict, n_boot: int = 1000, seed: int = 0) -> dict:
    """Mean change of p(the site's training minority classes) (transformed - original) pooled over the sites that
    have a minority class, per transform, with a 95% percentile interval over the images only (one image draw per
    replicate, within class, shared by every site: :func:`hfl_components.stats.draw_image_counts`; the sites of the
    run are not resampled, they are one seed's models); per-site means alongside. A shortcut learnt from
    minority-only augmentation shows as a positive change."""
    from hfl_components.stats import draw_image_counts, percentile_interval

    names = sorted(s for s in sites if sites[s]["minority"])
    if not names:
        return {}
    w = draw_image_counts(np.random.default_rng(seed), n_boot, sites[names[0]]["y"])  # (R, N), shared by the sites
    res = {}
    for t in TRANSFORMS:
        d = np.stack([(sites[s]["p"][t] - sites[s]["p"]["none"])[:, sites[s]["minority"]].sum(1)
                      for s in names])  # (K, N)
        lo, hi = percentile_interval(((w @ d.T) / w.sum(1, keepdims=True)).mean(1))
        res[t] = {"mean_change": float(d.mean()), "ci_low": float(lo), "ci_high": float(hi),
                  "per_site": {s: float(v) for s, v in zip(names, d.mean(1))}}
    return res


def untransformed_scores(sites: dict) -> dict:
    """Mean over site models of balanced accuracy and macro AUC on the untransformed images (the tuning part)."""
    from hfl_components.stats import site_metric

    out = {}
    for m in ("balanced_accuracy", "auc"):
        per = {s: float(site_metric(m, v["y"], v["p"]["none"])) for s, v in sites.items()}
        out[m] = float(np.nanmean(list(per.values())))
        out[f"{m}_per_site"] = per
    return out


def paired_arms(a: list[dict], b: list[dict], metric: str, n_boot: int = 2000, seed: int = 0) -> dict:
    """Arm B - arm A of a site model's untransformed score, paired by (run index = seed, site): ``a[i]`` and ``b[i]``
    are :func:`site_shifts` of the same seed's runs of the two arms, every site scoring the same tuning images.

    :func:`hfl_components.stats.paired_nested` with the images as one shared pool (the crossed design: one image
    draw per replicate for every seed, site and arm) and the seeds resampled as clusters with their sites.

    Returns:
        Its result dict (``diff``, ``per_seed``, ``ci_low``/``ci_high`` (cluster bootstrap-t), ``t_low``/``t_high``,
        ``reliable``, ``verdict``, ``n_pairs``, ...), A = arm B and B = arm A.

    Raises:
        ValueError: two paired site models scored different images, or no site pairs.
    """
    from hfl_components.stats import paired_nested

    pairs = []
    for i, (sa, sb) in enumerate(zip(a, b)):
        for site in sorted(set(sa) & set(sb)):
            ya, yb = np.asarray(sa[site]["y"]), np.asarray(sb[site]["y"])
            if not np.array_equal(ya, yb):
                raise ValueError(f"run {i} {site}: the two arms' models scored different images")
            pairs.append({"seed": i, "site": site, "pool": "tuning", "ids": np.arange(ya.size), "y": ya,
                          "pa": sb[site]["p"]["none"], "pb": sa[site]["p"]["none"]})
    return paired_nested(pairs, metric, n_boot=n_boot, seed=seed)


def main(argv: list[str] | None = None) -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="run folders (cxr-hfl simulate --out) with models/<site>_deployed.pt")
    ap.add_argument("--labels", default="binary", choices=("binary", "subtype"))
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[2].parent / "shared/data/chest_xray_224"))
    ap.add_argument("--kinds", default="local,deployed", help="model files to probe, comma-separated: local (trained "
                    "on the site's data alone), federated, deployed (what the site keeps) (default: %(default)s)")
    ap.add_argument("--pair-arms", action="store_true", help="the runs are two arms of equal length in the same "
                    "seed order (A A A B B B): also print B - A of the untransformed scores per model kind, paired by "
                    "(seed, site)")
    ap.add_argument("--json", help="write the summaries here")
    a = ap.parse_args(argv)
    for r in a.runs:
        if not any(Path(r, "models").glob("*.pt")):
            print(f"shortcut_probe: {r}: no models/<site>_<kind>.pt (a finished cxr-hfl simulate run?)",
                  file=sys.stderr)
            raise SystemExit(2)
    if not Path(a.data).is_dir():
        print(f"shortcut_probe: no chest_xray_224 root at {a.data} (--data)", file=sys.stderr)
        raise SystemExit(2)
    torch.set_num_threads(2)
    allres, probes = {}, {}
    kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
    if not kinds or not set(kinds) <= {"local", "federated", "deployed"}:
        print(f"shortcut_probe: --kinds must list local / federated / deployed, got {a.kinds!r}", file=sys.stderr)
        raise SystemExit(2)
    for r, kind in ((r, k) for r in a.runs for k in kinds):
        sites = site_shifts(Path(r), a.labels, Path(a.data), kind)
        if not sites:
            print(f"[shortcut_probe] {r}: no models/*_{kind}.pt, skipped", file=sys.stderr)
            continue
        res = summary(sites)
        key = f"{r} ({kind})"
        probes[key] = sites
        allres[key] = {"augment_classes": {s: v["augment_classes"] for s, v in sites.items()}, "changes": res}
        allres[key]["minority"] = {s: v["minority"] for s, v in sites.items()}
        allres[key]["untransformed"] = untransformed_scores(sites)
        print(f"\n{key}: augment_classes {allres[key]['augment_classes']}; training minority {allres[key]['minority']}")
        u = allres[key]["untransformed"]
        print(f"untransformed tuning images, mean over site models: balanced accuracy {u['balanced_accuracy']:.3f}, "
              f"AUC {u['auc']:.3f}")
        print("| transform | Δ p(site's minority classes) [95% CI] | per site |")
        for t, v in res.items():
            print(f"| {t} | {v['mean_change']:+.4f} [{v['ci_low']:+.4f}, {v['ci_high']:+.4f}] | "
                  + ", ".join(f"{s} {m:+.3f}" for s, m in v["per_site"].items()) + " |")
    if a.pair_arms:
        if len(a.runs) % 2:
            print("shortcut_probe: --pair-arms needs an even number of runs (arm A's, then arm B's)", file=sys.stderr)
            raise SystemExit(2)
        h = len(a.runs) // 2
        for kind in kinds:
            ua = [probes.get(f"{r} ({kind})") for r in a.runs[:h]]
            ub = [probes.get(f"{r} ({kind})") for r in a.runs[h:]]
            if None in ua or None in ub:
                continue
            from hfl_components.stats import paired_cell, verdict_cell

            for m in ("balanced_accuracy", "auc"):
                try:
                    d = paired_arms(ua, ub, m)
                except ValueError as e:
                    print(f"shortcut_probe: --pair-arms: {e}", file=sys.stderr)
                    raise SystemExit(2)
                allres[f"paired {kind} {m}"] = d
                print(f"{kind} {m}: B - A {paired_cell(d, nd=4)}, {verdict_cell(d)}, over {d['n_pairs']} (seed, "
                      f"site) pairs of {d['n_seeds']} seed(s) (exploratory)")
    if a.json:
        Path(a.json).write_text(json.dumps(allres, indent=1))


if __name__ == "__main__":
    main()
