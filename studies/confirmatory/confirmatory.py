"""The main job's confirmatory run: run the pre-registered protocol seed by seed, then analyse it once.

The protocol is ``studies/confirmatory/protocols/<name>/PROTOCOL.md`` (committed before any run). This script
does exactly what it says and nothing else:

* ``run``: the comparison (:func:`nvflare_jobs.compare.compare`, in this process) of the protocol's methods at the protocol's seeds, one seed at a time into one
  comparison folder (compare resumes: finished runs are kept, an interrupted seed is run again), with the external
  evaluation on the protocol's part after each seed; after each seed the seed's result tables are copied into the
  results folder (``seeds/seed<k>/``) so that they can be committed as they finish. A ``--plan`` that is empty,
  missing or malformed, or names a method (or variant) ``compare`` does not run, is refused in one line before any
  seed (exit 2); a seed whose comparison refuses its input (exit 2) copies and records nothing.
* ``analyse``: the primary endpoint and the secondary endpoints from the comparison folder, written to
  ``result.json`` and ``RESULT.md`` in the results folder. The inference is :mod:`hfl_components.stats`: the
  crossed cluster bootstrap-t for paired differences on the shared external images (Owen 2007), the seed-level
  t-interval for per-seed summaries; verdicts only with at least ``MIN_SEEDS`` seeds. A folder where a method of
  the protocol lacks its run at a seed, a run file that is not its folder's method and seed, or an unreadable file
  is refused in one line naming it (exit 2) before anything is written. The tests and their levels come from the
  protocol's α plan (``alpha_plan.json``, :mod:`studies.confirmatory.alpha_plan`): a plan that is missing, or a
  ``--primary`` / ``--looks`` it does not list, is refused the same way; a row the plan does not test gets no
  verdict unless the plan (a legacy one) kept the exploratory verdicts its protocol printed.

``python -m studies.confirmatory.confirmatory run --cmp runs/confirmatory`` then
``python -m studies.confirmatory.confirmatory analyse --cmp runs/confirmatory``; ``--part tuning --results DIR``
runs the same protocol on the tuning part (the timing seed, or a dry rehearsal of the analysis).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from hfl_components.stats import MARGINS, MIN_SEEDS, seed_mean_interval
from studies.confirmatory.alpha_plan import PlanError, load_plan, require_test, run_sequence
from studies.confirmatory.confirmatory_report import markdown  # noqa: F401 (RESULT.md; re-exported)

RESULTS = Path(__file__).resolve().parent / "protocols" / "confirmatory"
#: the protocol (PROTOCOL.md states the same; a change here after the run starts is a deviation)
SEEDS = (10, 11, 12, 13, 14)
METHODS = "local,fedavg,ohfl"
MAIN = "ohfl"
#: what is copied of each run: enough to redo the analysis without the run folders (no model file, no image)
RUN_FILES = ("metrics.json", "models.json")
EXT_FILES = ("summary.json", "audit.json", "predictions.npz", "*_deployed.json")  # the last: each deployed model's operating-point record


def compare_options(seeds: list[int], cmp: Path, data: str | None, external: str, part: str,
                    audit: bool = True, methods: str = METHODS) -> dict:
    """The comparison options of the protocol for ``seeds`` (:class:`nvflare_jobs.compare.CompareOptions`; default
    budgets: 30 epochs per site); ``audit=False`` sets ``no_audit`` (a protocol without the shortcut-audit
    endpoints); ``methods``: the protocol's methods, comma-separated (:func:`plan_methods` of its α plan)."""
    opts = {"methods": methods, "seeds": list(seeds), "sites": 6, "scheme": "width", "external": external,
            "part": part, "out": str(cmp), "data": data, "no_audit": not audit}
    flags = ["--methods", methods, "--seeds", ",".join(map(str, seeds)), "--sites", "6", "--scheme", "width",
             "--external", external, "--part", part, "--out", str(cmp)]
    opts["argv"] = ["compare", *flags, *(["--data", data] if data else []), *([] if audit else ["--no-audit"])]
    return opts


def run(args) -> int:
    from nvflare_jobs.compare import compare

    cmp, res = Path(args.cmp), Path(args.results)
    seeds = list(args.seeds) if args.seeds is not None else list(SEEDS)
    methods = METHODS
    if getattr(args, "plan", None) is not None:  # an empty --plan "" is a missing plan, not the default methods
        try:
            methods = run_methods(args.plan)
        except PlanError as e:
            print(f"confirmatory: {e}; nothing was run", file=sys.stderr)
            return 2
    done: list[int] = []
    for s in seeds:
        done.append(s)
        opts = compare_options(done, cmp, args.data, args.external, args.part, audit=not args.no_audit,
                               methods=methods)
        print(f"[confirmatory] seed {s}: cxr-hfl {' '.join(opts['argv'])}", flush=True)
        t0 = time.perf_counter()
        rc = compare(**opts)
        wall = time.perf_counter() - t0
        print(f"[confirmatory] seed {s}: rc={rc} in {wall:.0f} s", flush=True)
        if rc == 2:  # compare refused its input before any run: nothing to copy, no wall time to record
            print(f"[confirmatory] seed {s}: compare refused its input (above); nothing was run or copied",
                  file=sys.stderr)
            return 2
        dest = copy_seed(cmp, res, s, methods)
        (dest / "wall_seconds.txt").write_text(f"{wall:.0f}\n")
        if rc != 0:
            print(f"[confirmatory] seed {s}: compare returned {rc}; rerun the same command to retry", file=sys.stderr)
            return rc
    return 0


