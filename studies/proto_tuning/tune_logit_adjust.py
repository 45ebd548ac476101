"""Post-hoc logit adjustment of the personalised methods' deployed site models, measured on *validation* images only
(``studies/proto_tuning/RESULTS.md``).

Logit adjustment (Menon et al., "Long-tail learning via logit adjustment", ICLR 2021, Eq. 3, post-hoc form):
predict ``argmax_c f_c(x) - tau * log pi_c`` with ``pi`` the site's training class frequencies; ``tau > 0`` moves the
decision towards the site's rare classes, ``tau = 0`` is the plain arg-max the sites use now. A class the site does
not hold gets the majority class's ``log pi`` (no boost). No training: every deployed site model of a ``cxr-hfl
compare`` folder (``DIR/seed*/<method>/models/<site>_deployed.pt``) is run once on the validation splits of that
seed's partition, and each ``tau`` re-ranks the same logits. Scored per site model: balanced accuracy on its own
validation split (biased upwards: ``deploy: best_val`` chose the round on it) and on the other sites' validation
images restricted to the classes it holds ("others' val", images no selection saw); single-class counts on both.
Test splits and the evaluation part are never read.

    python -m studies.proto_tuning.tune_logit_adjust --compare runs/grid_a05
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import numpy as np



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


class InputError(ValueError):
    """Bad input (a folder, manifest or model file): the message names it; main prints it as one line, exit 2."""


def _read_sites(seed_dir: Path) -> dict[str, list[dict]]:
    """``{site: manifest rows with int labels}`` of a seed's partition. Raises InputError naming the file."""
    sites = {}
    for f in sorted((seed_dir / "partition" / "sites").glob("*.csv")):
        with f.open(newline="") as fh:
            rows = list(csv.DictReader(fh))
        try:
            rows = [dict(r, label=int(r["label"]), split=r["split"], path=r["path"]) for r in rows]
        except (KeyError, ValueError, TypeError) as e:
            raise InputError(f"{f}: every row needs path, an integer label and split ({type(e).__name__}: {e})")
        if not any(r["split"] == "train" for r in rows):
            raise InputError(f"{f}: no training images")
        sites[f.stem] = rows
    return sites


def site_logits(compare_dir: Path) -> list[dict]:
    """Every deployed site model's logits on its seed's validation images (all sites' val splits).

    Raises:
        InputError: the folder does not exist; a seed has models but no partition manifests; a manifest, model
            file or validation image cannot be read (named)."""
    import torch

    from studies.prototype_methods.proto_eval import image_tensor, load_site_model

    if not compare_dir.is_dir():
        raise InputError(f"no folder {compare_dir}")
    out = []
    for seed_dir in sorted(compare_dir.glob("seed*")):
        model_dirs = sorted({p.parent.parent for p in seed_dir.glob("*/models/*_deployed.pt")})
        if not model_dirs:
            continue
        sites = _read_sites(seed_dir)
        if not sites:
            raise InputError(f"{seed_dir}: deployed models but no partition manifests in {seed_dir}/partition/sites")
        val = [dict(r, site=s) for s, rows in sites.items() for r in rows if r["split"] == "val"]
        for r in val:
            if not Path(r["path"]).is_file():
                raise InputError(f"{seed_dir.name} {r['site']}: validation image {r['path']} does not exist")
        x_by_size: dict[int, torch.Tensor] = {}
        y = np.array([r["label"] for r in val])
        vsite = np.array([r["site"] for r in val])
        for mdir in model_dirs:
            missing = [s for s in sites if not (mdir / "models" / f"{s}_deployed.pt").is_file()]
            if missing:
                print(f"[tune_logit_adjust] warning: {seed_dir.name} {mdir.name}: no deployed model for "
                      f"{', '.join(missing)} (left out)", file=sys.stderr)
            n = 0
            for site, rows in sites.items():
                f = mdir / "models" / f"{site}_deployed.pt"
                if not f.is_file():
                    continue
                try:
                    model, header = load_site_model(f)
                except (ValueError, OSError, RuntimeError, KeyError) as e:
                    raise InputError(f"{f}: cannot load the model ({str(e).splitlines()[0] if str(e) else e!r})")
                size = int(header.get("input_size") or 64)
                if size not in x_by_size:
                    try:
                        x_by_size[size] = image_tensor(val, size)
                    except Exception as e:  # MONAI wraps the reader's error: name the seed, keep the first line
                        raise InputError(f"{seed_dir.name}: a validation image could not be read "
                                         f"({str(e).splitlines()[0]})")
                with torch.no_grad():
                    logits = model(x_by_size[size]).numpy()
                counts = np.bincount([r["label"] for r in rows if r["split"] == "train"], minlength=logits.shape[1])
                out.append({"seed": seed_dir.name, "method": mdir.name, "site": site, "counts": counts,
                            "logits": logits, "y": y, "vsite": vsite})
                n += 1
            print(f"[tune_logit_adjust] {seed_dir.name} {mdir.name}: {n} site models", flush=True)
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
    ap.add_argument("--taus", default="-0.5,-0.25,0,0.25,0.5,0.75,1,1.25,1.5",
                    help="comma-separated finite numbers in [-10, 10]; a list starting with a minus sign needs '=': "
                    "--taus=-0.5,0,0.5 (default: %(default)s)")
    a = ap.parse_args(argv)

    def fail(msg: str):
        print(f"tune_logit_adjust: {msg}", file=sys.stderr)
        raise SystemExit(2)

    try:
        taus = [float(t) for t in a.taus.split(",")]
    except ValueError:
        fail(f"--taus must be comma-separated numbers, got {a.taus!r}")
    if not all(np.isfinite(t) and abs(t) <= 10 for t in taus):
        fail(f"--taus must be finite numbers in [-10, 10], got {a.taus!r}")
    d = Path(a.compare)
    torch.set_num_threads(2)
    try:
        recs = site_logits(d)
    except InputError as e:
        fail(str(e))
    if not recs:
        fail(f"no deployed site models under {d}/seed*/<method>/models")
    print(f"{len(recs)} site models, validation images only")
    print("\n".join(table(recs, taus)))


if __name__ == "__main__":
    main()
