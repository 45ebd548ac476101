"""Turn a job's server results (``cxr_hfl_results/``) into the run folder a hospital engineer reads.

Canonical ``RUN/metrics.json`` (every method extends it, none redefines it)::

    {"method", "labels", "seed", "wall_time_s", "expected_sites": [...], "not_deployed": {"<site>": reason},
     "sites": {"<site>": {"model": <spec>, "input_size", "n_train", "n_test", "test": {...}}},
     "excluded_sites": {"<site>": [{"round", "task", "reason"}]},
     "pooled": {<metrics over all sites' test images, each {"value", "ci_low", "ci_high"}>},
     "mean": {...}, "std": {...}, "bytes_uploaded", "bytes_downloaded",
     "bytes_per_site": {"<site>": {"up", "down"[, "peer_models_down"]}}, ...method extras}

Reported values are those of the final round. Also ``RUN/sites.csv``, ``RUN/rounds.csv`` and PNG plots.
"""
from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np

from hfl_components.communication import bytes_per_site
from hfl_components.flare import catalogue
from hfl_components.operating_point import site_decision_columns

from nvflare_jobs.models_index import write_models_index

SCALARS = ("accuracy", "balanced_accuracy", "auc", "sensitivity", "specificity")


def _strip_predictions(m: dict | None) -> dict | None:
    if not isinstance(m, dict):
        return m
    return {k: v for k, v in m.items() if not k.startswith("_")}


def _mean_std(site_tests: list[dict]) -> tuple[dict, dict]:
    mean, std = {}, {}
    for k in SCALARS:
        vals = [t[k] for t in site_tests if isinstance(t, dict) and t.get(k) is not None]
        mean[k] = float(np.mean(vals)) if vals else None
        std[k] = float(np.std(vals, ddof=1)) if len(vals) > 1 else None
    return mean, std


def find_server_results(workspace: str | Path) -> Path:
    """Locate ``server_results.json`` under a simulator workspace or a downloaded job folder."""
    hits = sorted(Path(workspace).rglob("cxr_hfl_results/server_results.json"))
    if not hits:
        raise FileNotFoundError(f"no cxr_hfl_results/server_results.json under {workspace}: the job did not finish")
    return hits[-1]


def assemble_run(server_results: str | Path, out_dir: str | Path, *, labels: str, seed: int, wall_time_s: float,
                 class_names: list[str], extra: dict | None = None) -> dict:
    """Write ``metrics.json``, ``sites.csv``, ``rounds.csv``, plots and copies of the server's model files.

    Args:
        server_results: path of ``server_results.json`` written by the controller.
        out_dir: the run folder.
        labels: label scheme name; class_names: its class names (for plots).
        seed, wall_time_s: recorded as is. extra: added to metrics.json (e.g. the command line).

    Returns:
        The metrics dict that was written.
    """
    from hfl_components.training import pooled_metrics_with_ci

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    src = Path(server_results)
    rec = json.loads(src.read_text())
    _copy_server_files(src.parent, out)
    sites, all_p, all_y, pooled_sites = _site_blocks(rec)
    num_classes = len(class_names)
    # plain (not class-stratified) bootstrap over the pooled test images, so a model that predicts one class for
    # everything does not get a zero-width interval from fixed class prevalence
    pooled = (pooled_metrics_with_ci(np.asarray(all_y), np.asarray(all_p), num_classes, stratified=False)
              if all_y else None)
    tests = [b["test"] for b in sites.values() if b.get("test")]
    mean, std = _mean_std(tests)
    metrics = {"method": rec.get("method"), "labels": labels, "seed": seed, "wall_time_s": round(wall_time_s, 2),
               "sites": sites, "pooled": pooled, "mean": mean, "std": std,
               "bytes_uploaded": rec.get("bytes_uploaded", 0), "bytes_downloaded": rec.get("bytes_downloaded", 0),
               # per site, up and down; a method that sends every site's model to every other site (record key
               # peer_model_bytes) adds the bytes of the peers' models each site receives
               "bytes_per_site": bytes_per_site(rec.get("rounds", []), rec.get("peer_model_bytes")),
               "server_seconds": rec.get("server_seconds", {}), "excluded_sites": rec.get("excluded", {}),
               **participation(rec),
               "rounds": _round_curves(rec), "timing": _timing(rec, wall_time_s),
               # which sites' per-image predictions the pooled metrics come from (share_predictions: true)
               "pooled_sites": pooled_sites}
    metrics.update(_tracking_stores(src.parent.parent))
    entry = catalogue.CATALOGUE.get(rec.get("method"))
    if entry is not None and entry.schedule == "one_shot":  # one global model per site: its spread and spec
        accs = [100.0 * b["test"]["accuracy"] for b in sites.values() if b.get("test") and b["test"].get("accuracy") is not None]
        metrics["fairness_variance"] = float(np.var(accs, ddof=1)) if len(accs) > 1 else None
        metrics["global_model"] = rec.get("global_spec")
    # the record fields every method may write, then the method's own (its catalogue entry declares them)
    for k in (*catalogue.COMMON_RECORD_KEYS, *(f.key for f in (entry.record_fields if entry else ()))):
        if k in rec and k not in metrics:
            metrics[k] = rec[k]
    if extra:
        metrics.update(extra)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    write_sites_csv(out / "sites.csv", sites)
    _write_rounds_csv(out / "rounds.csv", metrics["rounds"])
    if all_y:
        _write_predictions(out / "test_predictions.csv", rec, class_names)
    from nvflare_jobs import plots

    plots.make_all(out, metrics, rec, class_names)
    write_models_index(out, metrics)
    return metrics


