"""Offline re-fusion of a finished OHFL run's site models (the seed-2 diagnosis of studies/fusion_defaults; not a test).

Reads ``RUN/models/site-N_local.pt`` (the models the sites uploaded), their sample counts (``RUN/metrics.json``) and
the probe the server used (``RUN/job_options.json`` -> ``probe``, ``seed``), and fuses them with the server's own
call (:func:`hfl_components.fusion.aggregate_models`, the same arguments as ``OHFLController.run_method``) under
one or more lever settings. Every model is scored zero-shot on the committed ``tuning`` part of
``chest_xray_224`` (735 images, cached by ``bench_fusion_ladder.py``; never the ``evaluation`` part); a fused model
at every site input size, AUCs averaged.

    python -m studies.fusion_defaults.bench_fusion_runs RUN [RUN ...] --configs default,sinkhorn,repair=none --pairs
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]

from studies.fusion_defaults import bench_fusion_ladder as L  # noqa: E402
from hfl_components.fusion import aggregate_models  # noqa: E402

DEFAULT = {"ot_solver": "emd", "ground_metric": "acts", "repair": "layer", "cka": "linear", "probe_at": "largest",
           "weighting": "samples", "drop": False, "down": False}
CONFIGS = {
    "default": {},
    "sinkhorn": {"ot_solver": "sinkhorn"},
    "wts": {"ground_metric": "wts"},
    "repair=none": {"repair": "none"},
    "repair=channel": {"repair": "channel"},
    "probe=own": {"probe_at": "own"},
    "cka=debiased": {"cka": "debiased"},
    "cka=pooled": {"cka": "pooled"},
    "half": {"weighting": "half"},
    "channel+own": {"repair": "channel", "probe_at": "own"},
    "channel+debiased": {"repair": "channel", "cka": "debiased"},
    "channel+pooled": {"repair": "channel", "cka": "pooled"},
    "channel+wts": {"repair": "channel", "ground_metric": "wts"},
    "down": {"down": True},
    "down+channel": {"down": True, "repair": "channel"},
    "drop": {"drop": True},
    "drop+channel": {"drop": True, "repair": "channel"},
}


def load_run(run: Path) -> dict:
    """A finished OHFL run's uploads: ``{"models": [{name, spec, state_dict, n_samples, input_size, val}], "probe",
    "seed", "probe_size", "metrics"}`` (``val``: the site's own validation metrics of its local model, from the
    gate record). Raises FileNotFoundError / ValueError for a missing or unreadable file."""
    from hfl_components.models.files import load_model_file

    met = json.loads((run / "metrics.json").read_text())
    opts = json.loads((run / "job_options.json").read_text())
    models = []
    for site in sorted(met["sites"]):
        model, header = load_model_file(run / "models" / f"{site}_local.pt")
        models.append({"name": site, "spec": header["spec"], "state_dict": model.state_dict(),
                       "n_samples": int(met["sites"][site]["n_train"]), "input_size": int(header["input_size"]),
                       "val": ((met["sites"][site].get("gate") or {}).get("local_val") or {})})
    return {"run": run, "models": models, "probe": opts["probe"], "seed": int(opts["seed"]),
            "probe_size": int(opts["probe_size"]), "metrics": met}


def check_run(run: Path) -> str | None:
    """Why ``run`` cannot be re-fused (one line naming the missing or unreadable file), or None when it can: it
    needs ``metrics.json`` with ``sites``, ``job_options.json`` with ``probe`` / ``seed`` / ``probe_size``, and
    ``models/<site>_local.pt`` for every site (an OHFL run's uploads)."""
    if not run.is_dir():
        return f"{run}: no such run folder"
    try:
        met = json.loads((run / "metrics.json").read_text())
        opts = json.loads((run / "job_options.json").read_text())
    except (OSError, ValueError) as e:
        return f"{run}: not a finished run ({type(e).__name__}: {e})"
    if not isinstance(met, dict) or not met.get("sites"):
        return f"{run / 'metrics.json'}: no sites"
    miss = [k for k in ("probe", "seed", "probe_size") if opts.get(k) is None]
    if miss:
        return f"{run / 'job_options.json'}: no {', '.join(miss)} (not an OHFL run?)"
    lost = [str(run / "models" / f"{s}_local.pt") for s in sorted(met["sites"])
            if not (run / "models" / f"{s}_local.pt").is_file()]
    if lost:
        return f"{run}: missing site model(s) {', '.join(lost)} (not an OHFL run?)"
    return None


def ensure_tuning_cache() -> None:
    """Build ``bench_fusion_ladder``'s image cache (tuning part at 64/96/128 px) when it is missing."""
    if all((L.CACHE / f"tuning_{s}.pt").is_file() for s in L.SIZES):
        return
    if not (L.data_root() / "chest_xray_224").is_dir() or not (L.data_root() / "chest_xray_original").is_dir():
        raise SystemExit(f"bench_fusion_runs: no chest_xray_224 / chest_xray_original under {L.data_root()} "
                         "(set CXR_DATA)")
    print(f"building the image cache in {L.CACHE} (once)", flush=True)
    L.build_cache()


_PROBES: dict = {}


def probe_for(r: dict, models: list[dict], at: str):
    """The server's probe for ``models``: the run's probe images at the largest input size (a tensor (n, 1, S, S))
    or, with ``at="own"``, ``{size: tensor}`` for every input size (``load_probe`` with the run's seed)."""
    from hfl_components.flare.probe import load_probe

    sizes = sorted({m["input_size"] for m in models})
    out = {}
    for s in (sizes if at == "own" else sizes[-1:]):
        key = (r["probe"], s, r["probe_size"], r["seed"])
        if key not in _PROBES:
            _PROBES[key] = load_probe(r["probe"], s, r["probe_size"], seed=r["seed"])
        out[s] = _PROBES[key]
    return out if at == "own" else out[sizes[-1]]


def fuse(r: dict, models: list[dict], cfg: dict):
    """``aggregate_models`` as the OHFL controller calls it, with the levers of ``cfg``; returns (spec, state_dict,
    record, seconds)."""
    t0 = time.perf_counter()
    spec, sd, rec = aggregate_models(models, strategy="cid", probe=probe_for(r, models, cfg["probe_at"]),
                                     alignment="cka", ot_solver=cfg["ot_solver"], ground_metric=cfg["ground_metric"],
                                     weighting=cfg["weighting"], seed=r["seed"], repair=cfg["repair"],
                                     cka=cfg["cka"])
    return spec, sd, rec, time.perf_counter() - t0


def score(spec, sd, sizes) -> list[float]:
    """Zero-shot AUC (pneumonia vs normal) of a model on the ``tuning`` part at each of ``sizes`` (pixels)."""
    y = L.data("tuning", 64)["y"].numpy()
    return [L.auc(y, L.predict(spec, sd, s)) for s in sizes]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="finished OHFL run folders (metrics.json, job_options.json, models/)")
    ap.add_argument("--configs", default="default",
                    help="comma-separated lever settings: " + ", ".join(CONFIGS) + ". 'default' is the server's "
                    "earlier defaults (acts, emd, layer repair, largest-size probe); today's "
                    "defaults are 'channel+own'")
    ap.add_argument("--pairs", action="store_true", help="also fuse every same-depth pair and every chain prefix")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    bad = [c for c in a.configs.split(",") if c not in CONFIGS]
    if bad:
        print(f"bench_fusion_runs: unknown --configs {bad}; allowed: {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    for run in a.runs:
        why = check_run(Path(run))
        if why:
            print(f"bench_fusion_runs: {why}", file=sys.stderr)
            return 2
    ensure_tuning_cache()
    torch.set_num_threads(1)
    rows = []
    y = L.data("tuning", 64)["y"].numpy()
    for run in a.runs:
        r = load_run(Path(run))
        sizes = sorted({m["input_size"] for m in r["models"]})
        par = {m["name"]: L.auc(y, L.predict(m["spec"], m["state_dict"], m["input_size"])) for m in r["models"]}
        print(f"{run}: parents (tuning AUC at own size) "
              + " ".join(f"{k}={v:.3f}" for k, v in par.items()) + f"  mean {np.mean(list(par.values())):.3f}",
              flush=True)
        rows.append({"run": run, "config": "parents", "aucs": par})
        subsets = {"all": [m["name"] for m in r["models"]]}
        if a.pairs:
            names = [m["name"] for m in r["models"]]
            subsets.update({"1+2": names[0:2], "3+4": names[2:4], "5+6": names[4:6], "1-4": names[0:4]})
        for cname in a.configs.split(","):
            cfg = {**DEFAULT, **CONFIGS[cname]}
            for sname, members in subsets.items():
                if sname != "all" and cname != a.configs.split(",")[0]:
                    continue
                ms = [m for m in r["models"] if m["name"] in members]
                # a parent whose own validation split gets one class only (balanced accuracy <= 0.5 at the argmax)
                single = [m["name"] for m in ms if (m["val"].get("balanced_accuracy") or 0.0) <= 0.5]
                if cfg.get("down"):
                    ms = [{**m, "n_samples": 1e-6} if m["name"] in single else m for m in ms]
                if cfg.get("drop"):
                    ms = [m for m in ms if m["name"] not in single]
                spec, sd, rec, secs = fuse(r, ms, cfg)
                aucs = score(spec, sd, sorted({m["input_size"] for m in r["models"] if m["name"] in members}))
                row = {"run": run, "config": cname, "subset": sname, "aucs": aucs, "mean": float(np.mean(aucs)),
                       "seconds": secs}
                rows.append(row)
                print(f"  {cname:<16} {sname:<4} AUC " + " / ".join(f"{x:.3f}" for x in aucs)
                      + f"  mean {row['mean']:.3f}  ({secs:.1f} s)", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
