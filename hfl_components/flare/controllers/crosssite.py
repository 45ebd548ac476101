"""Cross-site evaluation of model files as a job: every site scores every model on its own test split.

The server reads the model files (``hfl_components.models.save_model_file`` format; a path relative to the server
app folder, where ``cxr-hfl export-eval`` puts them, or absolute), sends their weights and specs to every site in
one ``cross_eval`` task, and writes the sites x models matrix into its results folder: ``cross_site.json`` (every
metric, and each refusal with its reason), ``cross_site.csv`` (one row per site and model) and
``cross_site.png`` (a heat map of balanced accuracy). Only metrics come back from the sites.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

from hfl_components.flare.controllers.base import HFLController, jsonable

MATRIX_METRICS = ("accuracy", "balanced_accuracy", "auc", "sensitivity", "specificity", "n")


class CrossSiteEvalController(HFLController):
    """Score model files at every site.

    Args:
        models (list): ``[{"name": str, "file": path, "sha256": hex (optional)}, ...]``; names unique; a relative
            file is looked up in the server app folder (``<app>/models/...``); a file whose SHA-256 differs from
            its entry's is refused at job start. Other keys (``run``, ``kind``, ``site``, ``method``, ``seed``: the
            file's ``models.json`` entry) are recorded with the results.
        min_sites, task_timeout, seed, late_wait_s: as :class:`HFLController` (one round).
    """

    method = "cross_site"

    def __init__(self, models: list, min_sites: int = 1, task_timeout: int = 0, seed: int = 0,
                 late_wait_s: int | None = None):
        super().__init__(1, min_sites, None, task_timeout, seed, late_wait_s)
        self.models = [dict(m) for m in (models or [])]

    def check_options(self) -> dict:
        """At least one model, each with a name and a file, names unique. Raises ValueError naming the model."""
        if not self.models:
            raise ValueError("cross_site: no model files to evaluate")
        names = [m.get("name") for m in self.models]
        for m in self.models:
            if not m.get("name") or not m.get("file"):
                raise ValueError(f"cross_site: model entry {m} needs a name and a file")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"cross_site: model names must be unique, {dup} repeat")
        if self.min_sites < 1:
            raise ValueError(f"cross_site: min_sites must be at least 1, got {self.min_sites}")
        return {"models": self.models}

    def use_checked_options(self, checked: dict) -> None:
        pass

    def _file(self, m: dict) -> Path:
        p = Path(m["file"])
        if not p.is_absolute():
            try:
                ws = self.engine.get_workspace()
                p = Path(ws.get_app_dir(self.fl_ctx.get_job_id())) / p
            except Exception:  # noqa: BLE001 - outside a job (unit tests): relative to the working folder
                pass
        return p

    def check_server_inputs(self) -> None:
        """Every model file exists on the server, has its entry's SHA-256 (when the entry gives one) and is a
        readable model file (header and weights). Raises FileNotFoundError / ValueError naming the model."""
        from hfl_components.models.files import file_sha256, load_model_file

        for m in self.models:
            p = self._file(m)
            if not p.is_file():
                raise FileNotFoundError(f"cross_site: model {m['name']}: {p} does not exist on the server")
            if m.get("sha256") and file_sha256(p) != m["sha256"]:
                raise ValueError(f"cross_site: model {m['name']}: {p} refused: its SHA-256 differs from the one "
                                 "recorded when the job was exported")
            load_model_file(p)

    def run_method(self):
        from hfl_components.flare.messages import to_numpy_state
        from hfl_components.models.files import file_sha256, load_model_file

        params, sent = {}, []
        for i, m in enumerate(self.models):
            p = self._file(m)
            model, header = load_model_file(p)
            for k, v in to_numpy_state(model.state_dict()).items():
                params[f"{i}/{k}"] = v
            sent.append({"name": m["name"], "spec": header["spec"], "labels": header.get("labels"),
                         "sha256": file_sha256(p), "input_size": header.get("input_size"),
                         "site": header.get("site"), "kind": header.get("kind"),
                         **{k: m[k] for k in ("run", "method", "seed") if m.get(k) is not None}})
        self.record["models"] = sent
        res = self.broadcast("cross_eval", 0, params, {"models": [{k: s[k] for k in ("name", "spec", "labels",
                                                                                      "sha256")} for s in sent]})
        matrix = {site: dict((r.metrics or {}).get("cross_site") or {}) for site, r in res.items()}
        self.record["cross_site"] = jsonable(matrix)
        self.record["site_input_sizes"] = {s: (r.meta or {}).get("input_size") for s, r in res.items()}
        write_matrix(self.results_dir(), matrix, [s["name"] for s in sent], self.record["site_input_sizes"],
                     self.record.get("excluded") or {})


def write_matrix(out_dir: Path, matrix: dict, names: list[str], sizes: dict | None = None,
                 excluded: dict | None = None) -> dict:
    """Write ``cross_site.json`` / ``.csv`` / ``.png`` (sites x models) into ``out_dir``; returns the paths.

    ``matrix``: ``{site: {model: metrics | {"refused": reason}}}``; ``excluded``: sites left out (their reasons)."""
    out_dir = Path(out_dir)
    doc = {"models": names, "sites": sorted(matrix), "input_size": dict(sizes or {}), "matrix": jsonable(matrix),
           "excluded": jsonable(excluded or {})}
    (out_dir / "cross_site.json").write_text(json.dumps(doc, indent=1))
    with (out_dir / "cross_site.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["site", "model", *MATRIX_METRICS, "refused"])
        for site in sorted(matrix):
            for name in names:
                m = matrix[site].get(name) or {}
                w.writerow([site, name, *["" if m.get(k) is None else m[k] for k in MATRIX_METRICS],
                            m.get("refused", "")])
    paths = {"json": out_dir / "cross_site.json", "csv": out_dir / "cross_site.csv"}
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np

        sites = sorted(matrix)
        vals = np.array([[(matrix[s].get(n) or {}).get("balanced_accuracy", np.nan) for n in names] for s in sites],
                        dtype=float)
        fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(names), 1.2 + 0.5 * len(sites)))
        im = ax.imshow(vals, vmin=0, vmax=1, cmap="viridis")
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.set_yticks(range(len(sites)), sites)
        for i in range(len(sites)):
            for j in range(len(names)):
                ax.text(j, i, "refused" if np.isnan(vals[i, j]) else f"{vals[i, j]:.2f}", ha="center",
                        va="center", color="w", fontsize=8)
        fig.colorbar(im, ax=ax, label="balanced accuracy (site test split)")
        ax.set_title("cross-site evaluation")
        fig.tight_layout()
        fig.savefig(out_dir / "cross_site.png", dpi=110)
        plt.close(fig)
        paths["png"] = out_dir / "cross_site.png"
    except Exception:  # noqa: BLE001 - the figure is a convenience; JSON/CSV hold the results
        pass
    return paths
