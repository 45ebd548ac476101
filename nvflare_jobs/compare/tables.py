"""The comparison's tables: ``comparison.csv`` / ``comparison.md`` from the runs, the external evaluation's paired
table (``comparison_external.csv``, ``paired_external.json``)."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from hfl_components.flare import catalogue
from nvflare_jobs.compare.plan import CONTROL, METHODS, base_method, entry_of, budget_lines, split_variant

COLUMNS = ["method", "seed", "site", "model", "input_size", "n_test", "accuracy", "balanced_accuracy", "auc",
           "sensitivity", "specificity", "threshold", "deploy_rule", "deployed_round", "wall_seconds", "server_seconds",
           "bytes_up", "bytes_down", "site_bytes_up", "site_bytes_down", "site_peer_models_down"]
METRICS = ("accuracy", "balanced_accuracy", "auc", "sensitivity", "specificity")


def _server_seconds(m: dict) -> float | None:
    s = m.get("server_seconds") or {}
    if isinstance(s, dict):
        if "total" in s:
            return float(s["total"])
        vals = [v for v in s.values() if isinstance(v, (int, float))]
        return float(sum(vals)) if vals else None
    return float(s) if isinstance(s, (int, float)) else None


def collect_runs(out: Path) -> list[tuple[str, int, dict]]:
    """``(method, seed, metrics)`` for every ``OUT/seed<k>/<method>/metrics.json``."""
    runs = []
    for f in sorted(Path(out).glob("seed*/*/metrics.json")):
        m = json.loads(f.read_text())
        seed = int(f.parent.parent.name.removeprefix("seed"))
        m["_run_dir"] = str(f.parent)
        runs.append((f.parent.name, seed, m))
    return runs


def val_threshold_metrics(run_dir: str | Path) -> dict[str, dict]:
    """Binary runs: each site's deployed model re-evaluated on its own test split at the decision threshold chosen
    (Youden's J) on its own validation split. Cached in ``RUN/val_threshold_metrics.json``; ``{}`` when the run has
    no deployed models or is not binary.

    Returns:
        ``{site: {"threshold", "n_val", "test": compute_metrics(..., threshold), "argmax_accuracy"}}``; the argmax
        accuracy is the reloaded model's and must equal the site's own reported accuracy.
    """
    import torch

    from chest_xray import make_site_dataset
    from hfl_components.training import choose_threshold, compute_metrics, predict_proba
    from nvflare_jobs.evaluation import load_model_file, site_rows

    run = Path(run_dir)
    cache = run / "val_threshold_metrics.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    met = json.loads((run / "metrics.json").read_text())
    out: dict[str, dict] = {}
    if met.get("labels") != "binary":
        return out
    rows = site_rows(run)
    for site in met.get("sites", {}):
        f = run / "models" / f"{site}_deployed.pt"
        if not f.is_file() or site not in rows:
            continue
        model, blob = load_model_file(f)
        size = int(blob.get("input_size") or met["sites"][site].get("input_size") or 64)
        probs = {}
        for split in ("val", "test"):
            part = [r for r in rows[site] if r["split"] == split]
            dl = torch.utils.data.DataLoader(make_site_dataset(part, size, "eval"), batch_size=64) if part else []
            probs[split] = predict_proba(model, dl)
        (pv, yv), (pt, yt) = probs["val"], probs["test"]
        if yt.size == 0:
            continue
        thr = choose_threshold(yv, pv[:, 1]) if yv.size else 0.5
        out[site] = {"threshold": thr, "n_val": int(yv.size), "test": compute_metrics(yt, pt, 2, threshold=thr),
                     "argmax_accuracy": compute_metrics(yt, pt, 2)["accuracy"]}
    cache.write_text(json.dumps(out, indent=1))
    return out


def comparison_rows(runs: list[tuple[str, int, dict]], thresholds: bool = True) -> list[dict[str, Any]]:
    """One row per (method, seed, site). Sensitivity/specificity: at the threshold chosen on the site's validation
    split (binary runs with saved models, ``thresholds=True``), else the argmax rule of the site's own metrics.
    ``deploy_rule`` / ``deployed_round``: which model the site deployed (``metrics.json`` ``sites.<site>.deploy``,
    e.g. ``best_val`` and the round chosen on its validation split; empty for runs that did not record it).
    ``bytes_up`` / ``bytes_down``: the run's totals; ``site_bytes_up`` / ``site_bytes_down``: this site's
    (``metrics.json`` ``bytes_per_site``), and ``site_peer_models_down`` the bytes of the other sites' models it
    received where every site's model went to every site (FENS); empty where not recorded."""
    rows = []
    for method, seed, m in runs:
        vt = {}
        if thresholds and m.get("_run_dir"):
            try:
                vt = val_threshold_metrics(m["_run_dir"])
            except (OSError, ValueError, KeyError, RuntimeError) as e:
                print(f"[compare] {method} seed {seed}: no validation thresholds ({e})")
        for site, b in m.get("sites", {}).items():
            t = dict(b.get("test") or {})
            if site in vt:
                t.update({k: vt[site]["test"][k] for k in ("sensitivity", "specificity", "threshold")})
            spec = b.get("model") or {}
            per_site = (m.get("bytes_per_site") or {}).get(site) or {}
            rows.append({"method": method, "seed": seed, "site": site,
                         "model": "/".join(str(spec[k]) for k in ("family", "depth") if spec.get(k)),
                         "input_size": b.get("input_size"), "n_test": b.get("n_test"),
                         **{k: t.get(k) for k in METRICS}, "threshold": t.get("threshold"),
                         "deploy_rule": (b.get("deploy") or {}).get("rule"),
                         "deployed_round": (b.get("deploy") or {}).get("round"), "wall_seconds": m.get("wall_time_s"),
                         "server_seconds": _server_seconds(m), "bytes_up": m.get("bytes_uploaded"),
                         "bytes_down": m.get("bytes_downloaded"), "site_bytes_up": per_site.get("up"),
                         "site_bytes_down": per_site.get("down"),
                         "site_peer_models_down": per_site.get("peer_models_down")})
    return rows


def _fmt(v, nd=3) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{nd}f}"


