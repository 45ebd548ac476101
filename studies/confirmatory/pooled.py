"""A pooled description of every protocol that tested the same claim: OHFL's deployed models against equal-epoch
FedAvg on the ``evaluation`` part (protocols 1, 2 and 3; 20 seeds). Tests already run cannot be corrected after the
fact, so this is a description with its interval and no verdict (``docs/evaluation.md``, "Error budget").

The per-seed predictions are the committed copies (``protocols/<name>/seeds/seed<k>/<method>/external/<set>/
predictions.npz``): every seed's six deployed models of each method scored the same 1,715 images, so the seeds of all
protocols form one crossed design (seeds x sites x shared images) and the interval is the one the protocols used,
:func:`hfl_components.stats.paired_crossed` (crossed cluster bootstrap-t: seeds resampled as clusters, one image draw
per replicate shared by every seed and site; the seed-level t-interval beside it). Protocol 1 ran at 100 distillation
steps, protocols 2 and 3 at the current 300: the description is given for all 20 seeds and, beside it, for the 15 at
the current defaults.

    python -m studies.confirmatory.pooled            # writes pooled_ohfl_vs_fedavg.json and prints the table
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
#: protocol folder -> (protocol number, distillation steps of its defaults)
PROTOCOLS = {"confirmatory": (1, 100), "confirmatory_300": (2, 300), "confirmatory_10seeds": (3, 300)}
SET = "chest_xray_224-evaluation"
METHODS = ("ohfl", "fedavg")
N_BOOT = 1000
OUT = HERE / "pooled_ohfl_vs_fedavg.json"


def load(protocols: dict = PROTOCOLS, root: Path = HERE / "protocols", kind: str = "deployed"):
    """``(y (N,), A (S, K, N), B (S, K, N), seeds, protocol_of_seed)``: p(PNEUMONIA) of each seed's ``kind`` models
    of OHFL (A) and FedAvg (B) on the images every copy scored, in one sorted image order.

    Raises:
        ValueError: a seed lacks a method's predictions, the copies do not hold the same images and labels, or the
            seeds do not hold the same sites (the message names the file or seed).
    """
    runs = []
    for name in protocols:
        for d in sorted((root / name / "seeds").glob("seed*"), key=lambda p: int(p.name[4:])):
            runs.append((name, int(d.name[4:]), d))
    npz, ref = {}, None
    for name, s, d in runs:
        for m in METHODS:
            f = d / m / "external" / SET / "predictions.npz"
            if not f.is_file():
                raise ValueError(f"{f}: no such file (every seed needs both methods' predictions)")
            with np.load(f, allow_pickle=False) as z:
                npz[(s, m)] = {k: z[k] for k in z.files}
            paths = npz[(s, m)]["paths"].tolist()
            if ref is None:
                ref = (sorted(paths), dict(zip(paths, npz[(s, m)]["y"].tolist())))
            elif sorted(paths) != ref[0] or dict(zip(paths, npz[(s, m)]["y"].tolist())) != ref[1]:
                raise ValueError(f"{f}: other images or labels than the first copy")
    order, labels = ref
    y = (np.asarray([labels[p] for p in order]) > 0).astype(np.int64)
    sites = sorted({k.rsplit("_", 1)[0] for k in npz[(runs[0][1], "ohfl")] if k.endswith("_" + kind)},
                   key=lambda x: (len(x), x))

    def stack(m):
        out = []
        for _, s, _ in runs:
            d = npz[(s, m)]
            ix = {p: i for i, p in enumerate(d["paths"].tolist())}
            idx = [ix[p] for p in order]
            miss = [k for k in sites if f"{k}_{kind}" not in d]
            if miss:
                raise ValueError(f"seed {s} {m}: no {kind} model of {', '.join(miss)}")
            out.append([1.0 - d[f"{k}_{kind}"][idx, 0] for k in sites])
        return np.asarray(out, dtype=np.float64)

    return y, stack("ohfl"), stack("fedavg"), [s for _, s, _ in runs], {s: n for n, s, _ in runs}


def describe(y, A, B, seeds, n_boot: int = N_BOOT) -> dict:
    """The pooled AUC difference OHFL - FedAvg (:func:`hfl_components.stats.paired_crossed`, 95 % two-sided),
    without its verdict fields: a description, not a test."""
    from hfl_components.stats import paired_crossed

    d = paired_crossed(y, A, B, "auc", n_boot=n_boot, seed=0, seeds=seeds)
    for k in ("verdict", "superior", "non_inferior", "reliable", "note", "margin"):
        d.pop(k, None)
    return d


def _line(label: str, d: dict) -> str:
    return (f"| {label} | {d['n_seeds']} | {d['a']:.3f} | {d['b']:.3f} | {d['diff']:+.3f} "
            f"({d['ci_low']:+.3f} to {d['ci_high']:+.3f}) | {d['t_low']:+.3f} to {d['t_high']:+.3f} |")


def main(argv: list[str] | None = None) -> int:
    y, A, B, seeds, proto = load()
    cur = [i for i, s in enumerate(seeds) if PROTOCOLS[proto[s]][1] == 300]
    everything = describe(y, A, B, seeds)
    current = describe(y, A[cur], B[cur], [seeds[i] for i in cur])
    out = {"what": "pooled description, no verdict: OHFL vs equal-epoch FedAvg, deployed models, AUC, evaluation "
                   "part; every protocol that tested this claim",
           "protocols": {n: {"number": k, "distill_steps": st, "seeds": [s for s in seeds if proto[s] == n]}
                         for n, (k, st) in PROTOCOLS.items()},
           "n_images": int(y.size), "all_seeds": everything, "current_defaults_seeds": current}
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print("| seeds pooled | seeds | OHFL AUC | FedAvg AUC | Δ AUC (95% CI, crossed cluster bootstrap-t) | "
          "seed-level t 95% |\n|---|---|---|---|---|---|")
    print(_line("protocols 1-3 (100 and 300 distillation steps)", everything))
    print(_line("protocols 2-3 (the current defaults)", current))
    return 0


if __name__ == "__main__":
    sys.exit(main())
