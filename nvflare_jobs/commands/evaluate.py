"""``cxr-hfl compare``, ``evaluate``, ``predict`` and ``report``: side-by-side comparison, external validation,
prediction on unlabelled images, and a self-contained HTML report."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from chest_xray import ASPECTS


def _csv_ints(s: str) -> list[int]:
    """Comma-separated seeds: integers >= 0 (numpy's generators take no negative seed), at least one."""
    try:
        v = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not v or min(v) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0, got {s!r}")
    return v


def _int_at_least(s: str, lo: int, words: str) -> int:
    """``int(s)`` when it is >= ``lo``; else argparse's one-line error saying ``expected <words>``."""
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {words}, got {s!r}") from None
    if v < lo:
        raise argparse.ArgumentTypeError(f"expected {words}, got {v}")
    return v


def _positive_int(s: str) -> int:
    return _int_at_least(s, 1, "a positive integer")


def _non_negative_int(s: str) -> int:
    return _int_at_least(s, 0, "a whole number >= 0")


def _input_size(s: str) -> int:
    v = _positive_int(s)
    if v < 16:
        raise argparse.ArgumentTypeError(f"expected an input size of at least 16 px, got {v}")
    return v


def _probability(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {s!r}") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a probability in [0, 1], got {v}")
    return v


PARTS = ("probe", "tuning", "evaluation")  # chest_xray.splits.PARTS (kept here so --help stays fast)


def register(sub) -> None:
    _add_compare(sub.add_parser("compare", help="run several methods on the identical partition and seeds; "
                                                "comparison tables"))
    _add_evaluate(sub)


def _add_compare(c) -> None:
    from hfl_components.flare.catalogue import methods, with_role  # plain data: --help stays fast
    from nvflare_jobs.compare.plan import COMPARE_DEFAULTS as D

    control = with_role("control")
    c.add_argument("--methods", default=D["methods"],
                   help=f"comma-separated: {', '.join([control, 'local+ft', *(m for m in methods() if m != control)])}"
                        f"; a variant adds options, e.g. ohfl:strategy=cdd (default local,fedavg,ohfl; under equal "
                        f"budgets {control} is the local+ft control)")
    c.add_argument("--data", help="data root (default $CXR_DATA, ../shared/data)")
    c.add_argument("--sites", type=int, default=D["sites"], help="number of simulated hospital sites (default 6)")
    c.add_argument("--scheme", choices=("width", "dirichlet", "pathological"), default=D["scheme"],
                   help="how the sites are partitioned, as simulate --scheme (default width)")
    c.add_argument("--alpha", type=float, default=D["alpha"], help="Dirichlet alpha (dirichlet scheme; default 0.5)")
    c.add_argument("--labels", choices=("binary", "subtype"), default=D["labels"],
                   help="one label scheme for every method (default binary)")
    c.add_argument("--seeds", type=_csv_ints, default=D["seeds"], help="comma-separated seeds (default 0)")
    c.add_argument("--out", required=True, help="comparison folder (one run folder per seed and method)")
    c.add_argument("--rounds", type=_positive_int,
                   help="rounds of FedAvg / prototype methods; under equal budgets they must divide the budget E "
                        "(each round then trains E / rounds epochs; default: rounds of 2 epochs, 15 for E = 30)")
    c.add_argument("--local-epochs", type=_non_negative_int,
                   help="OHFL's local epochs L (default 20); the common budget is E = L + fine-tuning epochs. With "
                        "--unequal-budgets: every method's local epochs per round, passed through")
    c.add_argument("--finetune-epochs", type=_non_negative_int, help="OHFL's fine-tuning epochs F (default 10)")
    c.add_argument("--unequal-budgets", action="store_true",
                   help="let every method keep its own default epochs (not compute-matched; the tables say so)")
    c.add_argument("--external", metavar="DIR",
                   help="after the runs, evaluate every saved model of every run on this labelled set (e.g. "
                        "../shared/data/chest_xray_224 with --part evaluation); paired CIs against local+ft and FedAvg (default: none)")
    c.add_argument("--part", choices=PARTS, help="a committed part of chest_xray_224 (--external must be its root; "
                                                 "default: none, the whole --external set)")
    c.add_argument("--external-max-images", type=_positive_int,
                   help="class-stratified subset of the external set (quick checks only; default: every image)")
    c.add_argument("--n-boot", type=_non_negative_int, default=D["n_boot"], help="bootstrap replicates of the paired CIs (default 1000)")
    c.add_argument("--late-wait", type=_non_negative_int,
                   help="pass-through: seconds to wait for late sites (default: simulate's adaptive wait)")
    c.add_argument("--probe", help="pass-through to OHFL runs (default: the committed probe part of chest_xray_224 "
                                   "when the data are chest_xray_original)")
    c.add_argument("--max-train-images", type=_positive_int,
                   help="pass-through: cap each site's training images (default: no cap)")
    from nvflare_jobs.commands.simulate import sizes_text

    c.add_argument("--input-sizes", type=sizes_text, help="pass-through: e.g. 64,96,128 (16 to 1024 px; default: simulate's)")
    c.add_argument("--batch-size", type=_positive_int, help="pass-through (default 16)")
    c.add_argument("--max-images", type=_positive_int,
                   help="partition a class-stratified subset of this many images (quick; default: every image)")
    c.add_argument("--families", help="one model family per site, comma-separated in site order, for every method "
                                      "that takes it (simulate --families); prototype methods, and local compared "
                                      "with them, train the heterogeneous backbone pool and ignore it: compare names "
                                      "them in one line at the start, and refuses --families when no method takes it (default: cnn at every "
                                      "site)")
    from hfl_components.flare.site_config import AUGMENTS

    for flag, kw in (("--aspect", {"choices": ASPECTS, "help": "pass-through: how sites make images square (default stretch)"}),
                     ("--augment", {"choices": AUGMENTS, "help": "pass-through: every site's training augmentation "
                                                                 "(default monai; border / border_dense / border_raw add "
                                                                 "random bands; zoom_out a random centred zoom-out)"}),
                     ("--no-audit", {"action": "store_true", "help": "skip the shortcut audit of the external set"}),
                     ("--dry-run", {"action": "store_true",
                                    "help": "print the budget and the simulate commands only; writes nothing"})):
        c.add_argument(flag, **kw)
    _add_frame_mask(c)
    c.set_defaults(func=run_compare)


def _add_frame_mask(c) -> None:
    c.add_argument("--frame-mask", type=float, help="share of each side of every fusable site model's input set to a "
                   "constant in training and inference (model spec frame_mask, e.g. 0.08; default none)")
    c.add_argument("--frame-rescale", action="store_true", help="with --frame-mask: the model min-max scales the "
                   "region inside the mask by its own extremes (model spec frame_rescale)")


def _add_evaluate(sub) -> None:
    e = sub.add_parser("evaluate", help="evaluate every saved model of a run on an external labelled image set")
    e.add_argument("--run", required=True, help="run folder written by `cxr-hfl simulate`")
    e.add_argument("--data", required=True, help="external labelled set (Kaggle layout, class folders or CSV)")
    e.add_argument("--part", choices=PARTS,
                   help="only this committed part of chest_xray_224 (--data must be its root): 'evaluation' for "
                        "headline numbers (nothing is tuned on it), 'tuning' for choosing defaults (default: none, the whole "
                        "--data set; the chest_xray_224 root itself is refused without it)")
    e.add_argument("--labels", choices=("binary", "subtype"), help="label scheme (default: the run's)")
    e.add_argument("--force", action="store_true",
                   help="evaluate even when the set shares file names / patient ids with the run's data (NOT external)")
    e.add_argument("--global-sizes", choices=("all", "largest"), default="all",
                   help="evaluate the global model at every input size of the run (default) or the largest only")
    e.add_argument("--max-images", type=_positive_int,
                   help="class-stratified subset of the external set (quick checks; default: every image)")
    e.add_argument("--n-boot", type=_non_negative_int, default=500,
                   help="bootstrap replicates of each model's pooled 95%% CIs (default 500; 0: none)")
    e.add_argument("--no-audit", action="store_true",
                   help="skip the shortcut audit (metadata baseline, perturbation probes, Grad-CAM; timing runs)")
    e.add_argument("--overwrite", action="store_true",
                   help="replace an earlier evaluation of the same set (RUN/external/<set>/, with its audit) that was "
                        "made with other options (image count, --max-images, --n-boot, --no-audit, ...); without it "
                        "evaluate refuses, and reruns with the same options only")
    e.set_defaults(func=run_evaluate)

    _register_audit(sub)

    p = sub.add_parser("predict", help="class probabilities for unlabelled JPEG/PNG/DICOM files")
    p.add_argument("--model", required=True, help="a model file, e.g. RUN/models/site-1_deployed.pt")
    p.add_argument("--data", required=True, nargs="+", help="folder(s) and/or files")
    p.add_argument("--out", required=True, help="CSV to write")
    p.add_argument("--threshold", type=_probability,
                   help="binary: predict PNEUMONIA when p >= threshold, a number in [0, 1] (default argmax)")
    p.add_argument("--size", type=_input_size, metavar="PX",
                   help="input size (px) for a global model, which has none of its own: one its sites trained at "
                        "(default: the largest input size of its run's sites, or of its architecture group's sites "
                        "for RUN/global_models/<group>.pt); a site's model is always scored at the size its file "
                        "records")
    p.add_argument("--allow-any-modality", action="store_true", help="predict on DICOM objects other than CR/DX/DR")
    p.add_argument("--allow-lateral", action="store_true", help="predict on lateral DICOM views")
    p.set_defaults(func=run_predict)

    r = sub.add_parser("report", help="one self-contained HTML report of a run or a comparison folder")
    r.add_argument("path", help="run folder (metrics.json) or compare folder (comparison.csv)")
    r.add_argument("--out", help="HTML file (default PATH/report.html)")
    r.set_defaults(func=run_report)


def _register_audit(sub) -> None:
    a = sub.add_parser("audit", help="shortcut audit of a run's models on an evaluated external set (evaluate "
                                     "runs it by default): metadata baseline, perturbation probes, Grad-CAM")
    a.add_argument("--run", required=True, help="run folder with RUN/external/<set>/predictions.npz")
    a.add_argument("--data", help="the evaluated set, as given to evaluate (default: the only one evaluated)")
    a.add_argument("--part", choices=PARTS, help="the committed part of chest_xray_224 it was evaluated on (--data "
                                                 "must be its root, as for evaluate; default: none)")
    a.add_argument("--probe-images", type=_positive_int, default=300,
                   help="class-balanced, seeded subsample for the perturbation probes (default 300)")
    a.add_argument("--saliency-images", type=_positive_int, default=8,
                   help="class-balanced, seeded sample for Grad-CAM per model (default 8)")
    from nvflare_jobs.commands.simulate import device_arg

    a.add_argument("--device", type=device_arg, default="auto",
                   help="auto (a GPU when present), cpu, cuda or cuda:N (default auto)")
    a.set_defaults(func=run_audit)


def run_evaluate(args) -> int:
    from nvflare_jobs.evaluation import LeakageError, evaluate_run, part_required

    run = Path(args.run)
    if not run.is_dir():
        print(f"cxr-hfl evaluate: no run folder {run}" + (" (it is a file)" if run.exists() else ""),
              file=sys.stderr)
        return 2
    if not Path(args.data).exists():
        print(f"cxr-hfl evaluate: no data at {args.data}", file=sys.stderr)
        return 2
    if why := part_required(args.data, args.part):
        print(f"cxr-hfl evaluate: {why}", file=sys.stderr)
        return 2
    try:
        res = evaluate_run(run, args.data, args.labels, force=args.force, max_images=args.max_images,
                           global_sizes=args.global_sizes, part=args.part, n_boot=args.n_boot,
                           audit=not args.no_audit, overwrite=args.overwrite)
    except LeakageError as e:
        print(f"cxr-hfl evaluate: REFUSED: {e}", file=sys.stderr)
        return 3
    except (FileNotFoundError, ValueError) as e:
        print(f"cxr-hfl evaluate: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"cxr-hfl evaluate: {e.filename or run}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"[cxr-hfl] {res['n_images']} images ({res['probe_images_excluded']} probe images left out); wrote "
          f"{len(res['models'])} model results to {res['summary'].parent}")
    return 0


def run_audit(args) -> int:
    """``cxr-hfl audit --run RUN [--data DATA [--part P]]``; a bad ``--data`` / ``--part`` combination is refused
    as ``evaluate`` refuses it (:func:`nvflare_jobs.evaluation.part_required`)."""
    from chest_xray.splits import POOL
    from nvflare_jobs.audit import audit_external
    from nvflare_jobs.evaluation import external_name, part_required

    run = Path(args.run)
    if not run.is_dir():
        print(f"cxr-hfl audit: no run folder {run}", file=sys.stderr)
        return 2
    if args.part and not args.data:
        print(f"cxr-hfl audit: --part {args.part} needs --data (the {POOL} root it was evaluated on)",
              file=sys.stderr)
        return 2
    if args.data and (why := part_required(args.data, args.part)):  # the check evaluate and compare make
        print(f"cxr-hfl audit: {why}", file=sys.stderr)
        return 2
    if args.data:
        ext = run / "external" / external_name(args.data, args.part)
    else:
        found = sorted(p.parent for p in run.glob("external/*/predictions.npz"))
        if len(found) != 1:
            print(f"cxr-hfl audit: {run}: {len(found)} evaluated sets under external/; name one with --data "
                  "(and --part)", file=sys.stderr)
            return 2
        ext = found[0]
    if not (ext / "predictions.npz").is_file():
        print(f"cxr-hfl audit: {ext}: no predictions.npz; run `cxr-hfl evaluate --run {run} --data ...` first",
              file=sys.stderr)
        return 2
    audit_external(run, ext, probe_images=args.probe_images, saliency_images=args.saliency_images,
                   device=args.device)
    print(f"[cxr-hfl] audit: {ext / 'audit.json'}")
    return 0


def run_predict(args) -> int:
    from nvflare_jobs.evaluation import check_predict_args, predict_files

    model = Path(args.model)
    if not model.is_file():
        what = "is a folder, not a model file" if model.is_dir() else "no such model file"
        print(f"cxr-hfl predict: {model}: {what}", file=sys.stderr)
        return 2
    try:
        check_predict_args(args.data, args.out)
        s = predict_files(args.model, args.data, args.out, threshold=args.threshold,
                          allow_any_modality=args.allow_any_modality, allow_lateral=args.allow_lateral,
                          size=args.size)
    except (FileNotFoundError, ValueError) as e:
        print(f"cxr-hfl predict: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"cxr-hfl predict: cannot write {args.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"[cxr-hfl] {s['n_ok']} of {s['n_files']} files predicted at {s['input_size']} px ({s['size_from']}; "
          f"{s['n_skipped']} skipped, see the reason column) -> {args.out}"
          + ("" if not s.get("calibrated") or args.threshold is not None
             else f"; calibrated probabilities, federated threshold {s['threshold']:.3f}" if s["threshold"] is not None
             else "; calibrated probabilities, argmax (no federated threshold)"))
    if not s["n_ok"]:
        print(f"cxr-hfl predict: no file could be predicted: all {s['n_files']} were skipped (reasons in "
              f"{args.out})", file=sys.stderr)
        return 1
    return 0


def run_report(args) -> int:
    from nvflare_jobs.report import (UnreadableFile, compare_no_results_message, excluded_rows, no_results_message,
                                     read_json, render_report)

    if args.out and Path(args.out).is_dir():
        print(f"cxr-hfl report: --out {args.out} is a folder; give an HTML file name, e.g. "
              f"{Path(args.out) / 'report.html'}", file=sys.stderr)
        return 2
    if args.out and (above := next((d for d in Path(args.out).parents if d.exists()), None)) is not None \
            and not above.is_dir():  # before the report is rendered
        print(f"cxr-hfl report: --out {args.out}: {above} is a file, not a folder", file=sys.stderr)
        return 2
    try:
        out = render_report(args.path, args.out)
    except (FileNotFoundError, UnreadableFile) as e:  # each names its file
        print(f"cxr-hfl report: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # including json.JSONDecodeError of a damaged metrics.json
        print(f"cxr-hfl report: {args.path}: unreadable run or compare files ({e})", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"cxr-hfl report: {e.filename or args.path}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"[cxr-hfl] report: {out}")
    from nvflare_jobs.audit import find_audits, summary_lines

    for f in find_audits(args.path):
        for line in summary_lines(read_json(f)):
            print(f"audit ({f.parent.name}): {line}")
    mpath = Path(args.path) / "metrics.json"
    if mpath.is_file():
        m = read_json(mpath)
        for site, rnd, task, reason in excluded_rows(m):
            print(f"WARNING: {site} excluded (round {rnd}, {task}): {reason}", file=sys.stderr)
        msg = no_results_message(m)
    else:
        msg = compare_no_results_message(args.path)
    if msg:
        print(f"cxr-hfl report: {msg}", file=sys.stderr)
        return 1
    return 0


def run_compare(args) -> int:
    from nvflare_jobs.compare import CompareOptions
    from nvflare_jobs.compare import run_compare as _run

    return _run(CompareOptions.from_mapping(vars(args)))