def _mean_std(vals: list) -> str:
    v = [x for x in vals if x is not None]
    if not v:
        return "–"
    if len(v) == 1:
        return _fmt(v[0])
    return f"{np.mean(v):.3f} ± {np.std(v, ddof=1):.3f}"


def paired_diff(rows: list[dict], method: str, metric: str, ref: str = CONTROL) -> dict[str, Any]:
    """Paired difference ``method - ref`` over matching (seed, site) rows (one metric value per site test split):
    :func:`hfl_components.stats.paired_summaries` (seeds as clusters, seed-level t-interval); ``n`` = pairs."""
    from hfl_components.stats import paired_summaries

    a = {(r["seed"], r["site"]): r[metric] for r in rows if r["method"] == method}
    b = {(r["seed"], r["site"]): r[metric] for r in rows if r["method"] == ref}
    d = paired_summaries(a, b, metric)
    return {**d, "n": d["n_pairs"], "mean": d["diff"]}


def _write_csv(path: Path, rows: list[dict], columns: list[str]) -> None:
    """Write ``rows`` as a CSV with ``columns``: None as empty, floats rounded to 4 decimals."""
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=columns)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r[k] is None else (round(r[k], 4) if isinstance(r[k], float) else r[k]))
                        for k in columns})


def write_tables(out: Path, plans: dict | None = None, n_boot: int = 1000) -> list[dict]:
    """Write ``comparison.csv`` and ``comparison.md`` (and, after an external evaluation,
    ``comparison_external.csv`` and ``paired_external.json``) from the run folders under ``out``."""
    out = Path(out)
    runs = collect_runs(out)
    rows = comparison_rows(runs)
    _write_csv(out / "comparison.csv", rows, COLUMNS)
    ext = external_tables(out, runs, n_boot=n_boot)
    (out / "comparison.md").write_text(comparison_markdown(out, runs, rows, plans, ext))
    return rows


# ------------------------------------------------------------------------------------------------ external
EXT_COLUMNS = ["method", "seed", "model", "kind", "site", "input_size", "n", "auc", "balanced_accuracy", "accuracy",
               "sensitivity", "specificity"]


def load_external(out: Path) -> dict | None:
    """The external evaluation tables compare wrote (``comparison_external.csv``, ``paired_external.json``) as
    ``{"rows": [...], "paired": [...], ...}`` with numbers as floats; None when either file is missing."""
    out = Path(out)
    f_rows, f_pair = out / "comparison_external.csv", out / "paired_external.json"
    if not (f_rows.is_file() and f_pair.is_file()):
        return None
    rows = []
    with f_rows.open(newline="") as fh:
        for r in csv.DictReader(fh):
            for k in EXT_COLUMNS[7:]:
                r[k] = float(r[k]) if r.get(k) not in (None, "") else None
            r["seed"] = int(r["seed"])
            rows.append(r)
    return {**json.loads(f_pair.read_text()), "rows": rows}


