"""``cxr-hfl data fetch``: select the project's Kermany image sets from downloaded archives and verify them against
the committed file lists and hashes (:mod:`chest_xray.fetch`)."""
from __future__ import annotations

import sys


def register(sub) -> None:
    p = sub.add_parser("data", help="get the data (data fetch)")
    dsub = p.add_subparsers(dest="data_command", metavar="ACTION")
    q = dsub.add_parser(
        "fetch", help="select chest_xray_original and chest_xray_224 from downloaded archives and verify every file",
        description="Select the project's two image sets from the Kermany chest X-ray archives (Mendeley Data, "
                    "doi:10.17632/rscbjbr9sj.2, CC BY 4.0) and verify each file against the committed SHA-256 list "
                    "(chest_xray/splits/files_<set>.csv). A set is written only when every listed file is found and "
                    "verified; a set already in --out is verified, never overwritten.",
        epilog="Exit 0: every set written or already there and verified; 1: a set incomplete (nothing written for "
               "it; the line says how many files were found, with other contents, or missing); 2: bad input.")
    q.add_argument("--archive", action="append", required=True, metavar="ZIP_OR_DIR",
                   help="a downloaded archive (ChestXRay2017.zip; the archive holding the 224 x 224 resize) or a "
                        "folder holding such archives or extracted images; repeat for more")
    q.add_argument("--out", required=True, metavar="DIR",
                   help="data root to write: DIR/chest_xray_original, DIR/chest_xray_224 (then --data DIR or "
                        "CXR_DATA=DIR)")
    q.add_argument("--sets", default="chest_xray_original,chest_xray_224",
                   help="comma-separated sets to select (default: chest_xray_original,chest_xray_224)")
    q.set_defaults(func=run_fetch)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def run_fetch(args) -> int:
    from chest_xray.fetch import FetchError, fetch

    sets = tuple(s.strip() for s in args.sets.split(",") if s.strip())
    try:
        reports = fetch(args.archive, args.out, sets, log=lambda line: print(f"[data fetch] {line}"))
    except FetchError as e:
        print(f"cxr-hfl data fetch: {e}", file=sys.stderr)
        return 2
    bad = [r.name for r in reports.values() if r.found != r.listed]
    if len(bad) == 1:
        print(f"cxr-hfl data fetch: {bad[0]} incomplete: nothing written for it; give the archive that holds it with "
              "another --archive", file=sys.stderr)
        return 1
    if bad:
        print(f"cxr-hfl data fetch: {', '.join(bad[:-1])} and {bad[-1]} incomplete: nothing written for them; give "
              "the archives that hold them with more --archive options", file=sys.stderr)
        return 1
    return 0