def _copy_server_files(server_dir: Path, out: Path) -> None:
    """Copy the server's model files and alignment record (and OHFL's per-group global models) into the run folder."""
    for name in ("global_model.pt", "global_fused.pt", "alignment_record.json"):
        if (server_dir / name).is_file():
            shutil.copy2(server_dir / name, out / name)
    if (server_dir / "global_models").is_dir():  # OHFL with several architecture groups
        shutil.copytree(server_dir / "global_models", out / "global_models", dirs_exist_ok=True)


def _site_blocks(rec: dict) -> tuple[dict, list, list, list]:
    """``(sites, pooled probabilities, pooled labels, the sites they come from)``: each site's block of
    ``metrics.json`` (per-image predictions stripped) and the test predictions of the sites that shared them."""
    sites, all_p, all_y, pooled_sites = {}, [], [], []
    for site, s in sorted(rec.get("sites", {}).items()):
        test = s.get("test") or {}
        if test.get("_probs"):
            pooled_sites.append(site)
            all_p.extend(test["_probs"])
            all_y.extend(test["_labels"])
        block = {"model": s.get("model"), "input_size": s.get("input_size"), "n_train": s.get("n_train"),
                 "n_test": s.get("n_test"), "test": _strip_predictions(test) if test else None}
        for k in ("local", "global_zero_shot", "finetune_loss", "gate", "deploy", "operating_point", "acceptance",
                  "dp", "releases"):
            if k in s:
                block[k] = _strip_predictions(s[k])
        sites[site] = block
    return sites, all_p, all_y, pooled_sites


def _tracking_stores(server_run_dir: Path) -> dict:
    """Where the run's tracking went: NVFlare's TBAnalyticsReceiver's event files (``tb_events/<site>/``) and the
    MLflowReceiver's own store (``mlflow.db`` when no tracking URI was given)."""
    found = {}
    tb = server_run_dir / "tb_events"
    if tb.is_dir():
        found["tensorboard"] = str(tb.resolve())
    if (server_run_dir / "mlflow.db").is_file():
        found["mlflow"] = f"sqlite:///{(server_run_dir / 'mlflow.db').resolve()}"
    return found


