"""``cxr-hfl partition`` and ``cxr-hfl inspect``: simulated hospital sites from a chest X-ray data root.

``partition`` scans a data root (Kaggle layout, class folders, or CSV manifest), splits it into N sites
(width / dirichlet / pathological) with patient-grouped 80/10/10 splits, and writes ``OUT/partition.json``,
``OUT/sites/<site>.csv`` and optionally ``OUT/probe.csv`` plus ``OUT/scan_report.json`` (skipped files and
reasons). ``inspect`` prints a per-site table and writes a PNG chart of widths and class counts.
"""
from __future__ import annotations

import argparse


def register(subparsers) -> None:
    """Add the ``partition`` and ``inspect`` subcommands to the ``cxr-hfl`` parser."""
    from nvflare_jobs.commands.simulate import at_least  # the CLI's one integer-range argparse type

    p = subparsers.add_parser(
        "partition",
        help="split a chest X-ray data set into simulated hospital sites",
        description="Scan a data root and write per-site manifests with patient-grouped train/val/test splits.",
    )
    p.add_argument("--data", required=True, help="data root: Kaggle layout, NORMAL/PNEUMONIA folders, or a CSV")
    p.add_argument("--sites", type=int, required=True, help="number of sites N")
    p.add_argument("--scheme", choices=["width", "dirichlet", "pathological"], default="width",
                   help="width: OHFL resolution split (site-1 narrowest); dirichlet: label skew; pathological: "
                        "a fixed number of classes per site (default: %(default)s)")
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration (default: %(default)s)")
    p.add_argument("--labels", choices=["binary", "subtype"], default="binary",
                   help="binary NORMAL/PNEUMONIA or subtype NORMAL/BACTERIAL/VIRAL (default: %(default)s)")
    p.add_argument("--seed", type=at_least(0), default=0, help="random seed, >= 0 (default: %(default)s)")
    p.add_argument("--probe-fraction", type=float, default=0.0,
                   help="fraction reserved as a patient-disjoint probe pool in no site (default: %(default)s)")
    p.add_argument("--classes-per-site", type=int, default=None,
                   help="pathological scheme: classes per site (default: number of classes - 1, at least 1)")
    p.add_argument("--min-per-site", type=at_least(0), default=10,
                   help="dirichlet scheme: minimum images per site (default: %(default)s)")
    p.add_argument("--min-eval-per-class", type=at_least(0), default=0, metavar="M",
                   help="every class a site holds >= 4 M images of gets >= M images in val and in test, whole train "
                        "patients moved (default %(default)s = the plain 80/10/10 cut; simulate/compare use 2 for the "
                        "prototype methods)")
    p.add_argument("--no-verify", action="store_true",
                   help="read image headers only (faster; corrupt files are then found only at training)")
    p.add_argument("--allow-lateral", action="store_true", help="keep lateral DICOM views")
    p.add_argument("--allow-any-modality", action="store_true", help="keep DICOM modalities other than CR/DX/DR")
    p.add_argument("--keep-for-processing", action="store_true",
                   help="keep DICOM For Processing images (the raw detector signal; skipped by default)")
    p.add_argument("--skip-other-body-parts", action="store_true",
                   help="skip DICOM images whose header names another body part than the chest (noted by default)")
    p.add_argument("--near-duplicates", action="store_true",
                   help="also group near duplicates (the same radiograph re-encoded or resized) as one patient, as "
                        "exact duplicates always are (see docs/DATA.md)")
    p.add_argument("--out", required=True, help="output folder")
    p.set_defaults(func=run_partition)

    q = subparsers.add_parser(
        "inspect",
        help="print a partition's per-site table and chart it",
        description="Print site, images per class, width min/median/max and patients; write a PNG chart.",
    )
    q.add_argument("out", help="a folder written by `cxr-hfl partition`")
    q.add_argument("--png", default=None, help="chart path (default: OUT/inspect.png)")
    q.set_defaults(func=run_inspect)


