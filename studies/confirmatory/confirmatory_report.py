"""``RESULT.md`` of a confirmatory run (``python -m studies.confirmatory.confirmatory analyse``): the primary endpoint's
row, the secondary paired rows and the per-seed summaries with their seed-level t-intervals. Not a script of its own;
:mod:`studies.confirmatory.confirmatory` calls :func:`markdown`."""
from __future__ import annotations

from hfl_components.stats import paired_cell, verdict_cell


def _ci(d: dict, nd: int = 3, share: bool = False) -> str:
    """A per-seed summary's cell: mean, seed-level 95% t-interval (``share``: clipped to [0, 1], the range of a
    share; the record keeps the unclipped interval) and the per-seed values."""
    if not d or d.get("mean") is None:
        return "–"
    per = " / ".join(f"{v:.{nd}f}" for v in d["per_seed"].values())
    if d.get("reliable") and d.get("ci_low") is not None:
        lo, hi = (max(0.0, d["ci_low"]), min(1.0, d["ci_high"])) if share else (d["ci_low"], d["ci_high"])
        return f"{d['mean']:.{nd}f} (95% CI {lo:.{nd}f} to {hi:.{nd}f}); per seed {per}"
    return f"{d['mean']:.{nd}f}; per seed {per} ({d['n_seeds']} seed(s): no reliable interval)"


#: the row label's note on a share's interval (:func:`_ci` with ``share``)
CLIPPED = " (95% CI clipped to [0, 1])"


def _corrected_row(c: dict | None) -> list[str]:
    """The primary endpoint's row at the α plan's level, or nothing: a legacy plan's Bonferroni-corrected row
    (``looks``), or the level a plan's procedure gives the primary."""
    if not c:
        return []
    what = (f"corrected for {c['looks']} tests of this hypothesis (Bonferroni, alpha {c['alpha']:g})" if c.get("looks")
            else f"at the α plan's level ({c.get('procedure')} procedure, alpha {c['alpha']:g}; its hypothesis: "
                 f"{c.get('hypothesis')}" + (", rejected only if better" if c.get("hypothesis") == "superiority" else "")
                 + ")")
    return [f"| the same, {what} | {c['a']:.3f} | {c['b']:.3f} | {paired_cell(c)} | {verdict_cell(c)} |"]


def _deciding(c: dict | None) -> str:
    """Which lower bound gives the primary verdict: the corrected row's, with its level, when the table holds two
    intervals; else the one interval's (the wording of the protocols analysed before the corrected row existed, so
    that their ``RESULT.md`` is rewritten byte for byte)."""
    if not c:
        return "the interval's lower bound"
    if not c.get("looks"):
        return f"the lower bound of the plan-level row's {100 * (1 - float(c.get('alpha') or 0.05)):g}% interval"
    return f"the lower bound of the corrected row's {100 * (1 - float(c.get('alpha') or 0.05)):g}% interval"


def _row_name(r: dict) -> str:
    return "corrected row" if (r.get("primary_corrected") or {}).get("looks") else "plan-level row"


