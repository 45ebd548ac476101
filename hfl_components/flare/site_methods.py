"""Site-side task handlers, one per (method, task); no NVFlare imports.

Each handler has the signature ``handler(rt, params, meta) -> (params_out, metrics_out, meta_out)`` where ``rt``
is the site's :class:`~hfl_components.flare.site_tasks.SiteRuntime`, ``params`` the arrays the server sent and
``meta["task_config"]`` the method settings. The maths lives in ``hfl_components.{training,fusion,alignment,
topology}``; these functions only wire a site's data and model to it.
"""
from __future__ import annotations

import numpy as np
import torch

from hfl_components.flare.site_tasks import GLOBAL_PREFIX, SiteRuntime, from_numpy_state, to_numpy_state


def _epochs(rt: SiteRuntime, tc: dict, key: str, cfg_key: str) -> int:
    v = tc.get(key)
    return int(rt.cfg[cfg_key] if v is None else v)


def _val_acc(rt: SiteRuntime) -> float:
    return float(rt.evaluate("val")["accuracy"] or 0.0)


def _ok(rt, **meta):
    out = {"status": "ok", "n_train": rt.n_train(), "input_size": int(rt.cfg["input_size"])}
    out.update(meta)
    return out


# ---------------------------------------------------------------------------- Local / FedAvg
def local_train(rt, params, meta):
    tc = meta.get("task_config", {})
    hist = rt.train(_epochs(rt, tc, "local_epochs", "local_epochs"), float(rt.cfg["lr"]), tag=f"round {meta.get('round', 0)}", rnd=int(meta.get('round', 0)))
    rt.save_state(deployed=True)
    return {}, {"loss": [h["loss"] for h in hist], "val": rt.evaluate("val")}, _ok(rt, spec=rt.spec)


def fedavg_train(rt, params, meta):
    tc = meta.get("task_config", {})
    rt.set_model(meta["global_spec"], from_numpy_state(params, GLOBAL_PREFIX))
    hist = rt.train(_epochs(rt, tc, "local_epochs", "local_epochs"), float(rt.cfg["lr"]), tag=f"round {meta.get('round', 0)}", rnd=int(meta.get('round', 0)))
    rt.save_state()
    n = rt.n_train()
    # NVFlare's FedAvg convention: NUM_STEPS_CURRENT_ROUND carries the aggregation weight (trap 10).
    return to_numpy_state(rt.model.state_dict()), {"loss": [h["loss"] for h in hist]}, _ok(
        rt, NUM_STEPS_CURRENT_ROUND=n, spec=rt.spec)


# ---------------------------------------------------------------------------- OHFL
def ohfl_train(rt, params, meta):
    """OHFL step 1: train the site's own depth/width model and upload it once (with spec, count, val acc)."""
    tc = meta.get("task_config", {})
    rt.ensure_own_model()
    hist = rt.train(_epochs(rt, tc, "local_epochs", "local_epochs"), float(rt.cfg["lr"]), tag="local")
    rt.save_state()
    torch.save({"spec": rt.spec, "state_dict": rt.model.state_dict(), "input_size": int(rt.cfg["input_size"]),
                "labels": rt.labels, "site": rt.site}, rt.state_dir / "local_model.pt")
    val = rt.evaluate("val")
    local_test = rt.evaluate("test")
    metrics = {"loss": [h["loss"] for h in hist], "val": val, "local": local_test}
    return to_numpy_state(rt.model.state_dict()), metrics, _ok(
        rt, spec=rt.spec, val_acc=float(val["accuracy"] or 0.0))


def ohfl_finetune(rt, params, meta):
    """OHFL step 2: evaluate the global model zero-shot, fine-tune it at the site's input size, deploy it."""
    tc = meta.get("task_config", {})
    rt.set_model(meta["global_spec"], from_numpy_state(params, GLOBAL_PREFIX))
    zero = rt.evaluate("test")
    hist = rt.train(_epochs(rt, tc, "finetune_epochs", "finetune_epochs"), float(tc.get("finetune_lr") or rt.cfg["finetune_lr"]),
                    tag="finetune")
    rt.save_state(deployed=True)
    return {}, {"global_zero_shot": zero, "finetune_loss": [h["loss"] for h in hist], "val": rt.evaluate("val")}, _ok(rt)


# ---------------------------------------------------------------------------- FedSAF / FedProto
def _features(rt):
    from hfl_components.training import extract_features

    return extract_features(rt.model, rt.loader("train", train_mode=False))