def run_partition(args: argparse.Namespace) -> int:
    """Scan, partition and write; print a one-line summary per site. Returns the exit code."""
    import sys
    from pathlib import Path

    from chest_xray import CLASS_NAMES, partition_records, scan_dataset, write_partition
    from chest_xray.partition import partition_warnings
    from nvflare_jobs.profiles import site_options_problem

    if bad := site_options_problem(args):  # before the scan, which takes a while on a large archive
        print(f"cxr-hfl partition: {bad}", file=sys.stderr)
        return 2
    try:
        records, report = scan_dataset(args.data, labels=args.labels, verify=not args.no_verify,
                                       allow_any_modality=args.allow_any_modality, allow_lateral=args.allow_lateral,
                                       near_duplicates=args.near_duplicates,
                                       keep_for_processing=args.keep_for_processing,
                                       skip_other_body_parts=args.skip_other_body_parts)
    except (FileNotFoundError, ValueError) as e:
        print(f"cxr-hfl partition: {e}", file=sys.stderr)
        return 2
    if report["skipped"]:
        counts = ", ".join(f"{k} {n}" for k, n in report["skipped_by_reason"].items())
        print(f"skipped {len(report['skipped'])} file(s) ({counts}; all listed in scan_report.json):",
              file=sys.stderr)
        shown = [s for s in report["skipped"] if s.get("kind") != "junk"][:10]
        for s in shown:
            print(f"  {printable_path(s['path'])}: {printable_path(s['reason'])}", file=sys.stderr)
    for n in report.get("notes", [])[:10]:
        print(f"note: {printable_path(n['path'])}: {printable_path(n['note'])}", file=sys.stderr)
    for f in report.get("findings", []):  # one line per finding (skips are listed above): counts, example names
        if not f["kind"].startswith("skipped: "):
            print(f"finding: {printable_path(f['text'])}", file=sys.stderr)
    if not records:  # every file skipped (reasons above), or a manifest with a header and no rows
        print(f"cxr-hfl partition: {args.data}: no usable images to partition"
              + (f" ({len(report['skipped'])} skipped, see above)" if report["skipped"] else ""), file=sys.stderr)
        return 2
    try:
        result = partition_records(
            records, args.sites, args.scheme, alpha=args.alpha, seed=args.seed,
            probe_fraction=args.probe_fraction, class_names=CLASS_NAMES[args.labels],
            classes_per_site=args.classes_per_site, min_per_site=args.min_per_site,
            min_eval_per_class=args.min_eval_per_class,
        )
    except ValueError as e:
        print(f"cxr-hfl partition: {e}", file=sys.stderr)
        return 2
    crossing = near_pairs_finding(result, report)
    out = Path(args.out)
    extra = {"data_root": report["root"], "labels": args.labels, "layout": report["layout"],
             "near_pairs_crossing": len(crossing),
             "n_scanned": report["n_records"], "n_skipped": len(report["skipped"]),
             "skipped_by_reason": report["skipped_by_reason"], "n_notes": len(report.get("notes", [])),
             "duplicates": report.get("duplicates"), "patient_ids": report.get("patient_ids")}
    try:
        path = write_partition(result, out, extra=extra, scan_report=report)  # atomic: all files or none
    except OSError as e:
        print(f"cxr-hfl partition: cannot write to {out}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"{report['n_records']} images, {report['n_patients']} patients, {len(result.sites)} sites "
          f"({args.scheme}) -> {path}")
    for w in partition_warnings(result.sites, args.scheme):
        print(w, file=sys.stderr)
    return 0


def near_pairs_finding(result, report: dict) -> list[dict]:
    """Print one finding line when near-duplicate pairs of the scan cross a site or a split of ``result``, and
    list them all in the report (``report["near_pairs_crossing"]``, written to scan_report.json). Returns them."""
    import sys
    from pathlib import Path

    from chest_xray.partition import crossing_pairs

    crossing = crossing_pairs(result, report.get("near_pairs") or [])
    report["near_pairs_crossing"] = crossing
    if crossing:
        sites = sum(1 for c in crossing if c["where_a"].split("/")[0] != c["where_b"].split("/")[0])
        shown = "; ".join(f"{Path(c['a']).name} ({c['where_a']}) ~ {Path(c['b']).name} ({c['where_b']})"
                          for c in crossing[:3])
        print(printable_path(f"finding: near duplicates across sites or splits: {len(crossing)} pair(s), {sites} "
                             f"across sites (e.g. {shown}); the same radiograph on both sides makes test results "
                             "optimistic: --near-duplicates groups them, or remove one copy (all pairs in "
                             "scan_report.json)"), file=sys.stderr)
    return crossing


