"""Post-hoc logit adjustment of the personalised methods' deployed site models, measured on *validation* images only
(issue 16, ``proto_tuning.md``, ninth pass).

Logit adjustment (Menon et al., "Long-tail learning via logit adjustment", ICLR 2021, Eq. 3, post-hoc form):
predict ``argmax_c f_c(x) - tau * log pi_c`` with ``pi`` the site's training class frequencies; ``tau > 0`` moves the
decision towards the site's rare classes, ``tau = 0`` is the plain arg-max the sites use now. A class the site does
not hold gets the majority class's ``log pi`` (no boost). No training: every deployed site model of a ``cxr-hfl
compare`` folder (``DIR/seed*/<method>/models/<site>_deployed.pt``) is run once on the validation splits of that
seed's partition, and each ``tau`` re-ranks the same logits. Scored per site model: balanced accuracy on its own
validation split (biased upwards: ``deploy: best_val`` chose the round on it) and on the other sites' validation
images restricted to the classes it holds ("others' val", images no selection saw); single-class counts on both.
Test splits and the evaluation part are never read.

    PYTHONPATH=$PWD python benchmarks/tune_logit_adjust.py --compare runs/grid_a05
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def adjusted_predictions(logits: np.ndarray, train_counts: np.ndarray, tau: float) -> np.ndarray:
    """``argmax_c logits[:, c] - tau * log pi_c`` (Menon et al. 2021, Eq. 3), ``pi`` = ``train_counts`` normalised;
    absent classes (count 0) get the largest class's ``log pi``. logits: (N, C); train_counts: (C,). Returns (N,)."""
    n = np.asarray(train_counts, np.float64)
    if n.sum() <= 0:
        raise ValueError("no training images (all class counts are 0)")
    log_pi = np.log(np.where(n > 0, n, n.max()) / n.sum())
    return (np.asarray(logits, np.float64) - tau * log_pi[None, :]).argmax(axis=1)


def _bal(y: np.ndarray, p: np.ndarray) -> float:
    return float(np.mean([np.mean(p[y == c] == c) for c in np.unique(y)]))


def site_logits(compare_dir: Path) -> list[dict]:
    """Every deployed site model's logits on its seed's validation images (all sites' val splits)."""
    import torch

    from chest_xray import make_site_dataset
    from nvflare_jobs.evaluation import load_model_file
    from nvflare_jobs.proto_eval import _load_site_model

    out = []
    for seed_dir in sorted(compare_dir.glob("seed*")):
        sites = {}
        for f in sorted((seed_dir / "partition" / "sites").glob("*.csv")):
            with f.open(newline="") as fh:
                sites[f.stem] = list(csv.DictReader(fh))
        if not sites:
            continue
        val = [dict(r, label=int(r["label"]), site=s) for s, rows in sites.items() for r in rows if r["split"] == "val"]
        x_by_size: dict[int, torch.Tensor] = {}
        y = np.array([r["label"] for r in val])
        vsite = np.array([r["site"] for r in val])
        for mdir in sorted({p.parent.parent for p in seed_dir.glob("*/models/*_deployed.pt")}):
            for site, rows in sites.items():
                f = mdir / "models" / f"{site}_deployed.pt"
                if not f.is_file():
                    continue
                model, header = _load_site_model(f, load_model_file)
                size = int(header.get("input_size") or 64)
                if size not in x_by_size:
                    ds = make_site_dataset(val, size, "eval")
                    x_by_size[size] = torch.stack([torch.as_tensor(ds[i]["image"]) for i in range(len(ds))])
                with torch.no_grad():
                    logits = model(x_by_size[size]).numpy()
                counts = np.bincount([int(r["label"]) for r in rows if r["split"] == "train"],
                                     minlength=logits.shape[1])
                out.append({"seed": seed_dir.name, "method": mdir.name, "site": site, "counts": counts,
                            "logits": logits, "y": y, "vsite": vsite})
            print(f"[tune_logit_adjust] {seed_dir.name} {mdir.name}: {len(sites)} site models", flush=True)
    return out


def table(recs: list[dict], taus: list[float]) -> list[str]:
    """One markdown row per tau: mean own-val / others'-val balanced accuracy over the site models, single-class
    counts (own val holding >= 2 classes / others' val), and the others'-val mean per method."""
    methods = sorted({r["method"] for r in recs})
    rows = ["| tau | own val bal. acc. | others' val bal. acc. | single-class (own / others') | "
            + " | ".join(f"{m} others'" for m in methods) + " |", "|---" * (4 + len(methods)) + "|"]
    for t in taus:
        own, oth, s_own, s_oth = [], [], 0, 0
        by: dict[str, list[float]] = {m: [] for m in methods}
        for r in recs:
            p = adjusted_predictions(r["logits"], r["counts"], t)
            y, o = r["y"], r["vsite"] == r["site"]
            x = ~o & np.isin(y, np.flatnonzero(r["counts"] > 0))
            if o.any():
                own.append(_bal(y[o], p[o]))
                s_own += int(len(np.unique(y[o])) >= 2 and len(np.unique(p[o])) == 1)
            oth.append(_bal(y[x], p[x]))
            s_oth += int(len(np.unique(y[x])) >= 2 and len(np.unique(p[x])) == 1)
            by[r["method"]].append(oth[-1])
        rows.append(f"| {t:g} | {np.mean(own):.3f} | {np.mean(oth):.3f} | {s_own} / {s_oth} | "
                    + " | ".join(f"{np.mean(by[m]):.3f}" for m in methods) + " |")
    return rows


def main(argv: list[str] | None = None) -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", required=True, help="a cxr-hfl compare folder (seed*/<method>/models, partition)")
    ap.add_argument("--taus", default="-0.5,-0.25,0,0.25,0.5,0.75,1,1.25,1.5")
    a = ap.parse_args(argv)
    try:
        taus = [float(t) for t in a.taus.split(",")]
    except ValueError:
        raise SystemExit(f"tune_logit_adjust: --taus must be comma-separated numbers, got {a.taus!r}")
    d = Path(a.compare)
    torch.set_num_threads(2)
    recs = site_logits(d)
    if not recs:
        raise SystemExit(f"tune_logit_adjust: no deployed site models under {d}/seed*/<method>/models")
    print(f"{len(recs)} site models, validation images only")
    print("\n".join(table(recs, taus)))


if __name__ == "__main__":
    main()
