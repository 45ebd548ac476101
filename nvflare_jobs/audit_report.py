"""The shortcut audit in ``report.html`` and the model card: one ``audit.json`` (:mod:`nvflare_jobs.audit`) as
HTML, with flags in red and the Grad-CAM montage embedded."""
from __future__ import annotations

import base64
import html
from pathlib import Path

from nvflare_jobs.audit import _cell, find_audits

esc = html.escape
RED = "class='warn'"


def _table(head: list[str], rows: list[list[tuple[str, bool]]]) -> str:
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
            f"{_cell(md, 'auc', signed=False)} (95% CI). Strongest single facts: "
            + esc(", ".join(f"{k} {v:.2f}" for k, v in list((md.get('fact_aucs') or {}).items())[:4]))
            + ". A model whose margin CI is not above 0 (red) is not shown to read more than the file.</p>"]
    rows = [[(n, False), (_cell({"mean_change": v["model_auc"], "ci_low": v["model_ci"][0],
                                 "ci_high": v["model_ci"][1]}, signed=False), False),
             (_cell({"mean_change": v["margin"], "ci_low": v["margin_ci"][0], "ci_high": v["margin_ci"][1]}),
              v.get("beats_metadata") is False)]
            for n, v in (md.get("margins") or {}).items()]
    body.append(_table(["model", "AUC [95% CI]", "margin model − metadata [95% CI]"], rows))
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
            row.append(("not applicable (square images)" if v.get("applicable") is False else _cell(v),
                        bool(v.get("flagged"))))
        rows.append(row)
    return [f"<p><b>Perturbation probes</b> on a fixed class-balanced subsample of {pr.get('n_images')} images: "
            f"mean change of p(PNEUMONIA) [95% CI] (Δp(NORMAL) = −Δp). flip: horizontal mirror; shift: "
            f"{100 * SHIFT_FRACTION:.0f}% along both axes with a black (zero) border; contrast: gamma {GAMMA}; "
            f"aspect: centred square crop against the model's own squaring. Red: beyond the tolerance "
            f"±{TOLERANCE} with a CI excluding 0.</p>",
            _table(["model", "flip", "shift / border", "contrast", "aspect"], rows)]


def _saliency_html(sa: dict, ext_dir: Path) -> list[str]:
    if not sa.get("models"):
        return []
    body = [f"<p><b>Saliency</b> (Grad-CAM, {sa.get('n_images')} fixed images per model): share of the saliency "
            f"in the outer {100 * sa.get('band', 0.1):.0f}% border band, mean [95% CI]; a uniform map gives "
            f"{sa.get('uniform_share', 0):.2f}. This number is crude: Grad-CAM maps are coarse, and a high share "
            "is a hint to look at the montage, not a finding.</p>",
            _table(["model", "border share"], [[(n, False), (_cell(v.get("border_share"), "mean", signed=False),
                                                            False)] for n, v in sa["models"].items()])]
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
        body.append(_table(["site", "T", "val. sensitivity", "val. specificity", "test sensitivity",
                            "test specificity"], [[(str(c), False) for c in r] for r in rows]))
    return body


def _operating_point_html(op: dict) -> list[str]:
    fed = op.get("federated") or {}
    if not op.get("models"):
        return ([f"<p class='warn'><b>Clinical operating point: the federation set no threshold: "
                 f"{esc(str(fed['unresolved']))}</b></p>"] if fed.get("unresolved") else [])
    own = fed.get("site_sensitivity") or {}

    def num(v):
        return (_cell({"mean_change": v}, signed=False), False)

    rows = [[(n, False), (f"{v['temperature']:.2f}", False), (f"{v['threshold']:.3f}", False),
             (_cell(v.get("sensitivity"), "value", signed=False),
              ((v.get("sensitivity") or {}).get("value") or 0) < 0.9),
             (_cell(v.get("specificity"), "value", signed=False), False), num(v.get("ece_before")),
             num(v.get("ece_after")), num((own.get(n.rpartition("_")[0]) or {}).get("sensitivity"))]
            for n, v in op["models"].items()]
    return ["<p><b>Clinical operating point</b>: each deployed model's temperature (fit on its site's validation "
            "split) and the one federated threshold on calibrated p(PNEUMONIA) chosen for a target sensitivity of "
            f"{fed.get('target', '–')} on the sites' pooled coarse validation histograms (pooled validation "
            f"sensitivity, a lower bound: {num(fed.get('sensitivity'))[0]}). Red: sensitivity under 0.90 on these "
            "images. The last column is each site's own validation sensitivity at the threshold.</p>",
            _table(["model", "T", "threshold", "sensitivity [95% CI]", "specificity [95% CI]", "ECE before",
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
    from nvflare_jobs.report import read_json

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