def _external_name(out: Path) -> tuple[str | None, dict]:
    from nvflare_jobs.evaluation import external_name

    cj = json.loads((out / "compare.json").read_text()) if (out / "compare.json").is_file() else {}
    if not cj.get("external"):
        return None, cj
    return cj.get("external_name") or external_name(cj["external"], cj.get("part")), cj


def control_method(methods, cj: dict) -> str | None:
    """The local+ft control among ``methods``: ``local+ft``, or under equal budgets ``local`` (the same run)."""
    if "local+ft" in methods:
        return "local+ft"
    if CONTROL in methods and not cj.get("unequal_budgets"):
        return CONTROL
    return None


def paired_arrays(runs_by: dict, ma: str, mb: str, name: str, kind_a: str = "deployed", kind_b: str = "deployed"):
    """(y, A (S, K, N), B (S, K, N), seeds, sites) of the pneumonia-vs-normal scores of matching (seed, site) models
    on the images both methods' evaluations share; None when nothing pairs."""
    seeds = sorted(s for (m, s) in runs_by if m == ma and (mb, s) in runs_by)
    if not seeds:
        return None
    npz = {}
    for s in seeds:
        for m in (ma, mb):
            f = Path(runs_by[(m, s)]) / "external" / name / "predictions.npz"
            if not f.is_file():
                return None
            npz[(m, s)] = dict(np.load(f))
    sites = sorted({k.rsplit("_", 1)[0] for k in npz[(ma, seeds[0])] if k.endswith(f"_{kind_a}")}
                   & {k.rsplit("_", 1)[0] for k in npz[(mb, seeds[0])] if k.endswith(f"_{kind_b}")},
                   key=lambda x: (len(x), x))
    if not sites:
        return None
    common = set.intersection(*[set(d["paths"].tolist()) for d in npz.values()])
    paths = sorted(common)
    if not paths:
        return None
    ref = npz[(ma, seeds[0])]
    pos = {p: i for i, p in enumerate(ref["paths"].tolist())}
    y = (ref["y"][[pos[p] for p in paths]] > 0).astype(np.int64)

    def stack(m, kind):
        arr = []
        for s in seeds:
            d = npz[(m, s)]
            ix = {p: i for i, p in enumerate(d["paths"].tolist())}
            idx = [ix[p] for p in paths]
            arr.append([1.0 - d[f"{site}_{kind}"][idx, 0] for site in sites])
        return np.asarray(arr, dtype=np.float64)
    return y, stack(ma, kind_a), stack(mb, kind_b), seeds, sites


