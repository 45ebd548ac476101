"""``cxr-hfl site privacy-audit``: a site measures, on its own machine and its own images, how much the models it
sent (or received) reveal about which images it trained on. Nothing is sent anywhere; results go to a folder.

For every model file (its upload, the global model it received, FENS's peers' models or ensemble):

* the loss-threshold attack (Yeom et al. 2018) with the site's training split as members and its test split as
  non-members: attack AUC and TPR at 1 % FPR with bootstrap intervals
  (:func:`hfl_components.privacy.loss_threshold_attack`);
* optionally (``shadows > 0`` and a public ``probe`` pool) the offline LiRA attack (Carlini et al. 2022) with
  shadow models of the same architecture trained on random halves of the public pool
  (:func:`hfl_components.privacy.lira_offline`).

Optionally (``canary_epochs > 0``) one audit run (Steinke, Nasr & Jagielski 2023): a fresh model of the first
file's architecture is trained at the site on a random half of its training images (each included with
probability 1/2, under the site config's ``dp`` when it has one); the number of correct membership guesses gives an
empirical epsilon lower bound at 95 % confidence, written beside the accountant's epsilon of that run.

Outputs in ``out``: ``privacy_audit.json`` (everything, ROC points included), ``privacy_audit.csv`` (one row per
model and attack) and ``privacy_audit_roc.png`` (ROC curves on log axes, where the low-FPR regime shows).

Membership here is the site's training split (after ``max_train_images``); a FENS site model did not train on its
site's hold-out, so its AUC is a slight underestimate. Images are the site's eval-mode images at each model's input
size (no augmentation).
"""
from __future__ import annotations

import csv
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

CSV_COLUMNS = ("model", "attack", "auc", "auc_low", "auc_high", "tpr_at_fpr", "tpr_low", "tpr_high", "fpr",
               "n_members", "n_nonmembers", "dp_epsilon", "note")


