"""Time OHFL's server stage (fusion, then distillation) in isolation, on the uploads of a finished main-job run.

The server's own code path with the catalogue's defaults: the six uploads (``RUN/models/site-*_local.pt``, sample
counts from ``RUN/metrics.json``), the probe as the controller prepares it (``distill_probe_size`` images of the
run's probe source at every site input size, drawn with the run's seed; the first ``probe_size`` are fusion's),
``aggregate_models`` per fusable group, then ``distil_groups``. Prints the seconds of each stage and the largest
absolute difference of the fused and distilled weights from the run's ``global_fused.pt`` / ``global_model.pt``
(the same code must reproduce them), and writes a JSON record (``--out``) and, with ``--save``, the fused and
distilled state dicts (to compare two versions of the code on the same inputs).

    PYTHONPATH=$PWD python -m studies.server_stage.time_server_stage --run runs/demo --out timing.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def load_uploads(run: Path) -> dict:
    """{site: upload entry as the controller builds it} from a run's local models and metrics."""
    from hfl_components.models.files import load_model_file

    man = json.loads((run / "metrics.json").read_text())
    uploads = {}
    for f in sorted((run / "models").glob("site-*_local.pt")):
        m, h = load_model_file(f)
        site = f.stem.rsplit("_", 1)[0]
        uploads[site] = {"name": site, "spec": h["spec"], "state_dict": m.state_dict(),
                         "n_samples": int(man["sites"][site]["n_train"]), "val_acc": 0.0, "val_auc": None,
                         "input_size": int(h["input_size"])}
    return uploads


def server_stage(uploads: dict, opts: dict, probe_all: dict, seed: int, device="cpu", cap: bool = True) -> dict:
    """Fusion of every fusable group, then distillation, as the OHFL controller runs them (``cap``: with the
    server's wall-clock cap on distillation, which makes the result depend on the machine's load); returns
    {"fused": {group: state}, "students": {group: entry}, "seconds": {...}, "fusion_phases": {...}}."""
    import torch

    from hfl_components.flare import distill_stage as ds
    from hfl_components.flare.distill_stage import DISTILL_MAX_SECONDS
    from hfl_components.fusion import aggregate_models

    groups = ds.architecture_groups({s: u["spec"] for s, u in uploads.items()})
    secs, cpu, phases, fused = {}, {}, {}, {}
    t0, c0 = time.perf_counter(), time.process_time()
    for g, sites in ds.fusable_groups(groups, uploads).items():
        models = [uploads[s] for s in sites]
        sizes = sorted({m["input_size"] for m in models})
        probe = {sz: probe_all[sz][:int(opts["probe_size"])] for sz in sizes}
        spec, state, rec = aggregate_models(models, strategy=opts["strategy"], probe=probe,
                                            alignment=opts["alignment"], ot_solver=opts["ot"],
                                            ground_metric=opts["ground_metric"], weighting=opts["weighting"],
                                            seed=seed, repair=opts["repair"], cka=opts["cka"], device=device)
        fused[g] = (spec, state)
        phases[g] = rec["phase_seconds"]
    secs["fusion"], cpu["fusion"] = time.perf_counter() - t0, time.process_time() - c0
    students = ds.initial_students(groups, {s: u["spec"] for s, u in uploads.items()}, uploads, fused)
    t0, c0 = time.perf_counter(), time.process_time()
    recs = ds.distil_groups(students, uploads, probe_all, torch.device(device), steps=int(opts["distill_steps"]),
                            temperature=float(opts["distill_temperature"]), weighting=opts["distill_weights"],
                            augment=bool(opts["distill_augment"]), data_free=False, data_free_rounds=0,
                            in_channels=1, seed=seed, max_seconds=DISTILL_MAX_SECONDS if cap else None,
                            teacher=opts["distill_teacher"], feature_weight=opts["distill_feature_weight"],
                            feature_layer=opts["distill_feature_layer"])
    secs["distillation"], cpu["distillation"] = time.perf_counter() - t0, time.process_time() - c0
    return {"fused": {g: f[1] for g, f in fused.items()}, "students": students, "seconds": secs, "cpu_seconds": cpu,
            "fusion_phases": phases, "distillation": {g: {k: r[k] for k in ("steps_run", "best_step", "stopped",
                                                                             "seconds", "best_val_loss")}
                                                      for g, r in recs.items()}}


def max_gap(a: dict, b: dict) -> float:
    """Largest absolute difference over the tensors of two state dicts with the same keys."""
    import torch

    if set(a) != set(b):
        raise ValueError(f"state dicts with different keys: {sorted(set(a) ^ set(b))[:4]}")
    return max(float((torch.as_tensor(a[k]).double() - torch.as_tensor(b[k]).double()).abs().max()) if
               torch.as_tensor(a[k]).numel() else 0.0 for k in a)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, help="a finished `simulate --method ohfl` run folder")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--out", help="JSON file for the record")
    ap.add_argument("--save", help="file (torch.save) for the fused and distilled state dicts")
    ap.add_argument("--label", default="", help="a name for this code version in the record")
    ap.add_argument("--no-cap", action="store_true", help="no wall-clock cap on distillation (reproducible "
                    "weights on a loaded machine)")
    args = ap.parse_args(argv)
    run = Path(args.run)
    if not (run / "metrics.json").is_file() or not (run / "global_fused.pt").is_file():
        print(f"time_server_stage: {run}: no metrics.json / global_fused.pt (a finished OHFL run)", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(args.threads)
    from hfl_components.flare import catalogue
    from hfl_components.flare.probe import load_probe
    from hfl_components.models.files import load_model_file

    opts = {**catalogue.option_defaults("ohfl"), **json.loads((run / "job_options.json").read_text())}
    seed = int(opts["seed"])
    uploads = load_uploads(run)
    sizes = sorted({u["input_size"] for u in uploads.values()})
    n = max(int(opts["probe_size"]), int(opts["distill_probe_size"]))
    t0 = time.perf_counter()
    probe_all = {sz: load_probe(str(opts["probe"]), sz, n, in_channels=1, seed=seed) for sz in sizes}
    probe_s = time.perf_counter() - t0
    load0 = os.getloadavg()[0]
    out = server_stage(uploads, opts, probe_all, seed, cap=not args.no_cap)
    load1 = os.getloadavg()[0]
    ref_fused = load_model_file(run / "global_fused.pt")[0].state_dict()
    ref_global = load_model_file(run / "global_model.pt")[0].state_dict()
    (g, fused), = out["fused"].items()
    rec = {"label": args.label, "run": run.name, "threads": args.threads, "probe_seconds": probe_s,
           "seconds": out["seconds"], "cpu_seconds": out["cpu_seconds"], "capped": not args.no_cap,
           "fusion_phases": out["fusion_phases"], "distillation": out["distillation"],
           "load_average_1min": [load0, load1],
           "max_abs_gap_to_run": {"fused": max_gap(fused, ref_fused),
                                  "distilled": max_gap(out["students"][g]["state_dict"], ref_global)}}
    print(json.dumps(rec, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(rec, indent=1) + "\n")
    if args.save:
        torch.save({"fused": out["fused"], "distilled": {k: st["state_dict"] for k, st in out["students"].items()}},
                   args.save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