def external_tables(out: Path, runs, n_boot: int = 1000) -> dict | None:
    """Rows of every run's external evaluation (``comparison_external.csv``) and the paired differences of the
    deployed models against the local+ft control and FedAvg (``paired_external.json``). None without one."""
    from hfl_components.stats import PAIRED_METRICS, paired_crossed

    name, cj = _external_name(out)
    if not name:
        return None
    rows, runs_by, summaries = [], {}, {}
    for method, seed, m in runs:
        f = Path(m["_run_dir"]) / "external" / name / "summary.json"
        if not f.is_file():
            continue
        summ = json.loads(f.read_text())
        runs_by[(method, seed)] = m["_run_dir"]
        summaries[(method, seed)] = summ
        for model, v in summ["models"].items():
            rows.append({"method": method, "seed": seed, "model": model, "kind": v.get("kind"), "site": v.get("site"),
                         "input_size": v.get("input_size"), "n": summ.get("n_images"),
                         **{k: v.get(k) for k in EXT_COLUMNS[7:]}})
    if not rows:
        return None
    _write_csv(out / "comparison_external.csv", rows, EXT_COLUMNS)
    methods = method_order({m for m, _ in runs_by})
    control = control_method(methods, cj)
    pairs = []
    reference = catalogue.with_role("reference")
    for ref, label in ((control, "local+ft"), (reference if reference in methods else None, "FedAvg")):
        if not ref:
            continue
        for m in methods:
            if m != ref and not (label == "FedAvg" and m == control):
                pairs.append((m, "deployed", ref, "deployed", f"{m} vs {label}" + (" (local, same E epochs)"
                                                                                  if ref == CONTROL else "")))
    ceiling = next((m for m in methods if base_method(m) == catalogue.with_role("ceiling")), None)
    for m in methods:  # the gap to the pooled-data reference (against the control and FedAvg: above already)
        if ceiling and base_method(m) != base_method(ceiling) and m not in (control, reference):
            pairs.append((ceiling, "deployed", m, "deployed", f"{ceiling} vs {m} (gap to the pooled reference)"))
    for m in methods:
        if entry_of(m).schedule in ("one_shot", "ensemble"):  # its sites keep their pre-fusion local models
            pairs.append((m, "deployed", m, "local", f"{m} deployed vs its own pre-fusion local models"))
    # the primary endpoint: the main job's deployed models' AUC against local+ft (every other verdict exploratory)
    main = catalogue.with_schedule("one_shot")
    primary = next(((m, "deployed", control, "deployed") for m in sorted(methods, key=lambda m: m != main)
                    if base_method(m) == main and control), None)
    paired = []
    for ma, ka, mb, kb, label in pairs:
        arr = paired_arrays(runs_by, ma, mb, name, ka, kb)
        if arr is None:
            continue
        y, A, B, seeds, sites = arr
        if len(set(y.tolist())) < 2:
            continue
        res = {"comparison": label, "a": ma, "b": mb, "kind_a": ka, "kind_b": kb, "seeds": seeds, "sites": sites,
               "primary": "auc" if (ma, ka, mb, kb) == primary else None}
        for metric in PAIRED_METRICS:
            res[metric] = paired_crossed(y, A, B, metric, n_boot=n_boot, seed=0, seeds=seeds)
        paired.append(res)
    first = next(iter(summaries.values()))
    info = {"name": name, "data": first.get("data"), "part": first.get("part"),
            "n_images": sorted({v.get("n_images") for v in summaries.values()}),
            "probe_images_excluded": sorted({v.get("probe_images_excluded", 0) for v in summaries.values()}),
            "control": control, "n_boot": n_boot, "paired": paired}
    (out / "paired_external.json").write_text(json.dumps(info, indent=1))
    return {**info, "rows": rows}


def _ci_cell(d: dict) -> str:
    from hfl_components.stats import paired_cell

    return paired_cell(d)


