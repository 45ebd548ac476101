"""``cxr-hfl report``: one self-contained HTML file (PNG figures embedded as base64) for a run or a comparison.

Run report: header (exact command, package versions, seeds, sha256 of the data manifests), per-site results,
figures (per-site accuracy, round curves, confusion matrices made from metrics.json, OHFL CKA heatmaps and
fine-tuning curves, FedTopo topology/reliability heatmaps, FedSAF effective rank, payload), external validation
results when ``RUN/external/`` exists with each set's shortcut audit (``audit.json``, flags in red), and a model
card. Comparison report: the comparison tables, a per-method accuracy figure and each run's site-accuracy figure.
"""
from __future__ import annotations

import base64
import hashlib
import html
import io
import json
import platform
from importlib import metadata
from pathlib import Path

from nvflare_jobs.audit import ci_text, find_audits

PACKAGES = ("cxr-hfl", "nvflare", "torch", "monai", "numpy", "scikit-learn", "scipy", "pydicom", "pillow", "POT",
            "matplotlib")

FIGURE_FILES = [  # (file in the run folder, caption)
    ("site_accuracy.png", "Per-site test accuracy"),
    ("round_curves.png", "Validation accuracy per round"),
    ("finetune_loss.png", "OHFL fine-tuning curves"),
    ("effective_rank.png", "FedSAF effective rank of the site prototypes per round"),
    ("R_global.png", "FedTopo global relation topology"),
    ("S_global.png", "FedTopo reliability"),
    ("topology_diagnostics.png", "FedTopo topology inconsistency per site"),
    ("payload_per_round.png", "Communication per site and round"),
]

CITATION = ("Kermany D, Zhang K, Goldbaum M. Labeled Optical Coherence Tomography (OCT) and Chest X-Ray Images for "
            "Classification. Mendeley Data, v2, 2018. doi:10.17632/rscbjbr9sj.2 (CC BY 4.0)")


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for p in PACKAGES:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            continue
    return out


def manifest_hash(run: Path) -> tuple[str | None, list[str]]:
    """sha256 over the run's site manifest CSVs (sorted by site; name and bytes of each)."""
    from nvflare_jobs.evaluation import run_manifests

    mans = run_manifests(run)
    if not mans:
        return None, []
    h = hashlib.sha256()
    for site in sorted(mans):
        h.update(site.encode() + b"\0" + mans[site].read_bytes() + b"\0")
    return h.hexdigest(), [str(mans[s]) for s in sorted(mans)]


def _png_b64(path_or_fig) -> str:
    if isinstance(path_or_fig, (str, Path)):
        data = Path(path_or_fig).read_bytes()
    else:
        import matplotlib.pyplot as plt

        buf = io.BytesIO()
        path_or_fig.savefig(buf, format="png", dpi=100)
        plt.close(path_or_fig)
        data = buf.getvalue()
    return base64.b64encode(data).decode("ascii")