def participation(rec: dict) -> dict:
    """The record's ``expected_sites`` (the job's expected sites; default: every site the record names) and
    ``not_deployed`` ({site: reason}, the expected sites the job never reached), as ``metrics.json`` keeps them."""
    named = set(rec.get("sites") or {}) | set(rec.get("excluded") or {}) | set(rec.get("cross_site") or {})
    return {"expected_sites": sorted(rec.get("expected_sites") or named),
            "not_deployed": dict(rec.get("not_deployed") or {})}


def _timing(rec: dict, wall_time_s: float) -> dict:
    """Where the wall time went: the sites' own compute (summed, and the per-round slowest site = the critical
    path when sites run in parallel) and the server's seconds; the rest is federation overhead (process start,
    messaging, waiting)."""
    per_round = [[v for v in (r.get("site_compute_s") or {}).values() if v is not None] for r in rec.get("rounds", [])]
    total = sum(sum(v) for v in per_round)
    critical = sum(max(v) for v in per_round if v)
    server = float((rec.get("server_seconds") or {}).get("total", 0.0))
    return {"wall_s": round(wall_time_s, 2), "site_compute_total_s": round(total, 2),
            "site_compute_critical_path_s": round(critical, 2), "server_total_s": round(server, 2),
            "overhead_ratio": round(wall_time_s / critical, 2) if critical > 0 else None}


def _round_curves(rec: dict) -> list[dict]:
    rows = []
    for r in rec.get("rounds", []):
        accs = {s: (m.get("val") or {}).get("accuracy") for s, m in r.get("sites", {}).items()}
        rows.append({"round": r["round"], "task": r["task"], "seconds": round(r.get("seconds", 0.0), 2),
                     "site_compute_s": r.get("site_compute_s", {}),
                     "bytes_up": r.get("bytes_up", 0), "bytes_down": r.get("bytes_down", 0),
                     "val_accuracy": accs, "errors": r.get("errors", {}),
                     **({"diagnostics": {s: {k: m[k] for k in ("D_r", "D_rs") if k in m}
                                         for s, m in r.get("sites", {}).items()}}
                        if any("D_r" in m for m in r.get("sites", {}).values()) else {})})
    return rows


def write_sites_csv(path: Path, sites: dict) -> None:
    """``sites.csv``: one row per site (model, sizes, the test metrics, and beside AUC the test sensitivity /
    specificity at the site's operating point and its acceptance outcome) from ``metrics.json``'s site blocks."""
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        # beside AUC: sensitivity / specificity at the site's operating point and its acceptance outcome
        w.writerow(["site", "model", "input_size", "n_train", "n_test", *SCALARS, "op_sensitivity",
                    "op_specificity", "acceptance"])
        for site, b in sites.items():
            t = b.get("test") or {}
            m = b.get("model") or {}
            d = site_decision_columns(b)
            name = "/".join(str(m.get(k)) for k in ("family", "depth", "width") if m.get(k) is not None)
            w.writerow([site, name, b.get("input_size"), b.get("n_train"), b.get("n_test"),
                        *[("" if t.get(k) is None else round(t[k], 4)) for k in SCALARS],
                        *[("" if d[k] is None else round(d[k], 4)) for k in ("sensitivity", "specificity")],
                        d["acceptance"] or ""])


def _write_rounds_csv(path: Path, rounds: list[dict]) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["round", "task", "site", "val_accuracy", "bytes_up", "bytes_down", "seconds"])
        for r in rounds:
            for site, acc in sorted(r["val_accuracy"].items()):
                w.writerow([r["round"], r["task"], site, "" if acc is None else round(acc, 4), r["bytes_up"],
                            r["bytes_down"], r["seconds"]])


def _write_predictions(path: Path, rec: dict, class_names: list[str]) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["site", "index", "label", *[f"p_{c}" for c in class_names]])
        for site, s in sorted(rec.get("sites", {}).items()):
            t = s.get("test") or {}
            for i, (p, y) in enumerate(zip(t.get("_probs", []), t.get("_labels", []))):
                w.writerow([site, i, y, *[round(float(v), 5) for v in p]])