def external_markdown(ext: dict, plans: dict) -> list[str]:
    rows = ext["rows"]
    methods = method_order({r["method"] for r in rows})
    seeds = sorted({r["seed"] for r in rows})
    fens = "; FENS's (the site models + the aggregator) once, at its own input size" if "fens" in methods else ""
    L = ["", f"## External evaluation: `{ext['data']}`" + (f", part `{ext['part']}`" if ext.get("part") else ""), "",
         f"{'/'.join(map(str, ext['n_images']))} images per run after leaving out "
         f"{'/'.join(map(str, ext['probe_images_excluded']))} probe images; seeds {', '.join(map(str, seeds))}. "
         "Every saved model of every run was evaluated (`cxr-hfl evaluate`, argmax decision); the global model is "
         f"scored at each site's input size and averaged over sites{fens}.", "",
         "### Endpoints: each site's deployed model", "",
         "Mean ± std over (seed, site) pairs.", "",
         "| method | epochs/site | model | n models | AUC | balanced accuracy | accuracy |", "|---|---|---|---|---|---|---|"]
    for m in methods:
        ep = plans.get(m, {}).get("total_epochs_per_site", "–")
        for kind, label in (("deployed", "deployed (per site)"), ("local", "pre-fusion local (per site)"),
                            ("federated", "fine-tuned federated, before the gate (per site)"),
                            ("global", "global (site mean)")):
            rs = [r for r in rows if r["method"] == m and r["kind"] == kind
                  and (kind != "global" or r["model"] == "global")]
            if not rs:
                continue
            L.append(f"| {m} | {ep} | {label} | {len(rs)} | " + " | ".join(
                _mean_std([r[k] for r in rs]) for k in ("auc", "balanced_accuracy", "accuracy")) + " |")
    sites = sorted({r["site"] for r in rows if r["kind"] == "deployed"}, key=lambda s: (len(s), s))
    L += ["", "### Per-site deployed-model AUC (mean over seeds)", "",
          "| method | " + " | ".join(sites) + " |", "|---|" + "---|" * len(sites)]
    for m in methods:
        cells = []
        for s in sites:
            v = [r["auc"] for r in rows if r["method"] == m and r["site"] == s and r["kind"] == "deployed"
                 and r["auc"] is not None]
            cells.append(_fmt(float(np.mean(v))) if v else "–")
        L.append(f"| {m} | " + " | ".join(cells) + " |")
    from hfl_components.stats import MARGINS, RULE_TEXT, endpoint_label, verdict_cell

    L += ["", "### Paired differences (same seed, same site)", "",
          "Mean over seeds of the seed's mean (A − B) over its sites' deployed models. 95% interval: cluster "
          f"bootstrap-t ({ext['n_boot']} replicates, `hfl_components.stats`): seeds resampled as clusters with their "
          "sites, one image draw per replicate shared by every seed and site, the replicates' standard error with "
          "the t quantile at seeds − 1 degrees of freedom; beside it the seed-level t-interval of the per-seed "
          "differences, an interval for these images only. Verdict: better (lower bound > 0) / not worse "
          f"(non-inferiority, lower bound > −δ; δ {MARGINS['auc']} AUC, {MARGINS['balanced_accuracy']} balanced "
          "accuracy) / worse (upper bound < 0) / inconclusive. " + RULE_TEXT + " Only the primary endpoint's verdict "
          "is confirmatory; the others are exploratory (no multiplicity correction). Pneumonia vs normal; balanced "
          "accuracy at the argmax rule.", ""]
    if ext.get("control") == CONTROL:
        L += ["Under equal budgets `local` is the local+ft control (each site's own model trained the same E epochs).",
              ""]
    L += ["| comparison | seeds | pairs | Δ AUC | verdict | Δ balanced accuracy | verdict |",
          "|---|---|---|---|---|---|---|"]
    for p in ext["paired"]:
        a, b = p["auc"], p["balanced_accuracy"]
        role = {k: endpoint_label(p.get("primary") == k) for k in ("auc", "balanced_accuracy")}
        L.append(f"| {p['comparison']} | {len(p['seeds'])} | {a['n_pairs']} | {_ci_cell(a)} | "
                 f"{verdict_cell(a)}, {role['auc']} | {_ci_cell(b)} | {verdict_cell(b)}, {role['balanced_accuracy']} |")
    return L


def method_order(methods) -> list[str]:
    """The distinct ``methods`` (names or variants such as ``ohfl:strategy=cdd``) in report order: the catalogue's
    order of their base method (:data:`~nvflare_jobs.compare.plan.METHODS`), unknown names last, then by name."""
    def key(m):
        name = split_variant(m)[0]
        return (METHODS.index(name) if name in METHODS else 99, m)
    return sorted(set(methods), key=key)


def comparison_markdown(out: Path, runs, rows, plans: dict | None = None, ext: dict | None = None) -> str:
    cj = json.loads((out / "compare.json").read_text()) if (out / "compare.json").is_file() else {}
    if plans is None:
        plans = cj.get("epoch_plan")
    plans = plans or {}
    methods = method_order(r["method"] for r in rows)
    seeds = sorted({r["seed"] for r in rows})
    sites = sorted({r["site"] for r in rows}, key=lambda s: (len(s), s))
    labels = {m.get("labels") for _, _, m in runs}
    L = ["# Method comparison", ""]
    if cj:
        L += [f"Command: `{cj.get('command') or '(not recorded)'}`", "",
              f"Data: `{cj.get('data')}` · {cj.get('sites')} sites, scheme `{cj.get('scheme')}` · labels "
              f"`{cj.get('labels')}` · seeds {', '.join(map(str, cj.get('seeds', [])))}", ""]
    if plans:
        L += ["## Budget", ""] + [f"- {x}" for x in budget_lines(plans, bool(cj.get("unequal_budgets")))] + [""]
    L += [f"Runs: {len(runs)} ({len(methods)} methods x {len(seeds)} seeds); label scheme(s): "
          f"{', '.join(sorted(x for x in labels if x))}. Every method ran on the identical partition per seed "
          "(`seed<k>/partition`).", ""]
    L += _mean_std_section(methods, rows, plans)
    L += _bytes_section(methods, rows)
    L += _gap_section(methods, rows)
    L += _pooled_section(runs)
    L += _records_section(runs)
    L += _per_site_sections(methods, sites, rows)
    L += _paired_section(methods, rows)
    if ext:
        L += external_markdown(ext, plans)
    L += _notes(methods, plans, cj)
    return "\n".join(L) + "\n"


