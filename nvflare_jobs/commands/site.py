"""``cxr-hfl site check``: a hospital checks its config, manifest, images, model and device before a job.
``cxr-hfl site score``: a hospital scores model files on its own test split, as its site does in a cross-site
evaluation job (its row of the sites x models matrix), here and sending nothing.
``cxr-hfl site privacy-audit``: a hospital measures membership inference on model files with its own data, sending
nothing (``nvflare_jobs.privacy_audit``)."""
from __future__ import annotations

import json
import sys
from pathlib import Path


# site check's exit codes, worded once (its --help; docs/DEPLOYMENT.md quotes it)
CHECK_EXIT = ("exit 1 when the data or model has errors, 2 when the config is invalid or it or its manifest "
              "cannot be read")


def register(sub) -> None:
    p = sub.add_parser("site", help="tools for a hospital site operator (site check, site score, site privacy-audit)")
    ssub = p.add_subparsers(dest="site_command", metavar="ACTION")
    q = ssub.add_parser("check", help="validate the site config and read every image of its manifest (one screen; "
                                      f"{CHECK_EXIT})")
    q.add_argument("--config", "-c", required=True, help="the site's <site>.yaml (e.g. <kit>/local/cxr_hfl/hospital-a.yaml)")
    q.add_argument("--site", help="site name (default: the config file's name without .yaml)")
    q.add_argument("--no-images", action="store_true",
                   help="skip decoding the images: only check that each file of the manifest exists (and the config, "
                        "manifest, model)")
    q.add_argument("--json", metavar="FILE", help="also write the full report (every unreadable or missing file) "
                                                  "as JSON (default: none, the screen only)")
    q.set_defaults(func=run_check)
    q = ssub.add_parser("score", help="score model files on this site's own test split, as the site does in a "
                                      "cross-site evaluation job (its row of the matrix; nothing is sent)",
                        epilog="Refused models (another label scheme) are named on stderr; exit 2 when every "
                               "model was refused, so none could be scored.")
    q.add_argument("--config", "-c", required=True, help="the site's <site>.yaml (e.g. <kit>/local/cxr_hfl/hospital-a.yaml)")
    q.add_argument("--site", help="site name (default: the config file's name without .yaml)")
    q.add_argument("--model", action="append", required=True, metavar="FILE",
                   help="a model file (RUN/models/<site>_deployed.pt, global_model.pt, ...); repeat for more")
    q.add_argument("--json", action="store_true", help="print {model: metrics | {refused: reason}} as JSON")
    q.set_defaults(func=run_score)
    q = ssub.add_parser("privacy-audit", help="membership-inference audit of model files on this site's own data "
                                              "(train split = members, test split = non-members; nothing is sent)",
                        epilog="Writes OUT/privacy_audit.json, .csv and _roc.png: per model, attack AUC and TPR at "
                               "--fpr with bootstrap intervals. Exit 2 on bad input (one line).")
    q.add_argument("--config", "-c", required=True, help="the site's <site>.yaml")
    q.add_argument("--site", help="site name (default: the config file's name without .yaml)")
    q.add_argument("--model", action="append", required=True, metavar="FILE",
                   help="a model file the site sent or received (upload, global model, FENS peer); repeat for more")
    q.add_argument("--out", required=True, help="folder for the results (created)")
    q.add_argument("--probe", help="public labelled images for LiRA's shadow models: the chest_xray_224 root (its "
                                   "probe part) or a partition's probe.csv (default: none; needed by --shadows)")
    q.add_argument("--shadows", type=int, default=0, help="LiRA shadow models per model file (default 0: no LiRA)")
    q.add_argument("--shadow-epochs", type=int, default=10, help="training epochs of each shadow model (default 10)")
    q.add_argument("--canary-epochs", type=int, default=0,
                   help="epochs of a one-run canary audit (Steinke et al. 2023) under the config's dp (default 0: "
                        "none)")
    q.add_argument("--fpr", type=float, default=0.01, help="FPR at which the TPR is reported (default 0.01)")
    q.add_argument("--boot", type=int, default=1000, help="bootstrap replicates of the intervals (default 1000)")
    q.add_argument("--seed", type=int, default=0, help="seed of every random choice (default 0)")
    q.set_defaults(func=run_privacy_audit)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def _no_config(command: str, config: str) -> bool:
    """True (after one line on stderr naming ``--config``) when ``config`` is not a file."""
    if Path(config).is_file():
        return False
    what = "a folder, not a <site>.yaml file" if Path(config).is_dir() else "no such file"
    print(f"cxr-hfl site {command}: --config {config}: {what}", file=sys.stderr)
    return True