def fedsaf_train(rt, params, meta):
    """FedSAF round (paper 000, Sec. III): train with the structural (or coordinate) alignment loss against the
    global prototypes, then upload class-mean prototypes of the training features and class counts."""
    from hfl_components.alignment import FedSAFAuxLoss, local_prototypes

    tc = meta.get("task_config", {})
    rt.ensure_own_model()
    gp = params.get("global_prototypes")
    gmask = params.get("global_mask")
    aux = None
    if gp is not None and np.asarray(gp).size:
        aux = FedSAFAuxLoss(torch.as_tensor(np.asarray(gp), dtype=torch.float32), kind=tc.get("alignment", "gcsa"),
                            lam=float(tc.get("lambda", 1.0)), gamma=float(tc.get("gamma", 1.0)),
                            global_mask=None if gmask is None else torch.as_tensor(np.asarray(gmask)).bool())
    hist = rt.train(_epochs(rt, tc, "local_epochs", "local_epochs"), float(rt.cfg["lr"]), aux_loss=aux,
                    tag=f"round {meta.get('round', 0)}")
    rt.save_state(deployed=True)
    Z, y = _features(rt)
    P, counts = local_prototypes(torch.as_tensor(Z), torch.as_tensor(y), rt.num_classes)
    np.save(rt.state_dir / "local_prototypes.npy", np.asarray(P))
    out = {"prototypes": np.asarray(P, dtype=np.float32), "counts": np.asarray(counts, dtype=np.float32)}
    return out, {"loss": [h["loss"] for h in hist], "val": rt.evaluate("val")}, _ok(rt)


# ---------------------------------------------------------------------------- FedTopo
def fedtopo_train(rt, params, meta):
    """FedTopo round (paper 002, Algorithm 1): train with the topology-guided loss from the broadcast (R^g, S^g),
    then upload only the local relation matrix R_k and class counts (optionally noisy)."""
    from hfl_components.topology import (TopologyLoss, local_relation_topology, noisy_counts,
                                         topology_inconsistency)

    tc = meta.get("task_config", {})
    rnd = int(meta.get("round", 0))
    rt.ensure_own_model()
    counts_true = rt.class_counts()
    present = torch.as_tensor(counts_true > 0)
    ablate = set(tc.get("ablate") or [])
    Rg = torch.as_tensor(np.asarray(params["R_global"]), dtype=torch.float32)
    Sg = torch.as_tensor(np.asarray(params["S_global"]), dtype=torch.float32)
    if "local_topology" in ablate:
        p = rt.state_dir / "local_topology.npy"
        if p.is_file():
            Rg = torch.as_tensor(np.load(p), dtype=torch.float32)
            Sg = torch.as_tensor((np.load(p) > 0).astype(np.float32))
    warm = rnd < int(tc.get("warmup", 3))
    q = rt.num_classes - 1 if "no_topq" in ablate else int(tc.get("top_q", 3))
    aux = TopologyLoss(Rg, Sg, present, lam=float(tc.get("lambda", 1.0)), gamma=float(tc.get("gamma", 1.0)), q=q,
                       warmup_active=warm, use_mask="no_missing_mask" not in ablate)
    hist = rt.train(_epochs(rt, tc, "local_epochs", "local_epochs"), float(rt.cfg["lr"]), aux_loss=aux,
                    tag=f"round {rnd}")
    rt.save_state(deployed=True)
    Z, y = _features(rt)
    R, mask, counts = local_relation_topology(torch.as_tensor(Z), torch.as_tensor(y), rt.num_classes)
    R = np.asarray(R, dtype=np.float32)
    np.save(rt.state_dir / "local_topology.npy", R)
    counts = np.asarray(counts, dtype=np.float32)
    if tc.get("noisy_counts"):
        counts = np.asarray(noisy_counts(torch.as_tensor(counts), torch.as_tensor(np.asarray(mask)),
                                         float(tc["noisy_counts"]), seed=int(rt.cfg["seed"]) * 1000 + rnd),
                            dtype=np.float32)
    d_r, d_rs = topology_inconsistency(torch.as_tensor(R), torch.as_tensor(np.asarray(mask)), Rg, Sg)
    metrics = {"loss": [h["loss"] for h in hist], "val": rt.evaluate("val"),
               "D_r": float(d_r), "D_rs": float(d_rs), "warmup": warm}
    return {"R": R, "counts": counts}, metrics, _ok(rt)


# ---------------------------------------------------------------------------- final evaluation (all methods)
def evaluate_deployed(rt, params, meta):
    """Evaluate the model this site deploys on its own test split (FedAvg: the final global model)."""
    if any(k.startswith(GLOBAL_PREFIX) for k in params):
        rt.set_model(meta["global_spec"], from_numpy_state(params, GLOBAL_PREFIX))
        rt.save_state(deployed=True)
    elif rt.model is None:
        raise ValueError(f"site {rt.site}: no trained model to evaluate")
    else:
        rt.save_state(deployed=True)
    test = rt.evaluate("test", with_predictions=True)
    return {}, {"test": test, "val": rt.evaluate("val")}, _ok(rt, spec=rt.spec)


HANDLERS = {
    "local_train": local_train,
    "fedavg_train": fedavg_train,
    "ohfl_train": ohfl_train,
    "ohfl_finetune": ohfl_finetune,
    "fedsaf_train": fedsaf_train,
    "fedtopo_train": fedtopo_train,
    "evaluate": evaluate_deployed,
}
