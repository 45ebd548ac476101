"""How close does the server's ensemble distillation bring the global model to the site ensemble?

Offline, on one finished OHFL run (``RUN``: ``models/<site>_local.pt`` = the uploads, ``global_fused.pt`` = the
fused model before distillation, ``job_options.json`` -> the probe pool): distils the uploads' ensemble into the
fused model with each configuration given, exactly as the server does (``hfl_components.flare.distill_stage`` +
``hfl_components.fusion.distill``), and scores on the committed ``tuning`` part of ``chest_xray_224`` (never the
``evaluation`` part): the site ensemble (averaged probabilities, each upload at its own size), fusion alone and each
distilled student (AUC at every site's input size, averaged over sites, as ``evaluate``'s ``global`` entry). Also
reports each configuration's distillation seconds with the wall-clock seconds of a fixed reference workload (the
fused model's forward passes on the probe) measured just before, so that seconds can be scaled between machine
loads.

    python -m studies.distillation.tune_distill --run RUN --data ../shared/data/chest_xray_224 \
        --config steps=0 --config steps=100 --config steps=100,lr=0.001 --out runs/distill_tune.json

Exit 2 with one line for a missing run, data folder or a bad --config.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

KEYS = {"steps": int, "temperature": float, "lr": float, "momentum": float, "batch_size": int,
        "augment": lambda v: v in ("1", "true"), "augment_copies": int, "patience": int, "eval_every": int,
        "weights": str, "probe_n": int, "data_free_rounds": int}


def parse_config(text: str) -> dict:
    """``steps=100,lr=0.01`` -> {"steps": 100, "lr": 0.01}. Raises ValueError naming the bad key or value."""
    out = {}
    for part in text.split(","):
        k, sep, v = part.partition("=")
        if not sep or k.strip() not in KEYS:
            raise ValueError(f"--config {text!r}: expected key=value with keys {sorted(KEYS)}, got {part!r}")
        try:
            out[k.strip()] = KEYS[k.strip()](v.strip())
        except ValueError:
            raise ValueError(f"--config {text!r}: bad value for {k.strip()}: {v!r}") from None
    return out


def site_mean_auc(model, X: dict, y, site_sizes: dict) -> float:
    import torch
    from sklearn.metrics import roc_auc_score

    per = {}
    with torch.no_grad():
        for z in sorted(set(site_sizes.values())):
            per[z] = roc_auc_score(y, torch.softmax(model(X[z]), -1)[:, 1].numpy())
    return float(sum(per[z] for z in site_sizes.values()) / len(site_sizes))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True)
    ap.add_argument("--data", required=True, help="the chest_xray_224 root (its tuning part is scored)")
    ap.add_argument("--config", action="append", default=[], help="key=value[,key=value] (repeatable)")
    ap.add_argument("--out", required=True, help="JSON file for the results")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    run, data = Path(args.run), Path(args.data)
    if not (run / "global_fused.pt").is_file() or not (run / "models").is_dir():
        print(f"tune_distill: {run}: no global_fused.pt / models/ (an OHFL run with distillation's code)",
              file=sys.stderr)
        return 2
    if not data.is_dir():
        print(f"tune_distill: no data folder {data}", file=sys.stderr)
        return 2
    try:
        configs = [parse_config(c) for c in args.config] or [{}]
    except ValueError as e:
        print(f"tune_distill: {e}", file=sys.stderr)
        return 2
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    from chest_xray.splits import split_rows
    from hfl_components.flare import catalogue
    from hfl_components.flare import distill_stage as ds
    from hfl_components.flare.probe import load_probe
    from hfl_components.fusion.distill import DistillConfig, distill
    from nvflare_jobs.evaluation import load_model_file, run_site_sizes
    from studies.prototype_methods.proto_eval import image_tensor
    from sklearn.metrics import roc_auc_score

    site_sizes = run_site_sizes(run)
    sizes = sorted(set(site_sizes.values()))
    uploads = {}
    for f in sorted((run / "models").glob("*_local.pt")):
        m, h = load_model_file(f)
        site = f.stem.rsplit("_", 1)[0]
        uploads[site] = {"spec": h["spec"], "state_dict": m.state_dict(), "input_size": int(h["input_size"]),
                         "n_samples": 1, "val_auc": None}
    man = json.loads((run / "metrics.json").read_text())
    for s in uploads:
        uploads[s]["n_samples"] = int(man["sites"][s]["n_train"])
    fused, fh = load_model_file(run / "global_fused.pt")
    probe_src = json.loads((run / "job_options.json").read_text())["probe"]
    rows = [{"path": str(data / r["path"]), "label": int(r["label"] > 0) if isinstance(r["label"], int) else
             int(str(r["label"]).upper() != "NORMAL")} for r in split_rows("tuning")]
    y = np.array([r["label"] for r in rows])
    X = {z: image_tensor(rows, z) for z in sizes}
    teachers = ds.teachers_of(uploads)
    with torch.no_grad():
        ens = np.mean([torch.softmax(t.model(X[t.input_size]), -1)[:, 1].numpy() for t in teachers], axis=0)
    out = {"run": run.name, "data": "chest_xray_224 tuning part", "n_images": int(len(y)), "site_sizes": site_sizes,
           "ensemble_auc": float(roc_auc_score(y, ens)), "fused_auc": site_mean_auc(fused, X, y, site_sizes),
           "configs": []}
    print(f"ensemble {out['ensemble_auc']:.3f}  fused {out['fused_auc']:.3f}  ({len(y)} tuning images)", flush=True)
    probes = {}
    for c in configs:
        n = int(c.get("probe_n", 320))
        if n not in probes:
            probes[n] = {z: load_probe(probe_src, z, n, seed=int(man.get("seed", 0))) for z in sizes}
        student = ds.student_model({"spec": fh["spec"], "state_dict": fused.state_dict()})
        t0 = time.perf_counter()  # the reference workload: the fused model over the probe at every size
        with torch.no_grad():
            for z in sizes:
                student(probes[n][z])
        ref_s = time.perf_counter() - t0
        w = ds.weights_of(uploads, c.get("weights", "samples"))
        if "data_free_rounds" in c:  # DENSE-style generator instead of the probe (the server's --data-free)
            from hfl_components.fusion.datafree import DataFreeConfig, distill_data_free

            r = distill_data_free(student, sizes, teachers, w, config=DataFreeConfig(
                rounds=c["data_free_rounds"], seed=int(man.get("seed", 0)), max_seconds=None))
            row = {"config": c, "auc": site_mean_auc(student, X, y, site_sizes), "seconds": r["seconds"],
                   "reference_seconds": ref_s, "steps_run": r["rounds_run"], "best_step": None,
                   "stopped": r["stopped"], "val_loss": None}
        else:
            cfg = DistillConfig(**{"steps": catalogue.option_defaults("ohfl")["distill_steps"],
                                   **{k: v for k, v in c.items() if k not in ("weights", "probe_n")}},
                                seed=int(man.get("seed", 0)))
            r = distill(student, sizes, teachers, probes[n], w, cfg)
            row = {"config": c, "auc": site_mean_auc(student, X, y, site_sizes), "seconds": r.seconds,
                   "reference_seconds": ref_s, "steps_run": r.steps_run, "best_step": r.best_step,
                   "stopped": r.stopped, "val_loss": r.val_loss}
        row["gap_to_ensemble"] = out["ensemble_auc"] - row["auc"]
        out["configs"].append(row)
        print(f"{c}: auc {row['auc']:.3f} (gap {row['gap_to_ensemble']:+.3f}), {row['steps_run']} steps, best "
              f"{row['best_step']}, {row['stopped']}, {row['seconds']:.1f} s (reference {ref_s:.2f} s)", flush=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