def _sanitise(text: str, cmp: Path) -> str:
    """Machine paths out of a copied text file: the comparison folder becomes ``runs/confirmatory``, the checkout
    ``.`` and the folder beside it ``..`` (so ``../shared/data`` reads as in the README)."""
    repo = Path(__file__).resolve().parents[2]  # the checkout: studies/confirmatory/ is two levels below it
    for a, b in ((str(Path(cmp).resolve()), f"runs/{Path(cmp).resolve().name}"), (str(repo), "."), (str(repo.parent), "..")):
        text = text.replace(a, b)
    return text


def relative_predictions(src: Path, dest: Path) -> None:
    """Copy an external evaluation's ``predictions.npz`` with every image keyed by its path relative to the evaluated
    set's root (``train/NORMAL/IM-0115-0001.jpeg``, as in ``chest_xray/splits/``) instead of a machine path. The root
    is the ``data`` of the ``summary.json`` beside ``src``; every other array is copied unchanged. A common prefix
    keeps the sorted order of the paths, so an analysis that pairs images by sorted path draws the same images.

    Raises:
        ValueError: no readable ``summary.json`` with ``data`` beside ``src``, or a path of ``src`` outside that root
            (the message names the file).
    """
    import numpy as np

    with np.load(src, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    if "paths" not in arrays or not any(Path(str(p)).is_absolute() for p in arrays["paths"]):
        shutil.copy2(src, dest)  # nothing machine-specific in it: the file as it is
        return
    summ = Path(src).parent / "summary.json"
    try:
        root = Path(json.loads(summ.read_text(encoding="utf-8"))["data"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{summ}: no readable 'data' (the evaluated set's root): {type(e).__name__}") from None
    rel = []
    for p in map(str, arrays["paths"]):
        q = Path(p)
        if not q.is_absolute():
            rel.append(p)
            continue
        try:
            rel.append(q.relative_to(root).as_posix())
        except ValueError:
            raise ValueError(f"{src}: image {p} is not under the evaluated set's root {root}") from None
    arrays["paths"] = np.asarray(rel)
    np.savez_compressed(dest, **arrays)


def copy_seed(cmp: Path, res: Path, seed: int, methods: str = METHODS) -> Path:
    """Copy one finished seed's records into ``res/seeds/seed<k>/<method>/`` in the comparison folder's own layout
    (``metrics.json``, ``models.json``, ``external/<set>/summary.json``, ``audit.json``, ``predictions.npz``), machine
    paths replaced (:func:`_sanitise`; the predictions' image paths made relative by :func:`relative_predictions`), and ``compare.json`` into ``res/seeds/``; :func:`analyse` can then be run on
    ``res/seeds`` if the run folders are gone. ``methods``: the protocol's methods, comma-separated. Returns the
    seed's folder."""
    cmp, root = Path(cmp), Path(res) / "seeds"
    dest = root / f"seed{seed}"
    files = [cmp / "compare.json"] + [f for m in methods.split(",") for f in
                                      [*(cmp / f"seed{seed}" / m / n for n in RUN_FILES),
                                       *(g for n in EXT_FILES for g in (cmp / f"seed{seed}" / m).glob(f"external/*/{n}"))]]
    for f in files:
        if not f.is_file():
            continue
        to = root / f.relative_to(cmp)
        to.parent.mkdir(parents=True, exist_ok=True)
        if f.suffix == ".npz":
            relative_predictions(f, to)
        else:
            to.write_text(_sanitise(f.read_text(encoding="utf-8"), cmp), encoding="utf-8")
    return dest


# ------------------------------------------------------------------------------------------------ analysis
class BadInput(ValueError):
    """A file of the comparison folder that the analysis cannot read; the message names it."""


def _json(path: Path) -> dict:
    """``path``'s JSON object. Raises :class:`BadInput` naming the file when it is missing, unreadable or not an
    object (the reading rule of :func:`nvflare_jobs.evaluation.run_metrics`)."""
    from nvflare_jobs.evaluation import run_metrics

    if not path.is_file():
        raise BadInput(f"{path}: no such file")
    try:
        return run_metrics(path.parent, path.name)
    except ValueError as e:
        raise BadInput(str(e)) from None


def _check_paired(paired: dict, path: Path) -> None:
    """Raise :class:`BadInput` naming ``path`` and the first key that the analysis needs and does not find."""
    if not isinstance(paired.get("name"), str) or not isinstance(paired.get("paired"), list):
        raise BadInput(f"{path}: no 'name' (text) and 'paired' (list): not a compare --external paired file")
    for i, q in enumerate(paired["paired"]):
        need = ("comparison", "auc", "balanced_accuracy") + (("seeds",) if isinstance(q, dict)
                                                              and q.get("primary") else ())
        miss = [k for k in need if not isinstance(q, dict) or k not in q]
        bad = [m for m in ("auc", "balanced_accuracy") if m not in miss
               and not (isinstance(q[m], dict) and {"a", "b"} <= set(q[m]))]
        if miss or bad:
            raise BadInput(f"{path}: paired[{i}] lacks {', '.join(miss + [m + '.a/b' for m in bad])}")


def check_runs(cmp: Path, seeds=SEEDS, methods: str = METHODS) -> None:
    """Raise :class:`BadInput` unless every method of the protocol (:data:`METHODS`) has its finished run
    (``seed<k>/<method>/metrics.json``) at every seed of ``seeds`` and no protocol method has a run at another seed:
    the paired rows and the per-seed summaries must come from the same runs. The message names every missing
    ``seed<k>/<method>`` (or the seeds outside ``seeds``); a run's ``metrics.json`` must be a readable JSON object
    whose ``method`` and ``seed`` are its folder's (a file copied from another run is named). ``methods``: the
    protocol's methods, comma-separated (:func:`plan_methods`)."""
    methods = methods.split(",")
    miss = [f"seed{s}/{m}" for s in seeds for m in methods if not (cmp / f"seed{s}" / m / "metrics.json").is_file()]
    if miss:
        raise BadInput(f"{cmp}: no finished run (metrics.json) in {', '.join(miss)}: every method of the protocol "
                       f"must have its run at every seed ({','.join(map(str, seeds))})")
    for s in seeds:
        for m in methods:
            f = cmp / f"seed{s}" / m / "metrics.json"
            met = _json(f)
            if met.get("method") != m or met.get("seed") != s:
                raise BadInput(f"{f}: records method {met.get('method')!r}, seed {met.get('seed')!r}, not its "
                               f"folder's {m!r}, seed {s} (a run copied from another method or seed?)")
    extra = sorted({int(p.parent.parent.name[4:]) for m in methods for p in cmp.glob(f"seed*/{m}/metrics.json")
                    if p.parent.parent.name[4:].isdigit()} - set(seeds))
    if extra:
        raise BadInput(f"{cmp}: runs at seed(s) {','.join(map(str, extra))}, outside the analysed seeds "
                       f"{','.join(map(str, seeds))}")


def _check_protocol(cmp: Path, paired: dict, path: Path, methods: str = METHODS) -> None:
    """Raise :class:`BadInput` when ``cmp`` is not a comparison of the protocol's methods (its ``compare.json``) or
    ``paired_external.json`` holds no primary comparison of :data:`MAIN`: a result of another comparison must never
    be written as the confirmatory one."""
    rec = _json(cmp / "compare.json") if (cmp / "compare.json").is_file() else {}
    got = rec.get("methods")
    if isinstance(got, list) and set(got) != set(methods.split(",")):
        raise BadInput(f"{cmp / 'compare.json'}: methods {','.join(map(str, got))}, not the protocol's {methods}")
    if not any(isinstance(q, dict) and q.get("primary") and str(q.get("comparison", "")).startswith(MAIN + " ")
               for q in paired["paired"]):
        raise BadInput(f"{path}: no primary comparison of {MAIN} (its runs or evaluations are missing)")


def _runs(cmp: Path, method: str) -> dict[int, Path]:
    out = {}
    for p in sorted(cmp.glob(f"seed*/{method}")):
        seed = p.parent.name.removeprefix("seed")
        if seed.isdigit() and (p / "metrics.json").is_file():
            out[int(seed)] = p
    return out


def _ext(run: Path, name: str, f: str) -> dict | None:
    p = run / "external" / name / f
    return _json(p) if p.is_file() else None


def _deployed(models: dict) -> dict[str, dict]:
    return {k: v for k, v in models.items() if isinstance(v, dict) and v.get("kind") == "deployed"}


def per_seed_summaries(cmp: Path, name: str, method: str = MAIN) -> dict[str, dict]:
    """``{endpoint: {(seed, site-or-'all'): value}}`` of the per-run secondary endpoints of ``method``'s runs:
    the global and fused models' AUC gap to the site ensemble, the deployed models' shift (border) probe change of
    p(NORMAL), their AUC margin over the metadata baseline, the gate's adoptions, and at the federated threshold: each
    deployed model's sensitivity / specificity on the evaluation images (``eval_*``; every model scores the same
    images, so the per-seed mean is the value pooled over the evaluation images) with the lowest site's sensitivity,
    and, for reference, the server's pooled validation-histogram values (``fed_*``, where the threshold is chosen)
    and the pooled sensitivity on the sites' own test splits (``test_sensitivity``).

    Raises:
        BadInput: a run's ``metrics.json``, ``summary.json`` or ``audit.json`` is not a readable JSON object (named).
    """
    out: dict[str, dict] = {k: {} for k in ("gap_global", "gap_fused", "border_dp_normal", "border_flagged",
                                            "metadata_margin", "margin_covers_zero", "metadata_auc", "fed_sensitivity",
                                            "fed_specificity", "fed_threshold", "site_sensitivity", "adopted",
                                            "eval_sensitivity", "eval_specificity", "eval_min_sensitivity",
                                            "test_sensitivity")}
    for seed, run in _runs(cmp, method).items():
        summ, audit = _ext(run, name, "summary.json"), _ext(run, name, "audit.json")
        met = _json(run / "metrics.json")
        if summ:
            for kind, key in (("global", "gap_global"), ("fused", "gap_fused")):
                g = ((summ.get("models") or {}).get(kind) or {}).get("gap_to_ensemble_auc")
                if g is not None:
                    out[key][(seed, "all")] = g
        for site, v in (met.get("sites") or {}).items():
            if (v.get("gate") or {}).get("adopted") is not None:
                out["adopted"][(seed, site)] = float(bool(v["gate"]["adopted"]))
        if not audit:
            continue
        for mname, pr in _deployed((audit.get("probes") or {}).get("models") or {}).items():
            sh = pr.get("shift") or {}
            if sh.get("mean_change") is not None:  # probes report p(PNEUMONIA); binary: dp(NORMAL) = -dp(PNEUMONIA)
                out["border_dp_normal"][(seed, mname)] = -float(sh["mean_change"])
                out["border_flagged"][(seed, mname)] = float(bool(sh.get("flagged")))
        md = audit.get("metadata") or {}
        if md.get("auc") is not None:
            out["metadata_auc"][(seed, "all")] = float(md["auc"])
        for mname, mg in (md.get("margins") or {}).items():
            if mname.endswith("_deployed") and mg.get("margin") is not None:
                out["metadata_margin"][(seed, mname)] = float(mg["margin"])
                out["margin_covers_zero"][(seed, mname)] = float(bool(mg.get("covers_zero")))
        fed = (audit.get("operating_point") or {}).get("federated") or {}
        for k, key in (("sensitivity", "fed_sensitivity"), ("specificity", "fed_specificity"),
                       ("threshold", "fed_threshold")):
            if fed.get(k) is not None:
                out[key][(seed, "all")] = float(fed[k])
        for site, sv in (fed.get("site_sensitivity") or {}).items():
            if sv.get("sensitivity") is not None:
                out["site_sensitivity"][(seed, site)] = float(sv["sensitivity"])
        if (fed.get("test") or {}).get("sensitivity") is not None:
            out["test_sensitivity"][(seed, "all")] = float(fed["test"]["sensitivity"])
        ops = {k: v for k, v in ((audit.get("operating_point") or {}).get("models") or {}).items()
               if k.endswith("_deployed") and isinstance(v, dict)}
        for k, key in (("sensitivity", "eval_sensitivity"), ("specificity", "eval_specificity")):
            for mname, v in ops.items():
                if (v.get(k) or {}).get("value") is not None:
                    out[key][(seed, mname)] = float(v[k]["value"])
        sens = [v for (s_, _), v in out["eval_sensitivity"].items() if s_ == seed]
        if sens:
            out["eval_min_sensitivity"][(seed, "all")] = min(sens)
    return out


def _npz_error(path: Path) -> str | None:
    """Why ``path`` is not a readable predictions file (every array loaded, ``paths`` and ``y`` present), or None."""
    import zipfile

    import numpy as np

    try:
        with np.load(path, allow_pickle=False) as z:
            for k in z.files:
                z[k]
            miss = [k for k in ("paths", "y") if k not in z.files]
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as e:
        return f"not a readable .npz ({type(e).__name__}: {(str(e).splitlines() or [''])[0]})"
    return f"lacks {', '.join(miss)}: not an external evaluation's predictions" if miss else None


def check_rebuild_inputs(cmp: Path, seeds=SEEDS) -> None:
    """Raise :class:`BadInput` naming the first file that the rebuild of the paired tables from a copy
    (:func:`nvflare_jobs.compare.tables.external_tables`) would fail on or silently leave out: every protocol
    method's run at every seed in ``seeds`` must hold the external evaluation's ``predictions.npz`` (one external
    set for all), any run's ``metrics.json`` and external ``summary.json`` must be a readable JSON object and every
    ``predictions.npz`` must load, so that a bad or missing file is refused before anything is written into
    ``cmp``."""
    names = sorted({p.parent.name for p in cmp.glob("seed*/*/external/*/predictions.npz")})
    if len(names) != 1:
        raise BadInput(f"{cmp}: expected one external evaluation set, found {', '.join(names) or 'none'}")
    missing = [f"seed{s}/{m}/external/{names[0]}/predictions.npz" for s in seeds for m in METHODS.split(",")
               if not (cmp / f"seed{s}" / m / "external" / names[0] / "predictions.npz").is_file()]
    if missing:
        raise BadInput(f"{cmp}: no {', '.join(missing)} (every protocol run's predictions are needed to rebuild the "
                       "paired tables)")
    for f in sorted(cmp.glob("seed*/*/metrics.json")) + sorted(cmp.glob("seed*/*/external/*/summary.json")):
        _json(f)
    for f in sorted(cmp.glob("seed*/*/external/*/predictions.npz")):
        why = _npz_error(f)
        if why:
            raise BadInput(f"{f}: {why}")


def _check_seeds(paired: dict, path: Path, seeds) -> None:
    """Raise :class:`BadInput` when the primary comparison of ``paired_external.json`` is not over ``seeds``."""
    prim = next(q for q in paired["paired"] if isinstance(q, dict) and q.get("primary"))
    if sorted(map(str, prim["seeds"])) != sorted(map(str, seeds)):
        raise BadInput(f"{path}: the primary comparison is over seeds {','.join(map(str, prim['seeds']))}, not the "
                       f"analysed seeds {','.join(map(str, seeds))} (rebuild it from the runs)")


def analyse(args) -> int:
    cmp, res = Path(args.cmp), Path(args.results)
    seeds = tuple(args.seeds)
    pj = cmp / "paired_external.json"
    plan_path = Path(getattr(args, "plan", None) or res / "alpha_plan.json")
    try:
        early = load_plan(plan_path)
        methods = plan_methods(early) if plan_complete(early) else METHODS
    except PlanError:  # the plan's own one-line refusal comes after the runs' checks, below
        methods = METHODS
    if not pj.is_file() and list(cmp.glob("seed*/*/external/*/predictions.npz")):  # a copy made by copy_seed
        from nvflare_jobs.compare.tables import collect_runs, external_tables

        try:
            check_runs(cmp, seeds, methods)
            check_rebuild_inputs(cmp, seeds)
        except BadInput as e:
            print(f"confirmatory: {e}; nothing was written", file=sys.stderr)
            return 2
        external_tables(cmp, collect_runs(cmp))
    if not pj.is_file():
        print(f"confirmatory: no {pj}: run the protocol first", file=sys.stderr)
        return 2
    try:
        paired = _json(pj)
        _check_paired(paired, pj)
        _check_protocol(cmp, paired, pj, methods)
        check_runs(cmp, seeds, methods)
        _check_seeds(paired, pj, seeds)
        name = paired["name"]
        summ = per_seed_summaries(cmp, name)
        local = per_seed_summaries(cmp, name, "local")
        plan, test = planned_primary(plan_path, getattr(args, "primary", None), getattr(args, "looks", None))
        control = test["b"]
        prim = _set_primary(paired["paired"], control)
        if prim is None:  # the protocol's primary endpoint: a result without it is not the confirmatory one
            raise BadInput(f"{pj}: no '{PRIMARY_ROWS[control]}' row (--primary {control}): its runs' evaluations or "
                           "predictions are missing")
        looks = test.get("looks")
        corrected = None
        if test["alpha"] < plan["total_alpha"] or looks:  # the row at the plan's level decides
            check_corrected_inputs(cmp, name, prim, pj)
            corrected = corrected_primary(cmp, name, prim, looks or 1, paired.get("n_boot") or 1000,
                                          alpha=test["alpha"])
            if corrected is None:
                raise BadInput(f"{cmp}: the predictions of {prim['a']} and {prim['b']} share no images or sites: no "
                               f"interval at the α plan's level {test['alpha']:g}")
            if not looks:
                corrected.pop("looks")
                corrected["procedure"] = plan["procedure"]
                corrected["hypothesis"] = test["hypothesis"]
        seq = (sequence(cmp, name, plan, paired.get("n_boot") or 1000)
               if plan["procedure"] == "fallback" and plan_complete(plan) else None)
    except (BadInput, PlanError) as e:
        print(f"confirmatory: {e}; nothing was written", file=sys.stderr)
        return 2
    sec = {k: seed_mean_interval(v) for k, v in summ.items()}
    sec_local = {k: seed_mean_interval(v) for k, v in local.items() if k in ("border_dp_normal", "metadata_margin")}
    out = {"data": paired.get("data"), "part": paired.get("part"), "n_images": paired.get("n_images"),
           "seeds": prim["seeds"] if prim else None, "min_seeds": MIN_SEEDS, "margins": MARGINS,
           "primary": {"comparison": prim["comparison"], "metric": "auc", **prim["auc"]} if prim else None,
           **({"primary_corrected": corrected, "verdict_from": "primary_corrected"} if corrected else {}),
           "paired": paired["paired"], "secondary": sec, "secondary_local": sec_local,
           **({"sequence": seq} if seq is not None else {})}
    if not plan.get("exploratory_verdicts", False):  # a test the plan does not list gets no verdict
        out["plan"] = {"file": plan_path.name, "procedure": plan["procedure"], "primary": test["id"],
                       "later_levels": "set by the fallback sequence (docs/evaluation.md); not computed here"}
        for q in out["paired"]:
            for m in ("auc", "balanced_accuracy"):
                if q.get("primary") != m and isinstance(q.get(m), dict):
                    q[m] = {**q[m], "verdict": None, "note": "not a test of the α plan: described, no verdict"}
    res.mkdir(parents=True, exist_ok=True)
    (res / "result.json").write_text(json.dumps(out, indent=1, default=str))
    (res / "RESULT.md").write_text(markdown(out))
    print((res / "RESULT.md").read_text())
    return 0


def check_corrected_inputs(cmp: Path, name: str, prim: dict, path: Path) -> None:
    """Raise :class:`BadInput` naming the first thing that the Bonferroni-corrected primary row (``analyse --looks
    K``, K > 1) needs and lacks: the compared methods in the primary row of ``path`` (``a``, ``b``, ``kind_a``,
    ``kind_b``, as compare writes them) and a readable ``predictions.npz`` of both methods at every seed of the row
    (``seed<k>/<method>/external/<name>/``). Without them the verdict would silently come from the 95 % row."""
    miss = [k for k in ("a", "b", "kind_a", "kind_b") if not isinstance(prim.get(k), str)]
    if miss:
        raise BadInput(f"{path}: the primary row lacks {', '.join(miss)}, which --looks needs to recompute it from "
                       "the predictions (rebuild the paired file with compare)")
    for s in prim["seeds"]:
        for m in (prim["a"], prim["b"]):
            f = cmp / f"seed{s}" / m / "external" / name / "predictions.npz"
            why = "no such file" if not f.is_file() else _npz_error(f)
            if why:
                raise BadInput(f"{f}: {why} (--looks recomputes the primary row from every seed's predictions of "
                               "both methods)")


def corrected_primary(cmp: Path, name: str, prim: dict, looks: int, n_boot: int = 1000,
                      alpha: float | None = None) -> dict | None:
    """The primary comparison's AUC difference at the level the α plan gives it: ``alpha`` (default the
    Bonferroni-corrected ``0.05 / looks`` of a protocol that is the ``looks``-th test of one hypothesis, Dunn 1961),
    from the runs' ``predictions.npz`` with the crossed cluster bootstrap-t of the 95 % row
    (``hfl_components.stats.paired_crossed``, the same replicates' seed).

    Returns:
        ``paired_crossed``'s record plus ``looks`` and ``comparison``; None when the predictions do not pair.
    """
    from hfl_components.stats import paired_crossed
    from nvflare_jobs.compare.tables import paired_arrays, collect_runs

    runs_by = {(m, s): r["_run_dir"] for m, s, r in collect_runs(cmp)}
    arr = paired_arrays(runs_by, prim["a"], prim["b"], name, prim["kind_a"], prim["kind_b"])
    if arr is None:
        return None
    y, A, B, seeds, _ = arr
    level = 0.05 / looks if alpha is None else alpha
    return {**paired_crossed(y, A, B, "auc", n_boot=n_boot, seed=0, seeds=seeds, alpha=level),
            "looks": looks, "comparison": prim["comparison"]}


def planned_primary(path: Path, control: str | None, looks: int | None) -> tuple[dict, dict]:
    """The α plan at ``path`` and its primary test, refusing a request the plan does not list: ``control``
    (``--primary``) must be the control of the plan's primary test, and ``looks`` (``--looks``) its number of
    looks (1 for a test without); None accepts the plan's.

    Raises:
        PlanError: no valid plan at ``path``; the plan's primary is not a paired AUC test of :data:`MAIN` against a
            control this analysis forms (:data:`PRIMARY_ROWS`); or the request differs from the plan.
    """
    plan = load_plan(path)
    test = plan["tests"][0]
    if (test.get("a"), test.get("metric")) != (MAIN, "auc") or test.get("b") not in PRIMARY_ROWS:
        raise PlanError(f"{path}: the plan's primary test {test['id']} is not {MAIN} vs one of "
                        f"{', '.join(PRIMARY_ROWS)} on auc, the comparison this analysis forms")
    if control is not None:
        t = require_test(plan, path, MAIN, control, "auc")
        if t is not test:
            raise PlanError(f"{path}: --primary {control}: the plan's primary test is {MAIN} vs {test['b']} "
                            f"({t['id']} comes later in its sequence); a test the plan does not list as primary is "
                            "refused")
    if looks is not None and looks != test.get("looks", 1):
        raise PlanError(f"{path}: --looks {looks}: the plan tests its primary at alpha {test['alpha']:g}"
                        + (f" ({test['looks']} looks)" if test.get("looks") else " (one look)")
                        + "; a test the plan does not list is refused")
    return plan, test


#: ``analyse --primary``: the control of the primary comparison -> the start of its paired row's label
PRIMARY_ROWS = {"local": f"{MAIN} vs local+ft", "fedavg": f"{MAIN} vs FedAvg"}


def _set_primary(rows: list[dict], control: str) -> dict | None:
    """Mark the paired row of :data:`MAIN`'s deployed models against ``control`` (``local`` or ``fedavg``) as the
    primary endpoint (AUC) and clear the flag of every other row, in place; returns that row, or None when it is
    absent. A protocol names its primary comparison; compare's own flag is the local+ft one."""
    want = PRIMARY_ROWS[control]
    found = None
    for q in rows:
        hit = found is None and str(q.get("comparison", "")).startswith(want)
        q["primary"] = "auc" if hit else None
        found = q if hit else found
    return found



# ------------------------------------------------------------------------------------------- the α plan's sequence
def plan_complete(plan: dict) -> bool:
    """Whether every one-sample test of ``plan`` has its threshold (a plan whose open thresholds ``PROTOCOL.md`` has
    not fixed yet runs its primary only; its later tests are not run)."""
    return all(isinstance(t.get("threshold"), (int, float)) for t in plan["tests"]
               if t.get("hypothesis") in ("at_least", "at_most", "within"))


def plan_methods(plan: dict) -> str:
    """The methods a protocol runs, comma-separated: :data:`METHODS` for a plan of one test (protocols 1-3), else
    :data:`METHODS` plus every method a paired test of the plan names (protocol 4 adds ``central``)."""
    named = [m for t in plan["tests"] for m in (t.get("a"), t.get("b")) if isinstance(m, str)]
    base = METHODS.split(",")
    return ",".join(base + sorted(set(named) - set(base)))


def run_methods(path: str | Path) -> str:
    """:func:`plan_methods` of the α plan at ``path`` for ``run`` / ``copy``, refusing a paired test that names a
    method ``compare`` does not run (a typo such as ``fedavgg``) or a variant whose options it refuses
    (:func:`nvflare_jobs.compare.plan.check_variant`) before any seed is run or copied.

    Raises:
        PlanError: an empty ``path``; :func:`~studies.confirmatory.alpha_plan.load_plan`'s; or the unknown method
            (the message names ``path``, the test and the method).
    """
    from nvflare_jobs.compare.plan import METHODS as COMPARE_METHODS, check_variant

    if not str(path).strip():  # Path("") would read as the current folder
        raise PlanError("--plan is empty: give the protocol's alpha_plan.json")
    plan = load_plan(path)
    for t in plan["tests"]:
        for m in (t.get("a"), t.get("b")):
            if isinstance(m, str) and m.split(":")[0] not in COMPARE_METHODS:
                raise PlanError(f"{path}: test {t['id']} names method {m!r}, which compare does not run (known: "
                                f"{', '.join(COMPARE_METHODS)})")
            if isinstance(m, str) and (why := check_variant(m)):  # a variant's bad options (ohfl:ot=foo)
                raise PlanError(f"{path}: test {t['id']}: {why}")
    return plan_methods(plan)


def clinical_values(cmp: Path, name: str, method: str = MAIN) -> dict[str, dict]:
    """``{endpoint: {(seed, key): value}}`` of the α plan's one-sample endpoints for ``method``'s runs evaluated on
    the external set ``name``: ``eval_sensitivity`` / ``eval_specificity`` pooled over the deployed models at each
    model's own operating point (hits over positives summed over the models; key ``(seed, "all")``),
    ``operating_point_efficiency`` per deployed model where it is counted (achieved sensitivity >= 0.93;
    :func:`hfl_components.operating_point.operating_point_efficiency`), ``refusal_rate`` = sites the acceptance
    check refused / sites (a refused site counted once), and the audit's ``border_dp_normal`` and
    ``metadata_margin`` per deployed model (:func:`per_seed_summaries`). Records as
    :func:`studies.site_operating_point.tuning_endpoints.endpoints` reads them.

    Raises:
        BadInput: a run's records are unreadable (named).
    """
    from studies.site_operating_point.tuning_endpoints import endpoints

    out: dict[str, dict] = {k: {} for k in ("eval_sensitivity", "eval_specificity", "operating_point_efficiency",
                                            "refusal_rate")}
    for seed, run in _runs(cmp, method).items():
        if not (run / "external" / name).is_dir():
            continue
        try:
            e = endpoints(run, name)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise BadInput(f"{run}: its operating-point records are unreadable ({type(err).__name__}: {err})") from None
        for k, key in (("pooled_sensitivity", "eval_sensitivity"), ("pooled_specificity", "eval_specificity")):
            if e.get(k) is not None:
                out[key][(seed, "all")] = float(e[k])
        for site, m in e["models"].items():
            if m.get("efficiency") is not None and m.get("efficiency_counted"):
                out["operating_point_efficiency"][(seed, site)] = float(m["efficiency"])
        acc = e["acceptance"]
        if acc.get("sites"):
            out["refusal_rate"][(seed, "all")] = len(acc.get("refused") or []) / float(acc["sites"])
    summ = per_seed_summaries(cmp, name, method)
    out["border_dp_normal"], out["metadata_margin"] = summ["border_dp_normal"], summ["metadata_margin"]
    return out


def paired_at_level(cmp: Path, name: str, a: str, b: str, alpha: float, n_boot: int = 1000) -> dict | None:
    """The deployed models' AUC difference ``a - b`` on the external set ``name`` with its two-sided ``1 - alpha``
    crossed cluster bootstrap-t interval (:func:`hfl_components.stats.paired_crossed`, the replicates' seed 0),
    paired by (seed, site); a method with one deployed model per seed (``central``) is paired with every site.
    Returns ``paired_crossed``'s record plus ``estimate``, or None when nothing pairs."""
    import numpy as np

    from hfl_components.stats import paired_crossed
    from nvflare_jobs.compare.tables import collect_runs, paired_arrays

    runs_by = {(m, s): r["_run_dir"] for m, s, r in collect_runs(cmp)}
    arr = paired_arrays(runs_by, a, b, name)
    if arr is None:  # b with a single model per seed: pair it with each of a's sites
        ref = paired_arrays(runs_by, a, a, name)
        one = paired_arrays(runs_by, b, b, name)
        if ref is None or one is None or one[1].shape[1] != 1 or ref[3] != one[3] or ref[1].shape[2] != one[1].shape[2]:
            return None
        y, A, _, seeds, _ = ref
        B = np.repeat(one[1], A.shape[1], axis=1)
    else:
        y, A, B, seeds, _ = arr
    r = paired_crossed(y, A, B, "auc", n_boot=n_boot, seed=0, seeds=seeds, alpha=alpha)
    return {**r, "estimate": r["diff"], "comparison": f"{a} vs {b}"}


def sequence(cmp: Path, name: str, plan: dict, n_boot: int = 1000) -> list[dict]:
    """Every test of a ``fallback`` α plan, in its order and at its level (:func:`studies.confirmatory.alpha_plan.
    run_sequence`): a paired test from :func:`paired_at_level`, a one-sample endpoint from the seed-level
    t-interval of :func:`clinical_values` (seeds are the unit; sites within a seed averaged first). An endpoint
    without a reliable interval (fewer than ``MIN_SEEDS`` seeds, or not measured) does not succeed.

    Raises:
        PlanError: a one-sample test whose threshold is still null.
        BadInput: unreadable run records.
    """
    vals = clinical_values(cmp, name)

    def interval_at(t: dict, alpha: float) -> dict | None:
        if isinstance(t.get("a"), str):
            return paired_at_level(cmp, name, t["a"], t["b"], alpha, n_boot)
        v = seed_mean_interval(vals.get(t["endpoint"], {}), alpha)
        return {**v, "estimate": v["mean"], "endpoint": t["endpoint"]}

    return run_sequence(plan, interval_at)

def _seed_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:  # also "" and "10,,11": argparse prints one line naming --seeds, exit 2
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m studies.confirmatory.confirmatory",
                                 description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for c in ("run", "analyse", "copy"):
        p = sub.add_parser(c)
        p.add_argument("--cmp", required=True, help="the comparison folder (run folders; not committed)")
        p.add_argument("--results", default=str(RESULTS), help="where the committed result files go")
        if c in ("run", "copy"):
            p.add_argument("--seeds", type=_seed_list, default=None,
                           help=f"comma-separated integers (default: the protocol's {','.join(map(str, SEEDS))})")
        else:
            p.add_argument("--seeds", type=_seed_list, default=SEEDS,
                           help=f"the seeds every method must have its run at (default: the first protocol's "
                                f"{','.join(map(str, SEEDS))}; a later protocol names its own)")
        if c == "analyse":
            p.add_argument("--plan", metavar="FILE",
                           help="the protocol's α plan, which fixes every test and its level (default: "
                                "alpha_plan.json in --results); a test it does not list is refused")
            p.add_argument("--looks", type=int, default=None, choices=range(1, 11), metavar="K",
                           help="checked against the plan: the plan's primary is the K-th test of its hypothesis (a "
                                "legacy bonferroni-look plan; default: the plan's)")
            p.add_argument("--primary", choices=sorted(PRIMARY_ROWS), default=None,
                           help="checked against the plan: the control of its primary comparison (default: the "
                                "plan's)")
        if c in ("run", "copy"):
            p.add_argument("--plan", metavar="FILE",
                           help="the protocol's α plan: the methods it names are run and copied (protocol 4 adds "
                                "central); default: the first protocols' local,fedavg,ohfl")
        if c == "run":
            p.add_argument("--no-audit", action="store_true",
                           help="evaluate without the shortcut audit (a protocol without the audit endpoints)")
            p.add_argument("--data", help="training data root (default: compare's: $CXR_DATA, ../shared/data)")
            p.add_argument("--external", default="../shared/data/chest_xray_224")
            p.add_argument("--part", default="evaluation", choices=("tuning", "evaluation"))
    args = ap.parse_args(argv)
    if args.cmd == "copy":  # re-copy finished seeds (e.g. after a change of what is copied)
        try:
            methods = run_methods(args.plan) if args.plan is not None else METHODS
        except PlanError as e:
            print(f"confirmatory: {e}; nothing was copied", file=sys.stderr)
            return 2
        if not Path(args.cmp).is_dir():
            print(f"confirmatory: --cmp {args.cmp}: no such comparison folder; nothing was copied", file=sys.stderr)
            return 2
        copied = 0
        for s in (args.seeds if args.seeds is not None else SEEDS):
            if (Path(args.cmp) / f"seed{s}").is_dir():
                print(f"[confirmatory] seed {s} -> {copy_seed(Path(args.cmp), Path(args.results), s, methods)}")
                copied += 1
            else:
                print(f"[confirmatory] seed {s}: no {Path(args.cmp) / f'seed{s}'}; not copied", file=sys.stderr)
        return 0 if copied else 1
    return run(args) if args.cmd == "run" else analyse(args)


if __name__ == "__main__":
    sys.exit(main())
