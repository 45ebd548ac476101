"""``cxr-hfl export-eval``: a cross-site evaluation job of model files (every site scores every model on its own
test split; the server writes the sites x models matrix). See docs/DEPLOYMENT.md, Cross-site evaluation."""
from __future__ import annotations

import sys
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("export-eval", help="write a cross-site evaluation job: every site scores the given model "
                                           "files on its own test split (sites x models matrix on the server)")
    p.add_argument("--model", action="append", required=True, metavar="FILE",
                   help="a model file (models/<site>_deployed.pt of a run, global_model.pt, ...); repeat for more")
    p.add_argument("--profile", required=True, help="folder of <site>.yaml: the consortium's site names")
    p.add_argument("--min-sites", type=int, help="fewest sites that must answer (default N-1)")
    p.add_argument("--out", required=True, help="folder to export the job into")
    p.set_defaults(func=run_export_eval)


def run_export_eval(args) -> int:
    from nvflare_jobs.crosssite import export_eval_job
    from hfl_components.flare.site_config import load_profile

    profile = load_profile(args.profile, check_files=False, require_data=False)
    out = Path(args.out).resolve()
    bad = None
    if out.exists() and not out.is_dir():
        bad = f"--out {args.out} is not a folder (a job folder is written inside it)"
    elif args.min_sites is not None and not 1 <= args.min_sites <= len(profile):
        bad = (f"--min-sites must be between 1 and {len(profile)} (the profile's sites), got {args.min_sites}")
    try:
        folder = None if bad else export_eval_job(profile, args.model, out, args.min_sites)
    except (ValueError, OSError) as e:  # a model file that is missing, a folder or not a model file, naming it
        bad = str(e)
    if bad:
        print(f"cxr-hfl export-eval: {bad}", file=sys.stderr)
        return 2
    print(f"[cxr-hfl] exported {folder.name} ({len(args.model)} models, sites {', '.join(profile)}) to {folder}")
    print("[cxr-hfl] each site sends: the test metrics of each model on its own test split (no predictions)")
    print(f"submit with: cxr-hfl submit --job {folder} --startup-kit <your coordinator kit folder>")
    print(f"   (POC:     cxr-hfl poc submit --workspace <POC folder> --job {folder})")
    return 0
