"""Choose FedProto's alignment weights on the sites' *validation* splits only.

One federation in process (``benchmarks.fedbench``-style: the method's real controller and site handlers, NVFlare's
transport replaced by a direct call) on ``chest_xray_224``'s tuning + probe parts (the ``evaluation`` part is never
read), Dirichlet partition, 6 sites, the prototype defaults (``PROTO_TRAINING``). After the last round each site's
deployed model is scored on its own validation split and on the pooled validation images of all sites restricted to
the classes it holds (:func:`studies.proto_tuning.tune_proto.pooled_val_loader`).
Also printed: the mean feature norm of each
site's training features and the spread of the global prototypes (why MSE alignment collapses). Test splits and the
evaluation part are never touched.

    python -m studies.proto_tuning.tune_fedproto --method fedproto --opts lam=0,gamma=0.015625 --seed 0
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch



class _Stop(BaseException):
    """Stops the controller before its final (test) evaluation task."""


def run(method: str, profile: dict, opts: dict, workdir: Path, on_result=None):
    """One federation in process (:class:`hfl_components.flare.inprocess.InProcessTransport`), stopped before its
    final (test) evaluation task; returns ``(runtimes, trace of site-2's global prototypes per round)``. A site's
    failure is raised, not answered."""
    from hfl_components.flare.inprocess import InProcessTransport, runtime_answer
    from hfl_components.flare.site_tasks import SiteRuntime
    from nvflare_jobs.jobs import make_controller

    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    ctl = make_controller(method, profile, opts)
    runtimes = {s: SiteRuntime(cfg, workdir / s) for s, cfg in profile.items()}
    trace = []
    handlers = runtime_answer(runtimes, raise_errors=True, on_result=on_result)

    def answer(task_name, site, data):
        if task_name == "evaluate":  # never evaluate on test here: stop before the final evaluation task
            raise _Stop
        params, metrics, meta_out = handlers(task_name, site, data)
        gp = (data.params or {}).get("global_prototypes")
        if gp is not None and np.asarray(gp).size and site == "site-2":
            P = np.asarray(gp)
            trace.append({"round": data.current_round, "gp_norms": np.linalg.norm(P, axis=1).round(2).tolist(),
                          "gp_pair_dist": [round(float(np.linalg.norm(P[i] - P[j])), 2)
                                           for i in range(len(P)) for j in range(i + 1, len(P))],
                          "terms": metrics.get("alignment_terms_last_batch")})
        return params, metrics, meta_out

    InProcessTransport(runtimes, answer).attach(ctl, workdir / "server", info=lambda m: None,
                                                warning=lambda m: None)
    try:
        ctl.run()
    except _Stop:
        pass
    return runtimes, trace


COMMON_OPTS = ("rounds", "local_epochs", "finetune_epochs", "finetune_lr", "seed", "min_sites")


def parse_opts(method: str, text: str, base: dict) -> dict:
    """``--opts`` ``"k=v,..."`` on top of ``base``: each key one of the method's catalogue options or
    :data:`COMMON_OPTS`, values as the catalogue types and checks them (``catalogue.validate_options``).

    Raises:
        ValueError: one line naming the item, key or option (not ``k=v``, unknown key, bad value, unknown method).
    """
    from hfl_components.flare.catalogue import entry, validate_options

    keys = {o.key for o in entry(method).options} | set(COMMON_OPTS)
    opts = dict(base)
    for kv in filter(None, text.split(",")):
        k, eq, v = kv.partition("=")
        if not eq or not k.strip():
            raise ValueError(f"--opts item {kv!r} is not key=value")
        k = k.strip()
        if k not in keys:
            raise ValueError(f"--opts key {k!r} is not an option of {method}; allowed: {', '.join(sorted(keys))}")
        opts[k] = v.strip()
    for k in COMMON_OPTS:
        if k in opts:
            try:
                opts[k] = float(opts[k]) if k == "finetune_lr" else int(opts[k])
            except ValueError:
                raise ValueError(f"--opts {k}={opts[k]!r}: expected a number") from None
    opts.update(validate_options(method, opts, require=False))
    return opts


def main() -> None:
    from studies.proto_tuning.tune_proto import build_sites, pooled_val_loader
    from hfl_components.training import compute_metrics, extract_features, predict_proba

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[2].parent / "shared/data/chest_xray_224"))
    ap.add_argument("--method", default="fedproto")
    ap.add_argument("--opts", default="", help="k=v,... method options (lam, gamma, alignment, rounds, ...)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--site", action="append", default=[], help="k=v site-config override (repeatable)")
    ap.add_argument("--extra-original", action="store_true",
                    help="sites also hold chest_xray_original (850 images, patient-disjoint from chest_xray_224)")
    ap.add_argument("--json", help="append the summary as one JSON line to this file")
    a = ap.parse_args()
    torch.set_num_threads(1)
    opts = {"rounds": a.rounds, "local_epochs": 1, "seed": a.seed}
    try:
        opts = parse_opts(a.method, a.opts, opts)
    except ValueError as e:
        print(f"tune_fedproto: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        extra = (Path(a.data).parent / "chest_xray_original",) if a.extra_original else ()
        profile = build_sites(a.seed, work, 0.5, "dirichlet", 64, Path(a.data), extra_roots=extra)
        from nvflare_jobs.profiles import PROTO_TRAINING

        for s, cfg in profile.items():
            cfg.update({k: v for k, v in PROTO_TRAINING.items() if k != "input_size"})
            for kv in a.site:
                k, v = kv.split("=")
                cfg[k] = json.loads(v)
        rts, trace = run(a.method, profile, opts, work / "ws")
        rows = []
        for site, rt in rts.items():
            m = rt.evaluate("val")
            cm = np.asarray(m["confusion_matrix"])
            single = bool((cm.sum(axis=0) > 0).sum() == 1 and (cm.sum(axis=1) > 0).sum() > 1)
            pool = pooled_val_loader(profile, rt)
            pp, py = predict_proba(rt.model, pool)
            pm = compute_metrics(py, pp, rt.num_classes)
            pool224 = pooled_val_loader(profile, rt, only="chest_xray_224")
            pp2, py2 = predict_proba(rt.model, pool224)
            pm2 = compute_metrics(py2, pp2, rt.num_classes)
            Z, _ = extract_features(rt.model, rt.loader("train", train_mode=False))
            rows.append({"site": site, "family": rt.cfg["model"]["family"], "n_train": rt.n_train(),
                         "val_bal": m["balanced_accuracy"], "val_auc": m["auc"], "val_single": single,
                         "pool_bal": pm["balanced_accuracy"], "pool_auc": pm["auc"],
                         "pool224_bal": pm2["balanced_accuracy"], "pool224_n": len(pool224.dataset),
                         "pool_single": bool(len(np.unique(pp.argmax(1))) == 1),
                         "feat_norm": float(np.linalg.norm(Z, axis=1).mean())})
    for r in rows:
        print(json.dumps(r), flush=True)
    for t in trace[:: max(1, len(trace) // 5)]:
        print("trace", json.dumps(t))
    vb = [r["val_bal"] for r in rows if r["val_bal"] is not None]
    summ = {"method": a.method, "opts": a.opts, "site": a.site, "seed": a.seed, "rounds": a.rounds,
            "val_bal": float(np.mean(vb)), "val_auc": float(np.nanmean([r["val_auc"] or np.nan for r in rows])),
            "val_single": int(sum(r["val_single"] for r in rows)),
            "pool_bal": float(np.mean([r["pool_bal"] for r in rows])),
            "pool_single": int(sum(r["pool_single"] for r in rows)),
            "pool224_bal": float(np.mean([r["pool224_bal"] for r in rows])), "extra_original": a.extra_original,
            "wall_s": round(time.perf_counter() - t0),
            "rows": rows}
    print("SUMMARY", json.dumps({k: v for k, v in summ.items() if k != "rows"}), flush=True)
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps(summ) + "\n")


if __name__ == "__main__":
    main()