def _mean_std_section(methods, rows, plans) -> list[str]:
    L: list[str] = []
    L += ["## Mean ± std per method", "",
          "Over all (seed, site) test sets. Sensitivity/specificity (binary labels) are at the decision threshold "
          "chosen (Youden's J) on each site's own validation split, never on test (`threshold` column of "
          "comparison.csv; empty = argmax rule); accuracy, balanced accuracy and AUC are the sites' own argmax "
          "metrics.", "",
          "| method | epochs/site | " + " | ".join(METRICS) + " | wall s | server s | bytes up | bytes down |",
          "|---|---|" + "---|" * (len(METRICS) + 4)]
    for m in methods:
        rs = [r for r in rows if r["method"] == m]
        runs_m = {(r["seed"]): r for r in rs}
        plan = plans.get(m, {})
        ep = plan.get("total_epochs_per_site", "–")
        L.append(f"| {m} | {ep} | " + " | ".join(_mean_std([r[k] for r in rs]) for k in METRICS) + " | "
                 + " | ".join(_mean_std([r[k] for r in runs_m.values()]) if k.endswith("seconds") else
                              f"{np.mean([r[k] or 0 for r in runs_m.values()]):,.0f}"
                              for k in ("wall_seconds", "server_seconds", "bytes_up", "bytes_down")) + " |")
    return L


def _bytes_section(methods, rows) -> list[str]:
    """Bytes per site: mean and largest over (seed, site) of what a site uploaded and downloaded, and the peers'
    models among its download (FENS: every site receives every other site's model)."""
    have = [m for m in methods if any(r["method"] == m and r.get("site_bytes_up") is not None for r in rows)]
    if not have:
        return []
    L = ["", "## Bytes per site", "",
         "Per site and run (`metrics.json` `bytes_per_site`: bytes of the arrays each site sent and was sent; central: "
         "its training images' file bytes up). Mean and largest over (seed, site). Peers' models: the bytes of the "
         "other sites' models a site received (every site's model sent to every site), and their share of its "
         "download.", "",
         "| method | up per site | largest up | down per site | largest down | peers' models per site | share of "
         "download |", "|---|---|---|---|---|---|---|"]
    for m in have:
        rs = [r for r in rows if r["method"] == m and r.get("site_bytes_up") is not None]
        up, down = [int(r["site_bytes_up"]) for r in rs], [int(r["site_bytes_down"] or 0) for r in rs]
        peer = [int(r["site_peer_models_down"]) for r in rs if r.get("site_peer_models_down") is not None]
        share = (f"{sum(peer) / sum(down):.0%}" if peer and sum(down) else "–")
        L.append(f"| {m} | {np.mean(up):,.0f} | {max(up):,} | {np.mean(down):,.0f} | {max(down):,} | "
                 + (f"{np.mean(peer):,.0f}" if peer else "–") + f" | {share} |")
    return L


def _gap_section(methods, rows) -> list[str]:
    """The gap of every method to the pooled-data reference (the catalogue's role ``ceiling``, ``central``):
    central − method, paired by (seed, site) on each site's own test split; nothing without central."""
    from hfl_components.stats import paired_cell

    ceiling = catalogue.with_role("ceiling")
    bases = [m for m in methods if base_method(m) == ceiling]
    others = [m for m in methods if base_method(m) != ceiling]
    if not bases or not others:
        return []
    c = bases[0]
    L = ["", f"## Gap to the pooled-data reference ({c})", "",
         f"`{c}`: one model of the deepest site architecture trained on the union of the sites' training images at "
         "the same epochs (pooled data: not a federated method; the ceiling the federation's gap is read against). "
         f"Gap = {c} − method, mean over seeds of the seed's mean over its sites' own test sets, with the 95% "
         "seed-level t-interval (per-seed values below the seeds an interval needs); positive: the pooled model "
         "is better.", "",
         "| method | pairs | gap accuracy | gap balanced accuracy | gap AUC |", "|---|---|---|---|---|"]
    for m in others:
        ds = {k: paired_diff(rows, c, k, ref=m) for k in ("accuracy", "balanced_accuracy", "auc")}
        L.append(f"| {m} | {max(d['n'] for d in ds.values())} | " + " | ".join(paired_cell(d) for d in ds.values())
                 + " |")
    return L