def _split_tensors(rt, split: str, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(images (N, C, S, S), labels (N,)) of a split of the site at side ``size``, eval mode (no augmentation)."""
    from hfl_components.training import unpack_batch

    xs, ys = [], []
    for batch in rt.loader(split, input_size=size, train_mode=False):
        x, y = unpack_batch(batch)
        xs.append(x)
        ys.append(y)
    return torch.cat(xs), torch.cat(ys)


def load_public_pool(source: str | Path, labels: str, size: int, aspect: str | None = None,
                     limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Labelled public images for shadow models: the committed ``probe`` part of a ``chest_xray_224`` root (labels
    from its file list), or a manifest CSV with ``path,label,split`` columns (e.g. a partition's ``probe.csv``; every
    row used).

    Returns:
        images (P, 1, S, S) float32, labels (P,) int64.

    Raises:
        FileNotFoundError: no such folder / file. ValueError: neither form, or fewer than 2 images.
    """
    from chest_xray import DEFAULT_ASPECT, class_names, make_site_dataset, read_site_manifest
    from hfl_components.training import unpack_batch

    p = Path(source)
    if not p.exists():
        raise FileNotFoundError(f"--probe {source}: no such folder or file")
    if p.is_dir() and p.name == "chest_xray_224":
        from chest_xray.splits import split_rows

        names = class_names(labels)
        col = "subtype" if labels == "subtype" else "label"
        rows = [{"path": str((p / r["path"]).resolve()), "label": names.index(r[col].upper())}
                for r in split_rows("probe")]
    elif p.is_file() and p.suffix.lower() == ".csv":
        rows = read_site_manifest(p)
    else:
        raise ValueError(f"--probe {source}: give the chest_xray_224 root (its public probe part) or a manifest CSV "
                         "with path,label,split columns (a partition's probe.csv)")
    rows = rows[: int(limit)] if limit else rows
    if len(rows) < 2:
        raise ValueError(f"--probe {source}: needs at least 2 labelled images, has {len(rows)}")
    ds = make_site_dataset(rows, int(size), "eval", augment_classes=[], aspect=aspect or DEFAULT_ASPECT)
    loader = torch.utils.data.DataLoader(ds, batch_size=64)
    xs, ys = zip(*(unpack_batch(b) for b in loader))
    return torch.cat(xs), torch.cat(ys)


def _dp_epsilon(header: dict):
    """The accountant's epsilon a model file's provenance records (``provenance.dp.epsilon``), else None."""
    dp = (header.get("provenance") or {}).get("dp")
    return dp.get("epsilon") if isinstance(dp, dict) else None


def _attack_model(model, header, members, nonmembers, fpr, n_boot, seed) -> dict:
    from hfl_components.privacy import loss_threshold_attack, model_logits, per_example_losses

    (xi, yi), (xo, yo) = members, nonmembers
    lin = per_example_losses(model_logits(model, xi), yi)
    lout = per_example_losses(model_logits(model, xo), yo)
    return loss_threshold_attack(lin, lout, fpr=fpr, n_boot=n_boot, seed=seed)


def _lira(model, spec, members, nonmembers, pool, shadows, epochs, cfg, fpr, n_boot, seed) -> dict:
    from hfl_components.models import build_model
    from hfl_components.privacy import (attack_metrics, lira_offline, logit_confidence, model_logits, roc_points,
                                        train_shadow_models)

    (xi, yi), (xo, yo) = members, nonmembers
    x, y = torch.cat([xi, xo]), torch.cat([yi, yo])
    target = logit_confidence(model_logits(model, x), y)
    shadow_models = train_shadow_models(lambda: build_model(spec), pool[0], pool[1], shadows, epochs,
                                        batch_size=int(cfg["batch_size"]), lr=float(cfg["lr"]), seed=seed,
                                        train_kw={"momentum": float(cfg["momentum"])})
    phi = np.stack([logit_confidence(model_logits(s, x), y) for s in shadow_models])
    scores = lira_offline(target, phi)
    a, b = scores[: len(yi)], scores[len(yi):]
    return {"attack": "lira_offline", **attack_metrics(a, b, fpr=fpr, n_boot=n_boot, seed=seed),
            "roc": roc_points(a, b), "shadows": int(shadows), "shadow_epochs": int(epochs),
            "pool_images": int(pool[0].shape[0])}


def _canary_run(rt, cfg, spec, size, epochs, dp_spec, seed) -> dict:
    """Steinke et al.'s one-run audit with the site's training images as canaries (see the module docstring)."""
    from hfl_components.models import build_model
    from hfl_components.privacy import (DPSession, canary_inclusion, check_budget, default_delta, default_guesses,
                                        model_logits, one_run_audit, per_example_losses)
    from hfl_components.training import train_local

    x, y = _split_tensors(rt, "train", size)
    inc = canary_inclusion(len(y), seed)
    idx = torch.as_tensor(np.flatnonzero(inc))
    g = torch.Generator().manual_seed(int(seed))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[idx], y[idx]),
                                         batch_size=int(cfg["batch_size"]), shuffle=True, generator=g)
    session, delta = None, default_delta(len(idx))
    if dp_spec is not None:
        session = DPSession(check_budget(len(idx), int(cfg["batch_size"]), epochs, dp_spec, rt.site), seed=seed)
        delta = session.plan.delta
    torch.manual_seed(int(seed))
    model = build_model(spec)
    train_local(model, loader, int(epochs), lr=float(cfg["lr"]), momentum=float(cfg["momentum"]),
                class_weights=cfg.get("class_weights"), seed=int(seed), dp=session)
    scores = -per_example_losses(model_logits(model, x), y)
    k_pos, k_neg = default_guesses(len(y))
    res = one_run_audit(scores, inc, k_pos, k_neg, delta=delta)
    res.update({"epochs": int(epochs), "trained_on": int(len(idx)),
                "accountant_epsilon": session.record()["epsilon"] if session else None,
                "dp": session.record() if session else None})
    return res