def markdown(r: dict) -> str:
    """``RESULT.md`` from :func:`analyse`'s record."""
    L = ["# Confirmatory run: result", "",
         f"Data: `{r['data']}`, part `{r['part']}`, {'/'.join(map(str, r['n_images'] or []))} images; seeds "
         f"{', '.join(map(str, r['seeds'] or []))}. Protocol: [PROTOCOL.md](PROTOCOL.md). Paired differences: "
         "crossed cluster bootstrap-t (seeds resampled, one image draw per replicate shared by every seed and site); "
         "per-seed summaries: seed-level t-interval (df = seeds - 1).", "", "## Primary endpoint", ""]
    p = r["primary"]
    if p:
        L += ["| comparison | A | B | A - B | verdict |", "|---|---|---|---|---|",
              f"| {p['comparison']}, AUC, deployed models | {p['a']:.3f} | {p['b']:.3f} | {paired_cell(p)} | "
              f"{verdict_cell(p) if not r.get('primary_corrected') else 'none: the ' + _row_name(r) + ' decides'} |",
              *_corrected_row(r.get("primary_corrected")), "",
              f"Non-inferiority margin δ = {p.get('margin')} AUC: not worse when "
              f"{_deciding(r.get('primary_corrected'))} is above -δ; better when it is above 0."]
    else:
        L.append("No primary comparison could be formed (a method's runs or evaluations are missing).")
    plan = r.get("plan")
    L += ["", "## Secondary endpoints (exploratory: verdicts not corrected for multiplicity)" if not plan else
          f"## Other rows (described: a verdict only for a test of the α plan, `{plan['file']}`; the later tests' "
          "levels follow its sequence)", "",
          "| comparison | metric | A | B | A - B | verdict |", "|---|---|---|---|---|---|"]
    for q in r["paired"]:
        for metric in ("auc", "balanced_accuracy"):
            if q.get("primary") == metric:
                continue
            d = q[metric]
            L.append(f"| {q['comparison']} | {metric} | {d['a']:.3f} | {d['b']:.3f} | {paired_cell(d)} | "
                     f"{verdict_cell(d)} |")
    s = r["secondary"]
    L += ["", "OHFL runs, per-seed summaries:", "", "| endpoint | value |", "|---|---|",
          f"| global model's AUC gap to the site ensemble (ensemble - global; target <= 0.02) | {_ci(s['gap_global'])} |",
          f"| fused model (before distillation), AUC gap to the ensemble | {_ci(s['gap_fused'])} |",
          f"| border (6 % shift) probe, deployed models, change of p(NORMAL) (tolerance ±0.05) | "
          f"{_ci(s['border_dp_normal'])} |",
          f"| share of deployed models flagged by the border probe{CLIPPED} | {_ci(s['border_flagged'], 2, True)} |",
          f"| metadata baseline AUC (file facts only) | {_ci(s['metadata_auc'])} |",
          f"| deployed models' AUC margin over the metadata baseline | {_ci(s['metadata_margin'])} |",
          f"| share of deployed models whose margin CI covers 0{CLIPPED} | {_ci(s['margin_covers_zero'], 2, True)} |",
          f"| federated threshold (calibrated p(PNEUMONIA)) | {_ci(s['fed_threshold'])} |",
          "| sensitivity at the federated threshold, pooled over the evaluation images and the deployed models "
          f"(target 0.95, floor 0.90) | {_ci(s.get('eval_sensitivity'))} |",
          f"| specificity at it, pooled the same way | {_ci(s.get('eval_specificity'))} |",
          f"| the lowest site's sensitivity on the evaluation images | {_ci(s.get('eval_min_sensitivity'))} |",
          "| for reference: sensitivity on the sites' pooled validation histograms, where the threshold is chosen | "
          f"{_ci(s['fed_sensitivity'])} |",
          f"| for reference: specificity on the pooled validation histograms | {_ci(s['fed_specificity'])} |",
          f"| for reference: each site's own validation sensitivity (mean over sites) | {_ci(s['site_sensitivity'])} |",
          "| for reference: sensitivity pooled over the sites' own test splits | "
          f"{_ci(s.get('test_sensitivity'))} |",
          f"| share of sites whose gate adopted the federated model{CLIPPED} | {_ci(s['adopted'], 2, True)} |"]
    sl = r.get("secondary_local") or {}
    if sl:
        L += ["", "Local+ft control, the same audit: border probe change of p(NORMAL) "
              f"{_ci(sl.get('border_dp_normal'))}; AUC margin over the metadata baseline "
              f"{_ci(sl.get('metadata_margin'))}."]
    L += ["", "\"Deployed vs its own pre-fusion local models\" holds partly by construction: the gate keeps the local "
          "model where the federated one is not better on the site's validation split, so at those sites the "
          "difference is 0; it is reported as a secondary row only."]
    L += _sequence_rows(r.get("sequence"))
    return "\n".join(L) + "\n"


def _sequence_rows(seq: list[dict] | None) -> list[str]:
    """The α plan's tests in their order (fallback procedure), each at its level: the estimate, the two-sided
    interval at that level and whether the test showed its hypothesis. Nothing for a plan without a sequence."""
    if not seq:
        return []

    def num(v):
        return "–" if v is None else f"{v:+.3f}"

    L = ["", "## The α plan's tests, in order (fallback procedure)", "",
         "| order | test | hypothesis | level | estimate | interval at the level | shown |", "|---|---|---|---|---|---|---|"]
    for i, t in enumerate(seq, 1):
        iv = "no reliable interval" if t.get("ci_low") is None else f"{num(t['ci_low'])} to {num(t['ci_high'])}"
        L.append(f"| {i} | {t['id']} | {t['hypothesis']} | {t['level']:.6g} | {num(t.get('estimate'))} | {iv} | "
                 f"{'yes' if t['succeeded'] else 'no'} |")
    return L
