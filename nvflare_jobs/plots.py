"""PNG plots of a run (matplotlib, headless)."""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.ticker  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _save(fig, path: Path) -> Path:
    """Lay out, write as a 110-dpi PNG and close a figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def site_accuracy_bars(out: Path, metrics: dict) -> Path:
    sites = list(metrics["sites"])
    acc = [((metrics["sites"][s].get("test") or {}).get("accuracy") or 0.0) * 100 for s in sites]
    fig, ax = plt.subplots(figsize=(max(4, 1.1 * len(sites)), 3.5))
    ax.bar(sites, acc, color="tab:blue", label="deployed model")
    local = [((metrics["sites"][s].get("local") or {}).get("accuracy")) for s in sites]
    if any(v is not None for v in local):
        ax.scatter(sites, [100 * (v or 0) for v in local], color="tab:orange", zorder=3, label="local model (before fusion)")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"{metrics['method']}: per-site test accuracy")
    for i, v in enumerate(acc):
        ax.text(i, v + 1, f"{v:.1f}", ha="center", fontsize=8)
    p = _save(fig, out / "site_accuracy.png")
    return p


def round_curves(out: Path, metrics: dict) -> Path | None:
    rounds = [r for r in metrics.get("rounds", []) if r["task"] != "evaluate" and r["val_accuracy"]]
    if len(rounds) < 2:
        return None
    sites = sorted({s for r in rounds for s in r["val_accuracy"]})
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for s in sites:
        xs = [r["round"] for r in rounds if r["val_accuracy"].get(s) is not None]
        ys = [100 * r["val_accuracy"][s] for r in rounds if r["val_accuracy"].get(s) is not None]
        ax.plot(xs, ys, marker="o", label=s)
    ax.set_xlabel("round")
    ax.set_ylabel("validation accuracy (%)")
    ax.legend(fontsize=7)
    ax.set_title(f"{metrics['method']}: validation accuracy per round")
    p = _save(fig, out / "round_curves.png")
    return p


def finetune_curves(out: Path, metrics: dict) -> Path | None:
    curves = {s: b.get("finetune_loss") for s, b in metrics["sites"].items() if b.get("finetune_loss")}
    if not curves:
        return None
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for s, c in curves.items():
        ax.plot(range(1, len(c) + 1), c, marker=".", label=s)
    ax.set_xlabel("fine-tuning epoch")
    ax.set_ylabel("training loss")
    ax.legend(fontsize=7)
    ax.set_title("OHFL: fine-tuning the global model at each site")
    p = _save(fig, out / "finetune_loss.png")
    return p


def cka_heatmaps(out: Path) -> list[Path]:
    """One heatmap per pairwise fusion: the CKA cost matrix with the chosen layer map drawn on it."""
    rec_path = out / "alignment_record.json"
    if not rec_path.is_file():
        return []
    rec = json.loads(rec_path.read_text())
    paths = []
    for i, pair in enumerate(rec.get("pairs", [])):
        cost = pair.get("cost")
        if not cost:
            continue
        cost = np.asarray(cost, dtype=float)
        fig, ax = plt.subplots(figsize=(1 + 0.5 * cost.shape[1], 1 + 0.5 * cost.shape[0]))
        im = ax.imshow(cost, cmap="viridis", vmin=0, vmax=1)
        lm = pair.get("layer_map") or []
        if lm:
            ys, xs = zip(*[(a, b) for a, b in lm])
            ax.plot(xs, ys, "r-o", ms=4, lw=1)
        ax.set_xlabel(f"target hidden layer ({pair.get('tgt', '')})", fontsize=8)
        ax.set_ylabel(f"source hidden layer ({pair.get('src', '')})", fontsize=8)
        ax.set_title(f"1 - CKA, fusion step {i + 1}", fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.05)
        p = _save(fig, out / f"cka_cost_step{i + 1}.png")
        paths.append(p)
    return paths


def topology_heatmaps(out: Path, metrics: dict, class_names: list[str]) -> list[Path]:
    paths = []
    for key, title in (("R_global", "global relation topology R^g"), ("S_global", "reliability S^g")):
        m = metrics.get(key)
        if m is None:
            continue
        m = np.asarray(m, dtype=float)
        fig, ax = plt.subplots(figsize=(3.8, 3.2))
        im = ax.imshow(m, cmap="magma", vmin=0, vmax=1)
        ax.set_xticks(range(len(class_names)), class_names, rotation=45, fontsize=7)
        ax.set_yticks(range(len(class_names)), class_names, fontsize=7)
        for i in range(m.shape[0]):
            for j in range(m.shape[1]):
                ax.text(j, i, f"{m[i, j]:.2f}", ha="center", va="center", color="w" if m[i, j] < 0.6 else "k", fontsize=7)
        ax.set_title(title, fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.05)
        p = _save(fig, out / f"{key}.png")
        paths.append(p)
    return paths


def effective_rank_curve(out: Path, metrics: dict) -> Path | None:
    er = metrics.get("effective_rank")
    if not er:
        return None
    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    ax.plot(range(len(er)), [np.nan if v is None else v for v in er], marker="o")
    ax.set_xlabel("round")
    ax.set_ylabel("effective rank of site prototypes")
    ax.set_title("FedSAF: prototype effective dimensionality (Fig. 1)", fontsize=9)
    p = _save(fig, out / "effective_rank.png")
    return p


def payload_per_round(out: Path, metrics: dict) -> Path | None:
    """FedSAF/FedTopo: bytes up and down per site and round (bars) with the theoretical payload (dashed)."""
    rows = (metrics.get("payload") or {}).get("per_round") or []
    if not rows:
        return None
    xs = np.arange(len(rows))
    up = [np.mean(list(r["up_per_site"].values())) if r["up_per_site"] else 0 for r in rows]
    down = [r["down_per_site"] for r in rows]
    fig, ax = plt.subplots(figsize=(max(4.5, 0.6 * len(rows) + 2), 3.4))
    ax.bar(xs - 0.2, up, 0.4, label="up per site (mean)")
    ax.bar(xs + 0.2, down, 0.4, label="down per site")
    ax.plot(xs - 0.2, [r["theory_up_per_site"] for r in rows], "k_", ms=18, mew=2, label="theory")
    ax.plot(xs + 0.2, [r["theory_down_per_site"] for r in rows], "k_", ms=18, mew=2)
    ax.set_xticks(xs, [str(r["round"]) for r in rows])
    ax.set_xlabel("round")
    ax.set_ylabel("bytes (float32)")
    ax.legend(fontsize=7)
    ax.set_title(f"{metrics['method']}: communication per site and round", fontsize=9)
    p = _save(fig, out / "payload_per_round.png")
    return p


def topology_diagnostic_curves(out: Path, metrics: dict) -> Path | None:
    """FedTopo: per-site topology inconsistency D^r (solid) and reliability-weighted D^rs (dashed) per round."""
    rounds = [r for r in metrics.get("rounds", []) if r.get("diagnostics")]
    if not rounds:
        return None
    sites = sorted({s for r in rounds for s in r["diagnostics"]})
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for i, s in enumerate(sites):
        for key, ls in (("D_r", "-"), ("D_rs", "--")):
            pts = [(r["round"], r["diagnostics"].get(s, {}).get(key)) for r in rounds]
            pts = [(x, y) for x, y in pts if y is not None]
            if pts:
                ax.plot(*zip(*pts), ls, marker="o", color=f"C{i}", label=f"{s} {key}")
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_ylabel("topology inconsistency")
    ax.legend(fontsize=6, ncol=2)
    ax.set_title("FedTopo: D^r (Eq. 25) and D^rs (Eq. 26) per site", fontsize=9)
    p = _save(fig, out / "topology_diagnostics.png")
    return p


def make_all(out: Path, metrics: dict, rec: dict, class_names: list[str]) -> list[Path]:
    out = Path(out)
    made = [site_accuracy_bars(out, metrics), round_curves(out, metrics), finetune_curves(out, metrics),
            effective_rank_curve(out, metrics), *cka_heatmaps(out), *topology_heatmaps(out, metrics, class_names),
            payload_per_round(out, metrics), topology_diagnostic_curves(out, metrics)]
    return [p for p in made if p]


def reliability_diagram(out_png: Path, curves: dict[str, dict], title: str = "calibration") -> Path:
    """A reliability diagram as a PNG: for each curve (``{label: hfl_components.operating_point.reliability_bins(...)}``,
    e.g. one per site, or before / after calibration) the observed share of PNEUMONIA against the mean predicted
    p(PNEUMONIA) per bin, with the bins' Wilson 95 % intervals as error bars and the ECE in the legend; the diagonal
    is perfect calibration. Bins and counts only, no image's score."""
    fig, ax = plt.subplots(figsize=(4.2, 4.2))
    ax.plot([0, 1], [0, 1], color="0.6", lw=1, ls="--", label="perfectly calibrated")
    for label, b in curves.items():
        if not b or not b.get("count"):
            continue
        x, yv = np.asarray(b["mean_predicted"]), np.asarray(b["observed"])
        err = np.vstack([yv - np.asarray(b["ci_low"]), np.asarray(b["ci_high"]) - yv])
        ece = b.get("ece")
        name = f"{label} (ECE {ece:.3f}, n = {b.get('n')})" if ece is not None else label
        ax.errorbar(x, yv, yerr=err, marker="o", ms=4, capsize=2, lw=1, label=name)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("mean predicted p(PNEUMONIA) in bin")
    ax.set_ylabel("observed share of PNEUMONIA in bin")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", fontsize=7)
    return _save(fig, Path(out_png))