def _pooled_section(runs) -> list[str]:
    L: list[str] = []
    L += ["", "## Pooled test metrics with 95% bootstrap CI", "",
          "| method | seed | n | accuracy | balanced accuracy | AUC |", "|---|---|---|---|---|---|"]
    for method, seed, m in sorted(runs, key=lambda x: (method_order([r[0] for r in runs]).index(x[0]), x[1])):
        p = m.get("pooled") or {}

        def ci(k):
            v = p.get(k) or {}
            if v.get("value") is None:
                return "–"
            return f"{v['value']:.3f} ({_fmt(v.get('ci_low'))}–{_fmt(v.get('ci_high'))})"
        L.append(f"| {method} | {seed} | {p.get('n', '–')} | {ci('accuracy')} | {ci('balanced_accuracy')} | "
                 f"{ci('auc')} |")
    return L


def _records_section(runs) -> list[str]:
    """The methods' own record fields per run, as each catalogue entry declares them (``catalogue.record_summary``);
    nothing when no run has any."""
    lines = [f"- {m}, seed {seed}: " + "; ".join(f"{label}: {text}" for label, text in rec)
             for m, seed, met in sorted(runs, key=lambda r: (r[0], r[1]))
             if (rec := catalogue.record_summary(base_method(m), met))]
    return ["## Method records", "", *lines, ""] if lines else []


def _per_site_sections(methods, sites, rows) -> list[str]:
    L: list[str] = []
    for metric in ("accuracy", "balanced_accuracy", "auc"):
        L += ["", f"## Per-site {metric.replace('_', ' ')} (mean over seeds)", "",
              "| method | " + " | ".join(sites) + " |", "|---|" + "---|" * len(sites)]
        for m in methods:
            cells = []
            for s in sites:
                v = [r[metric] for r in rows if r["method"] == m and r["site"] == s and r[metric] is not None]
                cells.append(_fmt(float(np.mean(v))) if v else "–")
            L.append(f"| {m} | " + " | ".join(cells) + " |")
    return L


def _paired_section(methods, rows) -> list[str]:
    L: list[str] = []
    if CONTROL in methods and len(methods) > 1:
        from hfl_components.stats import RULE_TEXT, paired_cell, verdict_cell

        L += ["", "## Paired difference vs Local", "",
              "Mean over seeds of the seed's mean (method − Local) over its sites' own test sets; 95% seed-level "
              "t-interval (seeds − 1 degrees of freedom; the sites of a seed are not independent). " + RULE_TEXT
              + " Verdicts here are exploratory.", "",
              "| method | pairs | Δ accuracy | Δ balanced accuracy | Δ AUC | verdict (balanced accuracy) |",
              "|---|---|---|---|---|---|"]
        for m in methods:
            if m == CONTROL:
                continue
            ds = {k: paired_diff(rows, m, k) for k in ("accuracy", "balanced_accuracy", "auc")}
            n = max(d["n"] for d in ds.values())
            L.append(f"| {m} | {n} | " + " | ".join(paired_cell(d) for d in ds.values())
                     + f" | {verdict_cell(ds['balanced_accuracy'])} |")
    return L


def _notes(methods, plans, cj) -> list[str]:
    L: list[str] = []
    L += ["", "## Notes", ""]
    if catalogue.with_role("reference") in methods:
        L.append("- FedAvg runs under its own rule: every site trains the deepest architecture (one shared model), "
                 "so its sites do not keep their own depth/width as under Local, local+ft and OHFL.")
    if "local+ft" in methods and cj.get("unequal_budgets"):
        L.append("- `local+ft` is the compute-matched control: each site's local model trained for Local's epochs "
                 "plus as many extra epochs as OHFL's fine-tuning (one round of rounds x local_epochs + "
                 "finetune_epochs).")
    elif plans and not cj.get("unequal_budgets"):
        L.append("- Equal budgets: Local (= the local+ft control), FedAvg (rounds x local epochs) and OHFL (local + "
                 "fine-tuning epochs) train the same number of epochs per site.")
    if any(base_method(m) == catalogue.with_role("ceiling") for m in methods):
        L.append("- `central` is the pooled-data reference, not a federated method: every site's training images "
                 "leave the site (its bytes up are their files' bytes); each site scores the one pooled model at "
                 "the pooled model's input size.")
    L.append("- With few test images per site the per-site numbers are noisy; read the pooled CIs and the paired "
             "intervals before ranking methods.")
    return L