def printable_path(path: str) -> str:
    """``path`` on one line: control characters (a newline in a file name) and undecodable bytes (a cp1252 name,
    kept as surrogate escapes) written as Python escapes, e.g. ``two\\nlines.jpeg``, ``caf\\udce9.jpeg``."""
    from chest_xray.io import printable

    return printable(path)


def format_table(info: dict, sites: dict) -> str:
    """The inspect table as text: one line per site (and the probe pool), columns site, images per class,
    width min/median/max (pixels), patients, train/val/test images."""
    from chest_xray import site_summary

    names = info["class_names"]
    head = ["site", *names, "total", "w_min", "w_median", "w_max", "patients", "train/val/test"]
    lines = []
    for name, rows in sites.items():
        s = site_summary(rows, names)
        tvt = "/".join(str(sum(s["per_split"].get(sp, {}).values())) for sp in ("train", "val", "test"))
        w = s["width"]
        lines.append([name, *[str(s["per_class"][n]) for n in names], str(s["n_images"]), str(w["min"]),
                      f"{w['median']:.0f}" if w["median"] is not None else "-", str(w["max"]),
                      str(s["n_patients"]), tvt])
    probe = info.get("probe")
    if probe:
        w = probe["width"]
        lines.append(["probe", *[str(probe["per_class"][n]) for n in names], str(probe["n_images"]),
                      str(w["min"]), f"{w['median']:.0f}", str(w["max"]), str(probe["n_patients"]), "-"])
    widths = [max(len(r[i]) for r in [head, *lines]) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.rjust(widths[i]) if i else c.ljust(widths[i]) for i, c in enumerate(r))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * x for x in widths]), *map(fmt, lines)])


def skipped_summary(info: dict) -> str:
    """One line: how many files the scan skipped, counted by reason (from ``partition.json``)."""
    n = info.get("n_skipped")
    if n is None:
        return "skipped files: not recorded (partition written by an older version)"
    if not n:
        return "skipped files: none"
    counts = info.get("skipped_by_reason") or {}
    detail = ", ".join(f"{k} {v}" for k, v in counts.items())
    return f"skipped files: {n} ({detail}; paths and reasons in scan_report.json)"


def run_inspect(args: argparse.Namespace) -> int:
    """Print the site table and write the chart. Returns the exit code."""
    import sys
    from pathlib import Path

    from chest_xray import load_partition
    from chest_xray.partition import partition_warnings

    out = Path(args.out)
    try:
        info, sites = load_partition(out)
    except (OSError, ValueError) as e:
        print(f"cxr-hfl inspect: {out}: not a partition folder written by `cxr-hfl partition` ({e})",
              file=sys.stderr)
        return 2
    print(f"scheme {info['scheme']}, seed {info.get('seed')}, labels {info.get('labels', '?')}, "
          f"data {info.get('data_root', '?')}")
    print(format_table(info, sites))
    print(skipped_summary(info))
    for w in partition_warnings(sites, info.get("scheme")):
        print(w, file=sys.stderr)
    png = Path(args.png) if args.png else out / "inspect.png"
    if png.is_dir():  # --png FOLDER: the chart goes inside it (matplotlib would write FOLDER.png beside it)
        png = png / "inspect.png"
    try:
        _plot(info, sites, png)
    except OSError as e:
        print(f"cxr-hfl inspect: cannot write the chart {png}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"chart -> {png}")
    return 0


def _plot(info: dict, sites: dict, png) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = info["class_names"]
    site_names = list(sites)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(site_names) + 4), 4.5))
    ax1.boxplot([[r["width"] for r in sites[s]] for s in site_names], tick_labels=site_names, showfliers=True)
    ax1.set_ylabel("image width (px)")
    ax1.set_title("width per site")
    x = np.arange(len(site_names))
    bottom = np.zeros(len(site_names))
    for k, n in enumerate(names):
        c = np.array([sum(1 for r in sites[s] if r["label"] == k) for s in site_names], dtype=float)
        ax2.bar(x, c, bottom=bottom, label=n)
        bottom += c
    ax2.set_xticks(x, site_names)
    ax2.set_ylabel("images")
    ax2.set_title("class counts per site")
    ax2.set_ylim(0, 1.25 * max(float(bottom.max()), 1.0))
    ax2.legend(loc="upper right", ncol=len(names))
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelrotation=30)
    fig.suptitle(f"partition: {info['scheme']} (seed {info.get('seed')})")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100, format="png")  # exactly the path printed, whatever its suffix
    plt.close(fig)