def run_check(args) -> int:
    from nvflare_jobs.site_check import check_site, format_report

    if _no_config("check", args.config):
        return 2
    if args.json and (Path(args.json).is_dir() or not Path(args.json).resolve().parent.is_dir()):
        what = ("is a folder; give a file name, e.g. " + str(Path(args.json) / "site_check.json")
                if Path(args.json).is_dir() else f"its folder {Path(args.json).resolve().parent} does not exist")
        print(f"cxr-hfl site check: --json {args.json}: {what}", file=sys.stderr)
        return 2
    rep = check_site(args.config, site=args.site, read_images=not args.no_images)
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=1, default=str))
    if rep.get("bad_config"):  # bad input, as `site score` reports the same config: one line, exit 2
        print(f"cxr-hfl site check: {rep['errors'][0].splitlines()[0]}", file=sys.stderr)
        return 2
    print(format_report(rep))
    return 1 if rep["errors"] else 0


def run_score(args) -> int:
    from chest_xray.io import ImageReadError
    from nvflare_jobs.crosssite import score_locally

    cfg = Path(args.config)
    if _no_config("score", args.config):
        return 2
    site = args.site or cfg.stem
    try:
        res = score_locally(cfg, site, args.model)
    except (FileNotFoundError, ValueError, ImageReadError) as e:  # a model file or the site's data, named
        print(f"cxr-hfl site score: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(res, default=float))
    else:
        print(f"cxr-hfl site score: site {site}, test split of {cfg}")
        for name, m in res.items():
            if "refused" in m:
                print(f"  {name:<24} refused: {m['refused']}")
                continue
            print(f"  {name:<24} n={m.get('n')}  " + "  ".join(
                f"{k} {m[k]:.3f}" for k in ("balanced_accuracy", "accuracy", "auc") if isinstance(m.get(k), float)))
    return _refusals(res, site, "in the JSON" if args.json else "above")


def run_privacy_audit(args) -> int:
    from chest_xray.io import ImageReadError
    from nvflare_jobs.privacy_audit import privacy_audit

    if _no_config("privacy-audit", args.config):
        return 2
    checks = (("--shadows", args.shadows, args.shadows >= 0), ("--shadow-epochs", args.shadow_epochs,
              args.shadow_epochs >= 1), ("--canary-epochs", args.canary_epochs, args.canary_epochs >= 0),
              ("--boot", args.boot, args.boot >= 1), ("--fpr", args.fpr, 0 <= args.fpr < 1))
    bad = next(((flag, v) for flag, v, ok in checks if not ok), None)
    if bad:
        print(f"cxr-hfl site privacy-audit: {bad[0]} {bad[1]}: out of range (--shadows, --canary-epochs >= 0; "
              "--shadow-epochs, --boot >= 1; 0 <= --fpr < 1)", file=sys.stderr)
        return 2
    if Path(args.out).is_file():
        print(f"cxr-hfl site privacy-audit: --out {args.out}: is a file; give a folder", file=sys.stderr)
        return 2
    site = args.site or Path(args.config).stem
    try:
        doc = privacy_audit(args.config, site, args.model, args.out, probe=args.probe, shadows=args.shadows,
                            shadow_epochs=args.shadow_epochs, canary_epochs=args.canary_epochs, fpr=args.fpr,
                            n_boot=args.boot, seed=args.seed)
    except (FileNotFoundError, ValueError, ImageReadError) as e:
        print(f"cxr-hfl site privacy-audit: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    print(f"cxr-hfl site privacy-audit: site {site}; members = train split, non-members = test split; nothing sent")
    for m in doc["models"]:
        if "refused" in m:
            print(f"  {m['name']:<24} refused: {m['refused']}")
            continue
        for a in m["attacks"]:
            print(f"  {m['name']:<24} {a['attack']:<15} AUC {a['auc']:.3f} [{a['auc_low']:.3f}, {a['auc_high']:.3f}]"
                  f"  TPR@{100 * a['fpr']:g}%FPR {a['tpr_at_fpr']:.3f} [{a['tpr_low']:.3f}, {a['tpr_high']:.3f}]"
                  f"  n={a['n_members']}/{a['n_nonmembers']}")
    if doc["canary"]:
        c = doc["canary"]
        acc = f", accountant epsilon {c['accountant_epsilon']:.2f}" if c.get("accountant_epsilon") is not None else ""
        print(f"  one-run audit: epsilon >= {c['epsilon_lower_bound']:.2f} (95 %; {c['correct']}/{c['guesses']} "
              f"correct guesses on {c['canaries']} canaries){acc}")
    print(f"  results: {Path(args.out) / 'privacy_audit.json'}, .csv, _roc.png")
    return 0


def _refusals(res: dict, site: str, where: str) -> int:
    """``site score``'s exit status: 2 with one line on stderr when every model was refused (nothing scored), else
    0, with one stderr line naming the refused models when some were."""
    refused = [name for name, m in res.items() if "refused" in m]
    if refused and len(refused) == len(res):
        print(f"cxr-hfl site score: no model could be scored on site {site}: all {len(res)} were refused "
              f"({', '.join(refused)}; reasons {where})", file=sys.stderr)
        return 2
    if refused:
        print(f"cxr-hfl site score: {len(refused)} of {len(res)} models refused: {', '.join(refused)} (reasons "
              f"{where})", file=sys.stderr)
    return 0