def print_summary(m: dict, run_dir: Path) -> None:
    """Print a finished run's per-site table, gate and deploy decisions, pooled accuracy and warnings."""
    print(f"\n[cxr-hfl] {m['method']} finished in {m['wall_time_s']:.0f} s -> {run_dir}")
    print(f"{'site':<10}{'model':<22}{'size':>5}{'n_test':>8}{'acc':>8}{'bal_acc':>9}{'auc':>7}{'sens':>7}"
          f"{'spec':>7}  acceptance")
    for site, b in m["sites"].items():
        t = b.get("test") or {}
        spec = b.get("model") or {}
        name = f"{spec.get('family')}/{spec.get('depth', spec.get('feature_dim', ''))}"
        d = site_decision_columns(b)  # at the site's operating point

        def f(v):
            return "   -" if v is None else f"{v:.3f}"
        print(f"{site:<10}{name:<22}{b.get('input_size') or '':>5}{b.get('n_test') or '':>8}{f(t.get('accuracy')):>8}"
              f"{f(t.get('balanced_accuracy')):>9}{f(t.get('auc')):>7}{f(d['sensitivity']):>7}"
              f"{f(d['specificity']):>7}  {d['acceptance'] or '-'}")
    if m.get("acceptance"):
        print(m["acceptance"].get("line") or "")
    gate = m.get("gate")
    if gate:
        print(f"deployment gate: {gate['adopted']} of {gate['sites']} sites adopted the federated model"
              + (f"; kept their own local model: {', '.join(gate['kept_local'])}" if gate.get("kept_local") else ""))
    if m.get("operating_point"):  # OHFL's clinical operating point: one line, then each site's own values
        from hfl_components.operating_point import describe, site_rates_line

        print(describe(m["operating_point"]))
        if m["operating_point"].get("site_sensitivity") and m["operating_point"].get("threshold") is not None:
            print(site_rates_line(m["operating_point"]))
    deploy = {s: b["deploy"] for s, b in m["sites"].items() if isinstance(b.get("deploy"), dict)}
    if deploy:  # deploy: best_val (metrics.json sites.<site>.deploy)
        print("deployed round (deploy: best_val): " + "; ".join(
            f"{s} round {d.get('round')} ({d.get('rule')}, validation balanced accuracy "
            + (f"{d['score']:.3f})" if isinstance(d.get("score"), (int, float)) and d["score"] >= 0 else "n/a)")
            for s, d in deploy.items()))
    if m.get("pooled"):
        acc = m["pooled"].get("accuracy") or {}
        if isinstance(acc, dict) and acc.get("value") is not None:
            print(f"pooled accuracy {acc['value']:.3f} (95% CI {acc['ci_low']:.3f}-{acc['ci_high']:.3f})")
    for site, b in m["sites"].items():
        cm = (b.get("test") or {}).get("confusion_matrix")
        if cm and sum(1 for col in zip(*cm) if sum(col) > 0) == 1:
            print(f"WARNING: {site}'s deployed model predicts a single class for every test image "
                  f"(confusion matrix {cm}); it has not learned a usable decision rule")
    for site, why in sorted((m.get("not_deployed") or {}).items()):
        print(f"NOT PART OF THE JOB: {site}: {why} (metrics.json: not_deployed)")
    if m.get("excluded_sites"):
        print("excluded sites (metrics.json: excluded_sites):")
        for site, events in m["excluded_sites"].items():
            reasons = list(dict.fromkeys(ev.get("reason") for ev in events))
            where = ", ".join(f"round {ev.get('round')} {ev.get('task')}" for ev in events)
            print(f"  {site}: {where}: " + " / ".join(str(r) for r in reasons))
    for note in m.get("notes") or []:  # FedSAF/FedTopo run reports (e.g. no_topq identical to the default)
        print(f"note: {note}")
    if m.get("tensorboard"):
        print(f"training curves (per-site loss, validation): tensorboard --logdir {m['tensorboard']}")
    if m.get("mlflow"):
        print(f"MLflow store: {m['mlflow']} (mlflow ui --backend-store-uri {m['mlflow']})")
