"""Cross-site evaluation at a site: score model files sent by the server on this site's own test split.

Each model is rebuilt from its spec and weights, run at **this site's** input size on this site's device (its
GPU when the config says so), and only its test metrics (accuracy, balanced accuracy, AUC, confusion matrix, ...)
go back. A model whose label scheme differs from the site's is not scored: its entry says why, naming the site.
Task ``cross_eval``; its payload is the server's ``{"<i>/<param>": array}`` and ``meta["models"]`` =
``[{"name", "spec", "labels", "sha256"}, ...]`` (``hfl_components.flare.controllers.crosssite``).
"""
from __future__ import annotations

import logging

log = logging.getLogger("cxr_hfl.site")


def model_states(params: dict, n_models: int) -> list[dict]:
    """Split ``{"<i>/<param>": array}`` into one ``{param: tensor}`` per model, in order."""
    import torch

    out: list[dict] = [{} for _ in range(n_models)]
    for key, v in params.items():
        i, _, name = str(key).partition("/")
        if i.isdigit() and int(i) < n_models:
            out[int(i)][name] = torch.as_tensor(v)
    return out


def score_models(rt, models: list[dict], states: list[dict]) -> dict:
    """``{model name: test metrics}`` of each model on the site runtime ``rt``'s test split, or
    ``{model name: {"refused": reason}}`` for a model of another label scheme."""
    out = {}
    for m, state in zip(models, states):
        if m.get("labels") and m["labels"] != rt.labels:
            out[m["name"]] = {"refused": f"site {rt.site} uses labels {rt.labels!r}; model {m['name']} was trained "
                                         f"for {m['labels']!r}"}
            log.info("site %s: model %s refused: %s", rt.site, m["name"], out[m["name"]]["refused"])
            continue
        rt.set_model(m["spec"], state)
        out[m["name"]] = res = rt.evaluate("test")
        log.info("site %s: model %s on the test split (n=%s): balanced accuracy %s, AUC %s", rt.site, m["name"],
                 res.get("n"), _f(res.get("balanced_accuracy")), _f(res.get("auc")))
    return out


def _f(v) -> str:
    return f"{v:.4f}" if isinstance(v, (int, float)) else "-"


def cross_eval(rt, params, meta):
    """The ``cross_eval`` task handler (resolved by :func:`hfl_components.flare.dispatch.handler`)."""
    models = list(meta.get("models") or [])
    scores = score_models(rt, models, model_states(params or {}, len(models)))
    return {}, {"cross_site": scores}, {"status": "ok", "n_train": rt.n_train(),
                                        "input_size": int(rt.cfg["input_size"]), "labels": rt.labels}