def privacy_audit(site_config: str | Path, site: str, model_files: list[str | Path], out: str | Path, *,
                  probe: str | Path | None = None, shadows: int = 0, shadow_epochs: int = 10,
                  canary_epochs: int = 0, fpr: float = 0.01, n_boot: int = 1000, seed: int = 0, dp=None) -> dict:
    """Run the audit (module docstring) for one site and write ``privacy_audit.json`` / ``.csv`` / ``_roc.png``.

    Args:
        site_config: the site's ``<site>.yaml``; site: its name.
        model_files: model files to attack (``--model``, repeatable).
        out: folder for the results (created).
        probe: public labelled pool for LiRA's shadows (``shadows > 0`` needs it).
        shadows, shadow_epochs: LiRA's shadow models (0: no LiRA) and their training epochs.
        canary_epochs: epochs of the one-run canary audit (0: none).
        fpr: the FPR of the reported TPR; n_boot: bootstrap replicates; seed: every random choice.
        dp: a :class:`hfl_components.privacy.DPSpec` for the canary run (default: the site config's ``dp``).

    Returns:
        the JSON document written: ``{"site", "config", "members", "nonmembers", "models": [{"name", "file",
        "input_size", "dp_epsilon", "attacks": [...]} | {"name", "refused"}], "canary": {...} | None, ...}``.

    Raises:
        FileNotFoundError / ValueError: a model file, the config, the probe or the site's data, named.
    """
    from hfl_components.flare.site_config import load_site_config
    from hfl_components.flare.site_tasks import SiteRuntime
    from hfl_components.models.files import load_model_file
    from hfl_components.privacy import DPSpec
    from nvflare_jobs.crosssite import model_entries

    if int(shadows) > 0 and probe is None:
        raise ValueError("--shadows needs --probe: shadow models train on public images only")
    entries = model_entries(model_files)
    cfg = load_site_config(site, site_config)
    if dp is None and cfg.get("dp"):
        dp = DPSpec.from_config(cfg["dp"], site, cfg.get("config_path", str(site_config)))
    out = Path(out)
    doc: dict = {"site": site, "config": str(site_config), "members": "train split", "nonmembers": "test split",
                 "fpr": fpr, "n_boot": n_boot, "seed": seed, "sent": "nothing", "models": [], "canary": None}
    with tempfile.TemporaryDirectory(prefix="cxr_hfl_audit_") as work:
        rt = SiteRuntime(cfg, work)
        cache: dict = {}
        first_spec = None
        for e in entries:
            model, header = load_model_file(e["file"])
            if header.get("labels") and header["labels"] != cfg["data"]["labels"]:
                doc["models"].append({"name": e["name"], "file": e["file"],
                                      "refused": f"site {site} uses labels {cfg['data']['labels']!r}, the model "
                                                 f"{header['labels']!r}"})
                continue
            size = int(header.get("input_size") or cfg["input_size"])
            if size not in cache:
                cache[size] = (_split_tensors(rt, "train", size), _split_tensors(rt, "test", size))
            members, nonmembers = cache[size]
            entry = {"name": e["name"], "file": e["file"], "input_size": size, "spec": header["spec"],
                     "dp_epsilon": _dp_epsilon(header),
                     "attacks": [_attack_model(model, header, members, nonmembers, fpr, n_boot, seed)]}
            composite = header["spec"].get("family") == "fens"
            if int(shadows) > 0 and not composite:
                pool = load_public_pool(probe, cfg["data"]["labels"], size, cfg.get("aspect"))
                entry["attacks"].append(_lira(model, header["spec"], members, nonmembers, pool, int(shadows),
                                              int(shadow_epochs), cfg, fpr, n_boot, seed))
            elif int(shadows) > 0:
                entry["note"] = "LiRA not run: an ensemble has no single architecture to shadow"
            first_spec = first_spec or (None if composite else (header["spec"], size))
            doc["models"].append(entry)
        if int(canary_epochs) > 0 and first_spec is not None:
            doc["canary"] = _canary_run(rt, cfg, first_spec[0], first_spec[1], int(canary_epochs), dp, seed)
    _write(out, doc)
    return doc


def _write(out: Path, doc: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)  # only once the audit is done: a refused one leaves no folder
    (out / "privacy_audit.json").write_text(json.dumps(doc, indent=1, default=float))
    with (out / "privacy_audit.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(CSV_COLUMNS), lineterminator="\n")
        w.writeheader()
        for m in doc["models"]:
            if "refused" in m:
                w.writerow({"model": m["name"], "note": "refused: " + m["refused"]})
                continue
            for a in m["attacks"]:
                w.writerow({**{k: a.get(k) for k in CSV_COLUMNS if k in a}, "model": m["name"],
                            "attack": a["attack"], "dp_epsilon": m.get("dp_epsilon"), "note": m.get("note", "")})
    roc_plot(out / "privacy_audit_roc.png", doc)


def roc_plot(path: Path, doc: dict) -> Path:
    """ROC curves of every model and attack on log-log axes (FPR from 1/n_nonmembers), with the chance line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4.5))
    lo = 1.0
    for m in doc["models"]:
        for a in m.get("attacks", []):
            fpr, tpr = np.asarray(a["roc"]["fpr"]), np.asarray(a["roc"]["tpr"])
            lo = min(lo, a["fpr_resolution"])
            ax.plot(np.clip(fpr, a["fpr_resolution"] / 2, 1), np.clip(tpr, a["fpr_resolution"] / 2, 1),
                    label=f"{m['name']} {a['attack']} (AUC {a['auc']:.2f})")
    ax.plot([lo / 2, 1], [lo / 2, 1], "k:", lw=1, label="chance")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("false positive rate (non-members called members)")
    ax.set_ylabel("true positive rate (members found)")
    ax.set_title(f"site {doc['site']}: membership inference (nothing sent)", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
