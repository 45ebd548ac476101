"""``cxr-hfl site check``: a hospital checks its config, manifest, images, model and device before a job."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("site", help="tools for a hospital site operator (site check)")
    ssub = p.add_subparsers(dest="site_command", metavar="ACTION")
    q = ssub.add_parser("check", help="validate the site config and read every image of its manifest (one screen; "
                                      "exit 1 on errors)")
    q.add_argument("--config", "-c", required=True, help="the site's <site>.yaml (e.g. <kit>/local/cxr_hfl/hospital-a.yaml)")
    q.add_argument("--site", help="site name (default: the config file's name without .yaml)")
    q.add_argument("--no-images", action="store_true", help="skip decoding the images (config, manifest, model only)")
    q.add_argument("--json", metavar="FILE", help="also write the full report (every unreadable file) as JSON")
    q.set_defaults(func=run_check)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def run_check(args) -> int:
    from nvflare_jobs.site_check import check_site, format_report

    if not Path(args.config).is_file():
        what = "a folder, not a <site>.yaml file" if Path(args.config).is_dir() else "no such file"
        print(f"cxr-hfl site check: --config {args.config}: {what}", file=sys.stderr)
        return 2
    if args.json and (Path(args.json).is_dir() or not Path(args.json).resolve().parent.is_dir()):
        what = ("is a folder; give a file name, e.g. " + str(Path(args.json) / "site_check.json")
                if Path(args.json).is_dir() else f"its folder {Path(args.json).resolve().parent} does not exist")
        print(f"cxr-hfl site check: --json {args.json}: {what}", file=sys.stderr)
        return 2
    rep = check_site(args.config, site=args.site, read_images=not args.no_images)
    print(format_report(rep))
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=1, default=str))
    return 1 if rep["errors"] else 0