def _figure(b64: str, caption: str) -> str:
    return (f'<figure><img src="data:image/png;base64,{b64}" alt="{html.escape(caption)}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


def confusion_figure(cm, class_names: list[str], title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    cm = np.asarray(cm, dtype=float)
    fig, ax = plt.subplots(figsize=(2.2 + 0.5 * len(class_names), 2.0 + 0.5 * len(class_names)))
    ax.imshow(cm, cmap="Blues")
    ticks = range(len(class_names))
    ax.set_xticks(ticks, class_names, rotation=30, fontsize=7)
    ax.set_yticks(ticks, class_names, fontsize=7)
    for i in range(cm.shape[0]):
        for j in range(cm.shape[1]):
            ax.text(j, i, f"{int(cm[i, j])}", ha="center", va="center",
                    color="white" if cm[i, j] > cm.max() / 2 else "black", fontsize=9)
    ax.set_xlabel("predicted", fontsize=8)
    ax.set_ylabel("true", fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def _f(v, nd=3) -> str:
    return "–" if v is None else f"{v:.{nd}f}"


def _table(header: list[str], rows: list[list]) -> str:
    h = "".join(f"<th>{html.escape(str(c))}</th>" for c in header)
    b = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{h}</tr></thead><tbody>{b}</tbody></table>"


CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.2em}td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px}
th{background:#f2f2f2}figure{display:inline-block;margin:.5em;vertical-align:top;text-align:center}
figure img{max-width:520px}figcaption{font-size:12px;color:#555}code{background:#f5f5f5;padding:1px 3px}
.card{border:1px solid #999;padding:.5em 1em;background:#fafafa}.warn{color:#a00}"""


def _page(title: str, body: list[str]) -> str:
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{CSS}</style></head><body>" + "\n".join(body) + "</body></html>\n")


def _model_name(spec: dict | None) -> str:
    spec = spec or {}
    return "/".join(str(spec[k]) for k in ("family", "depth", "width") if spec.get(k) is not None) or "?"


def pooled_note(m: dict) -> str:
    """Which sites the pooled metrics come from (``metrics.json`` ``pooled_sites``: the sites that shared per-image
    predictions), e.g. ``from 1 of 3 sites with results (site-1; the others keep predictions at home)``."""
    with_results = sites_with_results(m)
    pooled = m.get("pooled_sites")
    if pooled is None:  # a run assembled before pooled_sites was recorded
        return "from the sites that shared per-image predictions (not recorded which)"
    if not pooled:
        return "none: no site shared per-image predictions (share_predictions: false keeps them at the site)"
    rest = [s for s in with_results if s not in pooled]
    return (f"from {len(pooled)} of {len(with_results)} sites with results ({', '.join(pooled)})"
            + (f"; {', '.join(rest)} kept their predictions at home (share_predictions: false)" if rest else ""))


def _models_sentence(m: dict, sites: dict, who: str) -> str:
    """What the card's models are: one per site at its own architecture, or, for the pooled-data reference
    ``central``, one model of the deepest site architecture trained on the sites' pooled training images."""
    method, labels = html.escape(str(m.get("method"))), html.escape(str(m.get("labels")))
    if m.get("method") != "central":
        return (f"{len(sites)} site models trained with <code>{method}</code> (label scheme <code>{labels}</code>), "
                f"{who}, each at its own architecture and input resolution")
    sizes = sorted({int(b["input_size"]) for b in sites.values() if b.get("input_size") is not None})
    at = " / ".join(str(s) for s in sizes) + " px" if sizes else "the sites' input sizes"
    return (f"one model of the deepest site architecture ({html.escape(_model_name(m.get('global_spec')))}) trained "
            f"with <code>{method}</code> (label scheme <code>{labels}</code>) on the pooled training images of the "
            f"{len(sites)} sites, then scored at every site at {at}: a pooled-data reference (every site's images in "
            "one place), the ceiling the federation's gap is read against; not a federated result and not "
            "deployable as one")


def model_card(m: dict, audit: str | None = None) -> str:
    """The model card of a run, describing the run itself: its sites (simulated partitions of the Kermany set, or
    a consortium's hospitals for a POC / provisioned job), the counts of sites, training and test images, the
    sites left out, which sites the pooled metrics come from, the bytes each site uploaded and downloaded (and,
    where every site received its peers' models, their bytes), and the shortcut audit's headline (``audit``) when
    given."""
    sites = m.get("sites", {})
    per_site = m.get("bytes_per_site") or {}  # metrics.json of runs assembled before it was recorded: none
    rows = [[s, _model_name(b.get("model")), b.get("input_size"), b.get("n_train"), b.get("n_test"),
             _f((b.get("test") or {}).get("accuracy")), _f((b.get("test") or {}).get("auc")),
             *(f"{per_site[s][k]:,}" if s in per_site else "–" for k in ("up", "down"))]
            for s, b in sites.items()]
    peers = {s: d["peer_models_down"] for s, d in per_site.items() if "peer_models_down" in d}
    deployed = m.get("job_id") is not None or m.get("downloaded_from") is not None
    excluded = sorted(set(m.get("excluded_sites") or {}) - set(sites_with_results(m)))
    n_train = sum(int(b.get("n_train") or 0) for b in sites.values())
    n_test = sum(int(b.get("n_test") or 0) for b in sites.values())
    who = ("one per hospital of the consortium that finished the job "
           f"(job {html.escape(str(m.get('job_id')))}, status {html.escape(str(m.get('job_status')))})"
           if deployed else "one per simulated hospital site")
    if deployed:
        data = ("<p><b>Training data:</b> each hospital's own images, which never left the hospital; the coordinator "
                "has not seen them. Population, scanners and label sources are as each hospital's data owner "
                "documents them; this card cannot state them.</p>")
    else:
        data = (f"<p><b>Training data:</b> the Kermany chest X-ray set — paediatric patients (ages 1–5) from a single "
                f"centre (Guangzhou Women and Children's Medical Center), anterior–posterior JPEGs. "
                f"{html.escape(CITATION)}. The sites are simulated partitions of this one set, not different "
                "hospitals.</p>")
    return ("<div class='card'><h2>Model card</h2>"
            f"<p><b>Models:</b> {_models_sentence(m, sites, who)}; {n_train} training and {n_test} test images in all"
            + (f"; left out: {html.escape(', '.join(excluded))} (see Excluded sites)" if excluded else "") + ".</p>"
            "<p><b>Intended use:</b> research on heterogeneous federated learning for chest X-ray classification "
            "(normal vs pneumonia, or pneumonia subtype). <b>Not a medical device; not for clinical decisions.</b></p>"
            + data +
            "<p><b>Not validated on:</b> adults; other centres, scanners or populations; DICOM from other vendors or "
            "acquisition protocols; lateral views; portable/ICU films; other findings (COVID-19, tuberculosis, "
            "effusion, ...); images with devices or annotations. Pneumonia labels come from the dataset's grading, "
            "not from a reference standard such as CT or culture.</p>"
            "<p><b>Per-site results</b> (each site's own held-out test split, argmax decision):</p>"
            + _table(["site", "model", "input px", "n train", "n test", "accuracy", "AUC", "bytes up", "bytes down"],
                     rows)
            + ("<p><b>Peer-to-peer share:</b> every site received every other site's model; of each site's "
               "download, the peers' models were " + html.escape(", ".join(f"{s} {v:,}" for s, v in peers.items()))
               + " bytes.</p>" if peers else "")
            + "<p><b>Pooled metrics:</b> " + html.escape(pooled_note(m)) + ".</p>"
            + "<p><b>Limitations:</b> small test splits give wide confidence intervals; the pooled 95% CIs below are "
              "bootstrap intervals over images, not over sites or centres.</p>"
            + (f"<p><b>Shortcut audit</b> (section below): {html.escape(audit)}.</p>" if audit else "")
            + f"<p><b>Differential privacy:</b> {html.escape(dp_statement(sites))}.</p></div>")


def dp_statement(sites: dict) -> str:
    """The model card's and report's privacy line (:func:`hfl_components.privacy.run_dp_line`), with each DP site's
    noise multiplier, sample rate and steps."""
    from hfl_components.privacy import run_dp_line

    parts = [run_dp_line(sites)]
    for s, b in sorted(sites.items()):
        for key, r in ((b.get("dp") or {}).get("sessions") or {}).items():
            parts.append(f"{s} ({key}): noise multiplier {r.get('noise_multiplier'):.3g}, sample rate "
                         f"{r.get('sample_rate'):.3g}, {r.get('steps')} steps, epsilon {r.get('epsilon'):.2f}, "
                         f"delta {r.get('delta'):.2g}")
    return "; ".join(parts)


def excluded_rows(m: dict) -> list[list]:
    """``[site, round, task, reason]`` per exclusion in ``metrics.json``'s ``excluded_sites`` (site -> list of
    ``{"round", "task", "reason"}``; a bare string or a list of strings is accepted too)."""
    rows = []
    for site, entries in (m.get("excluded_sites") or {}).items():
        for e in entries if isinstance(entries, list) else [entries]:
            if isinstance(e, dict):
                rows.append([site, e.get("round", "–"), e.get("task", "–"), e.get("reason", "(no reason recorded)")])
            else:
                rows.append([site, "–", "–", str(e)])
    return rows


def sites_with_results(m: dict) -> list[str]:
    """Sites of ``metrics.json`` that have test results."""
    return [s for s, b in (m.get("sites") or {}).items() if isinstance(b, dict) and b.get("test")]


def no_results_message(m: dict) -> str | None:
    """A one-line explanation when a run has no site results (e.g. every site was excluded), else None."""
    if sites_with_results(m):
        return None
    exc = sorted((m.get("excluded_sites") or {}))
    why = (f"{len(exc)} site(s) excluded: {', '.join(exc)} (reasons in the report)" if exc
           else "no site reported test results")
    return f"the run has NO site results -- no model was trained and evaluated; {why}"


def compare_no_results_message(cdir: str | Path) -> str | None:
    """A one-line explanation when no run of a compare folder has site results (every run unfinished, failed or
    with every site excluded), else None."""
    from nvflare_jobs.compare import collect_runs, comparison_rows

    if comparison_rows(collect_runs(Path(cdir)), thresholds=False):
        return None
    return ("the comparison has NO results -- no run of it has site results (unfinished or failed runs; rerun "
            "cxr-hfl compare on the folder to resume them)")


class UnreadableFile(ValueError):
    """A run or compare file that is not readable as JSON (one line naming it)."""


def read_json(path: str | Path):
    """The JSON document in ``path``.

    Raises:
        UnreadableFile (a ValueError): empty, truncated or not JSON; the line names the file.
    """
    try:
        return json.loads(Path(path).read_text())
    except ValueError as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UnreadableFile(f"{path}: unreadable as JSON ({why})") from None


# ------------------------------------------------------------------------------------------ the shortcut audit
# One ``audit.json`` (:mod:`nvflare_jobs.audit`) as HTML, with flags in red and the Grad-CAM montage embedded; the
# model card's one-sentence audit note.
esc = html.escape
RED = "class='warn'"


def _flag_table(head: list[str], rows: list[list[tuple[str, bool]]]) -> str:
    """A table whose cells are ``(text, flagged)``; flagged cells are red."""
    h = "".join(f"<th>{esc(c)}</th>" for c in head)
    b = "".join("<tr>" + "".join(f"<td {RED if fl else ''}>{esc(str(t))}</td>" for t, fl in r) + "</tr>"
                for r in rows)
    return f"<table><thead><tr>{h}</tr></thead><tbody>{b}</tbody></table>"


def _metadata_html(md: dict) -> list[str]:
    if md.get("auc") is None:
        return [f"<p>Metadata baseline: not computed ({esc(str(md.get('skipped')))}).</p>"]
    body = [f"<p><b>Metadata baseline</b>: a cross-validated random forest on file-level facts only "
            f"({esc(', '.join(md.get('features') or []))}) predicts PNEUMONIA with AUC "
            f"{ci_text(md, 'auc', signed=False)} (95% CI). Strongest single facts: "
            + esc(", ".join(f"{k} {v:.2f}" for k, v in list((md.get('fact_aucs') or {}).items())[:4]))
            + ". A model whose margin CI is not above 0 (red) is not shown to read more than the file.</p>"]
    rows = [[(n, False), (ci_text({"mean_change": v["model_auc"], "ci_low": v["model_ci"][0],
                                   "ci_high": v["model_ci"][1]}, signed=False), False),
             (ci_text({"mean_change": v["margin"], "ci_low": v["margin_ci"][0], "ci_high": v["margin_ci"][1]}),
              v.get("beats_metadata") is False)]
            for n, v in (md.get("margins") or {}).items()]
    body.append(_flag_table(["model", "AUC [95% CI]", "margin model − metadata [95% CI]"], rows))
    if md.get("not_applicable"):
        body.append("<p>Not applicable: " + esc("; ".join(f"{k}: {v}" for k, v in md["not_applicable"].items()))
                    + ".</p>")
    return body


def _probes_html(pr: dict) -> list[str]:
    from hfl_components.audit.probes import GAMMA, SHIFT_FRACTION, TOLERANCE

    if not pr.get("models"):
        return []
    rows = []
    for n, r in pr["models"].items():
        row = [(n, False)]
        for p in ("flip", "shift", "contrast", "aspect"):
            v = r.get(p) or {}
            row.append(("not applicable (square images)" if v.get("applicable") is False else ci_text(v),
                        bool(v.get("flagged"))))
        rows.append(row)
    return [f"<p><b>Perturbation probes</b> on a fixed class-balanced subsample of {pr.get('n_images')} images: "
            f"mean change of p(PNEUMONIA) [95% CI] (Δp(NORMAL) = −Δp). flip: horizontal mirror; shift: "
            f"{100 * SHIFT_FRACTION:.0f}% along both axes with a black (zero) border; contrast: gamma {GAMMA}; "
            f"aspect: centred square crop against the model's own squaring. Red: beyond the tolerance "
            f"±{TOLERANCE} with a CI excluding 0.</p>",
            _flag_table(["model", "flip", "shift / border", "contrast", "aspect"], rows)]


def _saliency_html(sa: dict, ext_dir: Path) -> list[str]:
    if not sa.get("models"):
        return []
    body = [f"<p><b>Saliency</b> (Grad-CAM, {sa.get('n_images')} fixed images per model): share of the saliency "
            f"in the outer {100 * sa.get('band', 0.1):.0f}% border band, mean [95% CI]; a uniform map gives "
            f"{sa.get('uniform_share', 0):.2f}. This number is crude: Grad-CAM maps are coarse, and a high share "
            "is a hint to look at the montage, not a finding.</p>",
            _flag_table(["model", "border share"],
                        [[(n, False), (ci_text(v.get("border_share"), "mean", signed=False), False)]
                         for n, v in sa["models"].items()])]
    png = ext_dir / str(sa.get("montage") or "")
    if sa.get("montage") and png.is_file():
        b64 = base64.b64encode(png.read_bytes()).decode("ascii")
        body.append(f'<figure><img style="max-width:1000px" src="data:image/png;base64,{b64}" '
                    f'alt="Grad-CAM montage"><figcaption>Grad-CAM for PNEUMONIA, one row per model '
                    f'({esc(", ".join(sa.get("montage_models") or []))})</figcaption></figure>')
    return body


def operating_point_section(m: dict) -> list[str]:
    """The run report's operating-point section from ``metrics.json``: the one line of
    :func:`hfl_components.operating_point.describe` (red when no threshold was set), then each site's temperature
    and its own validation and test sensitivity / specificity at the threshold beside the pooled test values."""
    from hfl_components.operating_point import describe

    op = m.get("operating_point")
    if not op:
        return []
    if op.get("rule") == "per-model":
        return [f"<h2>Clinical operating point</h2><p>{esc(describe(op))}</p>", *acceptance_section(m)]
    unset = op.get("threshold") is None
    line = esc(describe(op))
    body = ["<h2>Clinical operating point</h2>", f"<p class='warn'><b>{line}</b></p>" if unset else f"<p>{line}</p>"]
    own = op.get("site_sensitivity") or {}
    if own and not unset:
        def f(v):
            return "–" if v is None else f"{v:.3f}"
        rows = [[s, f(o.get("temperature")), f(o.get("sensitivity")), f(o.get("specificity")),
                 f((o.get("test") or {}).get("sensitivity")), f((o.get("test") or {}).get("specificity"))]
                for s, o in sorted(own.items())]
        t = op.get("test") or {}
        rows.append(["pooled", "", f(op.get("sensitivity")) + " (lower bound)", f(op.get("specificity")) + "–"
                     + f(op.get("specificity_upper")), f(t.get("sensitivity")), f(t.get("specificity"))])
        body.append(_flag_table(["site", "T", "val. sensitivity", "val. specificity", "test sensitivity",
                                 "test specificity"], [[(str(c), False) for c in r] for r in rows]))
    return body


def acceptance_section(m: dict) -> list[str]:
    """The site acceptance check (``metrics.json``'s ``acceptance``, OHFL with the gate): the line with the refusal
    rate (red when a site was refused), then per site the outcome, what it deploys, the acceptance data's
    sensitivity and specificity with their lower bounds, and the test split's at the operating point."""
    acc = m.get("acceptance")
    if not isinstance(acc, dict) or not acc.get("per_site"):
        return []

    def f(v):
        return "–" if v is None else f"{v:.3f}"

    def b(v):
        v = v or {}
        return f"{f(v.get('value'))} (≥ {f(v.get('lower'))})"
    rows = [[(s, False), (str(o.get("outcome")), o.get("outcome") != "accepted"), (str(o.get("deployed") or "nothing"),
             o.get("deployed") is None), (b(o.get("sensitivity")), False), (b(o.get("specificity")), False),
             (f(o.get("test_sensitivity")), False), (f(o.get("test_specificity")), False)]
            for s, o in sorted(acc["per_site"].items())]
    cls = " class='warn'" if acc.get("refused") else ""
    return ["<h3>Site acceptance check</h3>", f"<p{cls}>{esc(acc.get('line') or '')}; out-of-fold training cost "
            f"{float(acc.get('oof_seconds') or 0):.0f} s</p>",
            _flag_table(["site", "outcome", "deploys", "acceptance sensitivity (lower bound)",
                         "acceptance specificity (lower bound)", "test sensitivity", "test specificity"], rows),
            *calibration_section(acc["per_site"])]


def calibration_section(per_site: dict) -> list[str]:
    """Calibration a clinician can read: each site's ECE of its acceptance data before and after the calibration
    step it kept, and one reliability diagram of the sites' calibrated acceptance scores
    (:func:`nvflare_jobs.plots.reliability_diagram`; bins and counts only)."""
    import tempfile

    from nvflare_jobs import plots

    def f(v):
        return "–" if v is None else f"{v:.3f}"
    rows = [[s, f(o.get("ece_before")), f(o.get("ece_after"))] for s, o in sorted(per_site.items())
            if o.get("ece_before") is not None or o.get("ece_after") is not None]
    curves = {s: o["reliability"] for s, o in sorted(per_site.items()) if (o.get("reliability") or {}).get("n")}
    if not rows and not curves:
        return []
    body = ["<h3>Calibration</h3>", "<p>Expected calibration error (ECE, 10 bins) of each site's acceptance data "
            "(out-of-fold training scores + validation) before and after the calibration step it kept; the "
            "step is kept only where it lowers the cross-validated ECE.</p>",
            _table(["site", "ECE before", "ECE after"], rows)]
    if curves:
        with tempfile.TemporaryDirectory() as d:
            png = plots.reliability_diagram(Path(d) / "reliability.png", curves, title="reliability per site")
            body.append(_figure(_png_b64(png), "Reliability diagram: observed share of PNEUMONIA against the mean "
                                               "calibrated p(PNEUMONIA) per bin, each site's acceptance data"))
    return body


def population_note(run: Path) -> list[str]:
    """The model card's training population: one sentence per deployed model file that records its population
    (:func:`hfl_components.shift.population_statement`), so a hospital sees whom the model was trained on."""
    from hfl_components.models import read_model_header
    from hfl_components.shift import population_statement

    out = []
    for f in sorted((run / "models").glob("*_deployed.pt")) if (run / "models").is_dir() else []:
        try:
            ref = read_model_header(f).get("population")
        except (ValueError, OSError):
            continue
        if ref:
            out.append(f"<li>{esc(f.stem.removesuffix('_deployed'))}: {esc(population_statement(ref))}</li>")
    return ["<h3>Training population (deployed models)</h3><ul>" + "".join(out) + "</ul>"] if out else []


def _operating_point_html(op: dict) -> list[str]:
    fed = op.get("federated") or {}
    if not op.get("models"):
        return ([f"<p class='warn'><b>Clinical operating point: the federation set no threshold: "
                 f"{esc(str(fed['unresolved']))}</b></p>"] if fed.get("unresolved") else [])
    own = fed.get("site_sensitivity") or {}

    def num(v):
        return (ci_text({"mean_change": v}, signed=False), False)

    rows = [[(n, False), (f"{v['temperature']:.2f}", False), (f"{v['threshold']:.3f}", False),
             (ci_text(v.get("sensitivity"), "value", signed=False),
              ((v.get("sensitivity") or {}).get("value") or 0) < 0.9),
             (ci_text(v.get("specificity"), "value", signed=False), False), num(v.get("ece_before")),
             num(v.get("ece_after")), num((own.get(n.rpartition("_")[0]) or {}).get("sensitivity"))]
            for n, v in op["models"].items()]
    return ["<p><b>Clinical operating point</b>: each deployed model's temperature (fit on its site's validation "
            "split) and the one federated threshold on calibrated p(PNEUMONIA) chosen for a target sensitivity of "
            f"{fed.get('target', '–')} on the sites' pooled coarse validation histograms (pooled validation "
            f"sensitivity, a lower bound: {num(fed.get('sensitivity'))[0]}). Red: sensitivity under 0.90 on these "
            "images. The last column is each site's own validation sensitivity at the threshold.</p>",
            _flag_table(["model", "T", "threshold", "sensitivity [95% CI]", "specificity [95% CI]", "ECE before",
                         "ECE after", "site's own val. sensitivity"], rows)]


def audit_html(a: dict, ext_dir: Path) -> list[str]:
    """HTML of one ``audit.json`` for ``cxr-hfl report`` (flags in red; the montage embedded)."""
    body = [f"<h3>Shortcut audit ({a.get('n_images')} images; {esc(str(a.get('device')))})</h3>"]
    body += _metadata_html(a.get("metadata") or {})
    body += _probes_html(a.get("probes") or {})
    body += _saliency_html(a.get("saliency") or {}, ext_dir)
    body += _operating_point_html(a.get("operating_point") or {})
    if a.get("skipped"):
        body.append("<p>Skipped:</p><ul>" + "".join(f"<li>{esc(s)}</li>" for s in a["skipped"]) + "</ul>")
    return body


def card_note(run: Path) -> str | None:
    """One sentence for the model card: the audit's headline per evaluated set, or None without an audit."""
    notes = []
    for f in find_audits(run):
        a = read_json(f)
        md = a.get("metadata") or {}
        flags = [p for r in ((a.get("probes") or {}).get("models") or {}).values() for p, v in r.items()
                 if isinstance(v, dict) and v.get("flagged")]
        weak = sum(1 for v in (md.get("margins") or {}).values() if v.get("beats_metadata") is False)
        meta = f"file facts alone reach AUC {md['auc']:.2f}" if md.get("auc") is not None else "no metadata baseline"
        notes.append(f"{f.parent.name}: {meta}; {weak} of {len(md.get('margins') or {})} models not shown to beat "
                     f"it; {len(flags)} probe results beyond the tolerance")
    return "; ".join(notes) or None


def render_run(run: Path) -> str:
    from chest_xray import CLASS_NAMES

    m = read_json(run / "metrics.json")
    if not isinstance(m, dict):
        raise ValueError(f"{run / 'metrics.json'}: not a metrics document (expected a JSON object)")
    if not m.get("method"):  # every run record names its method (as cxr-hfl status checks)
        raise ValueError(f"{run / 'metrics.json'}: not a cxr-hfl run record (no method; truncated, edited or another "
                         "program's file?)")
    labels = m.get("labels") or "binary"
    names = CLASS_NAMES.get(labels, [])
    digest, mans = manifest_hash(run)
    opts = read_json(run / "job_options.json") if (run / "job_options.json").is_file() else {}
    body = [f"<h1>cxr-hfl run report: {html.escape(str(m.get('method')))}</h1>"]
    empty = no_results_message(m)
    if empty:
        body.append(f"<p class='warn'><b>WARNING: {html.escape(empty)}.</b> Nothing below is a result.</p>")
    exc = excluded_rows(m)
    if exc:
        body += [f"<h2 class='warn'>Excluded sites ({len({r[0] for r in exc})})</h2>",
                 "<p class='warn'>These sites were left out of the federation (the rounds and reasons as the "
                 "server recorded them); their data did not contribute to the results below.</p>",
                 _table(["site", "round", "task", "reason"], exc)]
    body += ["<h2>How to repeat this run</h2>",
            _table(["field", "value"], [
                ["command", m.get("command", "(not recorded)")],
                ["run folder", str(run)],
                ["method / labels", f"{m.get('method')} / {labels}"],
                ["seed", m.get("seed")],
                ["job options", json.dumps({k: v for k, v in opts.items() if v not in (None, [], "")})],
                ["data manifest sha256", digest or "(no manifests found)"],
                ["manifests", "; ".join(mans)],
                ["versions", ", ".join(f"{k} {v}" for k, v in versions().items())],
                ["wall time (s)", m.get("wall_time_s")]])]
    body.append(model_card(m, card_note(run)))
    body += population_note(run)
    body += _results_sections(m)
    body += operating_point_section(m)
    body += _figure_sections(run, m, names, bool(empty))
    body += _external_sections(run)
    return _page(f"cxr-hfl report {m.get('method')}", body)


def _results_sections(m: dict) -> list[str]:
    """Per-site test results, pooled metrics with CIs, bytes / server seconds / fairness."""
    body: list[str] = []
    rows = []
    for s, b in m.get("sites", {}).items():
        t = b.get("test") or {}
        loc = b.get("local") or {}
        rows.append([s, _model_name(b.get("model")), b.get("input_size"), b.get("n_test"),
                     *[_f(t.get(k)) for k in ("accuracy", "balanced_accuracy", "auc", "sensitivity", "specificity")],
                     _f(loc.get("accuracy"))])
    body += ["<h2>Per-site test results</h2>",
             _table(["site", "model", "px", "n test", "accuracy", "balanced acc.", "AUC", "sensitivity",
                     "specificity", "local model acc."], rows)]
    pooled = m.get("pooled") or {}
    prow = [[k.replace("_", " "), _f((pooled.get(k) or {}).get("value")),
             f"{_f((pooled.get(k) or {}).get('ci_low'))}–{_f((pooled.get(k) or {}).get('ci_high'))}"]
            for k in ("accuracy", "balanced_accuracy", "auc", "sensitivity", "specificity")]
    body += ["<h2>Pooled test metrics (95% bootstrap CI)</h2>", f"<p>{html.escape(pooled_note(m))}.</p>",
             _table(["metric", "value", "95% CI"], prow)]
    if m.get("tensorboard"):
        body.append(f"<p>Training curves (per-site loss, validation metrics): <code>tensorboard --logdir "
                    f"{html.escape(str(m['tensorboard']))}</code></p>")
    extra = []
    if m.get("bytes_uploaded") is not None:
        extra.append(["bytes uploaded / downloaded", f"{m.get('bytes_uploaded'):,} / {m.get('bytes_downloaded', 0):,}"])
    if m.get("server_seconds"):
        extra.append(["server seconds", json.dumps(m["server_seconds"])])
    if m.get("fairness_variance") is not None:
        extra.append(["fairness variance (acc %^2)", _f(m["fairness_variance"], 2)])
    if extra:
        body.append(_table(["", ""], extra))
    return body


def _figure_sections(run: Path, m: dict, names: list, empty: bool) -> list[str]:
    """The run's figures, CKA heatmaps and per-site confusion matrices (the accuracy chart left out when empty)."""
    body: list[str] = []
    body.append("<h2>Figures</h2>")
    for fname, cap in FIGURE_FILES:
        if fname == "site_accuracy.png" and empty:
            continue  # an empty chart
        if (run / fname).is_file():
            body.append(_figure(_png_b64(run / fname), cap))
    for p in sorted(run.glob("cka_cost_step*.png"), key=lambda p: int(p.stem.removeprefix("cka_cost_step") or 0)):
        body.append(_figure(_png_b64(p), f"OHFL CKA cost heatmap with the layer map, fusion {p.stem.removeprefix('cka_cost_step')}"))
    body.append("<h3>Confusion matrices (test split)</h3>")
    for s, b in m.get("sites", {}).items():
        cm = (b.get("test") or {}).get("confusion_matrix")
        if cm:
            body.append(_figure(_png_b64(confusion_figure(cm, names or [str(i) for i in range(len(cm))], s)),
                                f"Confusion matrix {s}"))
    return body


def _external_sections(run: Path) -> list[str]:
    """One table per external validation folder of the run."""
    body: list[str] = []
    for ext in sorted(run.glob("external/*/summary.json")) + sorted(run.glob("external/summary.json")):
        e = read_json(ext)
        erows = [[k, v.get("input_size"), *[_f(v.get(x)) for x in ("accuracy", "balanced_accuracy", "auc")],
                  _f(v.get("val_threshold")), _f(v.get("sensitivity_at_val_threshold")),
                  _f(v.get("specificity_at_val_threshold"))] for k, v in e.get("models", {}).items()]
        what = html.escape(e.get("data", "")) + (f" (part {html.escape(str(e['part']))})" if e.get("part") else "")
        body += [f"<h2>External validation: {what} ({e.get('n_images')} images, "
                 f"{e.get('probe_images_excluded', 0)} probe images left out)</h2>",
                 *(["<p class='warn'>WARNING: evaluated with --force on a set that overlaps the run's data; "
                    "these are not external results.</p>"] if e.get("forced") else []),
                 _table(["model", "px", "accuracy", "balanced acc.", "AUC", "val threshold", "sensitivity @thr",
                         "specificity @thr"], erows),
                 *(["<p>global: each metric at every site's input size, averaged over sites (no size chosen on "
                    "the test set).</p>"] if "global" in e.get("models", {}) else [])]
        if (ext.parent / "audit.json").is_file():
            body += audit_html(read_json(ext.parent / "audit.json"), ext.parent)
    return body


def render_compare(cdir: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from nvflare_jobs.compare import method_order, collect_runs, comparison_rows

    runs = collect_runs(cdir)
    rows = comparison_rows(runs, thresholds=False)
    md = (cdir / "comparison.md").read_text() if (cdir / "comparison.md").is_file() else ""
    cj = read_json(cdir / "compare.json") if (cdir / "compare.json").is_file() else {}
    digests = []
    for sd in sorted(cdir.glob("seed*")):
        if (sd / "partition" / "sites").is_dir():
            h = hashlib.sha256()
            for f in sorted((sd / "partition" / "sites").glob("*.csv")):
                h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
            digests.append([sd.name, h.hexdigest()])
    body = ["<h1>cxr-hfl method comparison</h1>",
            _table(["field", "value"], [["command", cj.get("command", "(not recorded)")],
                                        ["seeds", ", ".join(map(str, cj.get("seeds", [])))],
                                        ["versions", ", ".join(f"{k} {v}" for k, v in versions().items())]]),
            "<h2>Data manifest sha256 per seed</h2>", _table(["seed", "sha256 of partition/sites/*.csv"], digests)]
    if not rows:
        body.append(f"<p class='warn'><b>WARNING: {html.escape(compare_no_results_message(cdir) or '')}.</b></p>")
    methods = method_order(r["method"] for r in rows)
    if rows:
        fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(methods)), 3.5))
        data = [[100 * r["accuracy"] for r in rows if r["method"] == m and r["accuracy"] is not None]
                for m in methods]
        ax.boxplot(data)
        ax.set_xticks(range(1, len(methods) + 1), methods)
        for i, d in enumerate(data, start=1):
            ax.scatter(np.full(len(d), i), d, s=12, alpha=.6)
        ax.set_ylabel("site test accuracy (%)")
        ax.set_title("Per-site test accuracy by method (all seeds)")
        fig.tight_layout()
        body.append(_figure(_png_b64(fig), "Per-site accuracy by method"))
    body.append("<h2>Tables</h2><pre>" + html.escape(md) + "</pre>")
    body.append("<h2>Runs</h2>")
    notes = [[method, seed, card_note(Path(m.get("_run_dir") or cdir / f"seed{seed}" / method))]
             for method, seed, m in runs]
    if any(n[2] for n in notes):
        body += ["<h3>Shortcut audit per run (details in each run's report)</h3>",
                 _table(["method", "seed", "audit"], [n for n in notes if n[2]])]
    for method, seed, m in runs:
        p = cdir / f"seed{seed}" / method / "site_accuracy.png"
        if p.is_file():
            body.append(_figure(_png_b64(p), f"{method} seed {seed}: per-site test accuracy"))
    if runs:
        body.append(model_card(runs[0][2]).replace("Model card", "Model card (first run; every run shares the data)"))
    return _page("cxr-hfl comparison", body)


def check_compare_tables(cdir: Path) -> None:
    """Check the tables ``cxr-hfl compare`` wrote into ``cdir`` (``comparison.csv``, and
    ``comparison_external.csv`` when present) before a report is made from the folder.

    Raises:
        ValueError: naming the file, when it is not a comparison table: unreadable as UTF-8 CSV, a header without
        compare's key columns, a seed that is not an integer or a metric that is not a number.
    """
    import csv

    from nvflare_jobs.compare.tables import EXT_COLUMNS, METRICS

    tables = (("comparison.csv", ("method", "seed", "site", *METRICS), METRICS),
              ("comparison_external.csv", (*EXT_COLUMNS[:3], *EXT_COLUMNS[7:]), EXT_COLUMNS[7:]))
    for name, keys, numbers in tables:
        f = cdir / name
        if not f.is_file():
            continue
        try:
            with f.open(newline="", encoding="utf-8") as fh:
                reader = csv.DictReader(fh)
                missing = [k for k in keys if k not in (reader.fieldnames or [])]
                if missing:
                    raise ValueError(f"no column(s) {', '.join(missing)}")
                for i, r in enumerate(reader, start=2):
                    bad = [k for k in ("seed", *numbers) if not _cell_ok(r.get(k), k == "seed")]
                    if bad:
                        raise ValueError(f"line {i}: {bad[0]} {r.get(bad[0])!r} is not a number")
        except (ValueError, csv.Error) as e:
            raise ValueError(f"{f}: not a table written by `cxr-hfl compare` ({e}); rerun compare on the "
                             f"folder to rewrite it") from None


def _cell_ok(v: str | None, integer: bool) -> bool:
    """A CSV cell as compare writes it: an integer seed; a metric a number or empty (not measured)."""
    if v is None:
        return False
    try:
        int(v) if integer else float(v or 0)
    except ValueError:
        return False
    return True


def render_report(path: str | Path, out: str | Path | None = None) -> Path:
    p = Path(path).resolve()
    if (p / "metrics.json").is_file():
        text = render_run(p)
    elif (p / "comparison.csv").is_file() or list(p.glob("seed*/*/metrics.json")):
        check_compare_tables(p)
        text = render_compare(p)
    else:
        raise FileNotFoundError(f"{p}: neither a run folder (metrics.json) nor a compare folder (comparison.csv)")
    dest = Path(out) if out else p / "report.html"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(text, encoding="utf-8")
    return dest
