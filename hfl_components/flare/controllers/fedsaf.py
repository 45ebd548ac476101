"""FedSAF (FedSAF paper) and FedProto (the MSE + weighted-mean shorthand): prototype exchange; the methods' NVFlare
adapter (server controller and site handler)."""
from __future__ import annotations

import time

import numpy as np

import logging

import torch

from hfl_components.flare.controllers.base import HFLController, payload_round
from hfl_components.flare.site_methods import PROTOTYPE_FILES, features, ok_meta, option, site_evaluate, task_epochs

log = logging.getLogger("cxr_hfl.site")

# ============================================================================ FedSAF / FedProto
class FedSAFController(HFLController):
    """FedSAF (FedSAF paper, Sec. III): sites keep heterogeneous models and exchange only class prototypes (C x d)
    and counts; the server builds global prototypes (FedProto weighted mean Eq. 3, fixed hypersphere Eq. 4, or
    trainable FedTGP-style Eq. 5) and logs their effective dimensionality (Fig. 1) every round.

    Round 0 broadcasts nothing (supervised-only local training -- also for ``fixed`` prototypes, so every
    construction starts from the same supervised round); from round 1 the server sends ``global_prototypes``
    (C x d) and ``global_mask`` (C,), i.e. ``C*d + C`` float32 numbers down per site, and every site uploads
    ``prototypes`` (C x d) and ``counts`` (C,), ``C*d + C`` numbers up. An upload that is not C x d, not finite,
    whose counts are not non-negative integers, disagree with the zero rows or do not add up to the site's
    ``n_train`` is dropped for that round with the reason logged (``HFLController.broadcast``).

    Args:
        num_classes (int), feature_dim (int): prototype shape C x d.
        prototypes (str): ``fedproto`` | ``fixed`` | ``tgp``. Default ``fedproto``.
        method_name (str): name recorded in the results, ``fedsaf`` or ``fedproto`` (the MSE + FedProto shorthand).
    """

    method = "fedsaf"

    def __init__(self, num_classes: int, feature_dim: int, prototypes: str = "fedproto", num_rounds: int = 1,
                 min_sites: int = 1, task_config: dict | None = None, task_timeout: int = 0, seed: int = 0,
                 method_name: str = "fedsaf", late_wait_s: int | None = None, entry_ref: str | None = None):
        super().__init__(num_rounds, min_sites, task_config, task_timeout, seed, late_wait_s, entry_ref)
        self.method_name = method_name
        self.method = method_name
        self.record["method"] = method_name
        self.num_classes = int(num_classes)
        self.feature_dim = int(feature_dim)
        self.prototypes = prototypes

    TASK_CONFIG_KEYS = {"lam": "lambda"}

    @classmethod
    def from_options(cls, method, profile, opts, common, task_config):
        # --method fedproto is shorthand for the coordinate (MSE) alignment with FedProto's weighted-mean prototypes,
        # run through the same two-level framework as FedSAF (the paper's "Ours-MSE"): the catalogue fixes
        # its alignment and prototypes.
        dims = {cfg["model"].get("feature_dim") for cfg in profile.values()}
        if len(dims) != 1 or None in dims:
            raise ValueError(f"FedSAF needs one common feature_dim in every site's model spec, got {dims}")
        num_classes = next(iter(profile.values()))["model"]["num_classes"]
        tc = {**task_config, "alignment": opts["alignment"], "lambda": float(opts["lam"]),
              "gamma": float(opts["gamma"]), "eval": opts["eval"], "grad_clip": opts["grad_clip"]}
        return cls(num_classes=num_classes, feature_dim=int(dims.pop()), prototypes=opts["prototypes"],
                   task_config=tc, method_name=method, **common)

    def run_method(self):
        import torch

        from hfl_components.alignment import (STRUCTURAL_KINDS, aggregate_fedproto, effective_rank,
                                              fixed_hypersphere_prototypes, train_tgp_prototypes)

        C, d = self.num_classes, self.feature_dim
        kind = self.task_config["alignment"]
        self.record["notes"] = []
        if C == 2 and kind in STRUCTURAL_KINDS:
            msg = (f"{kind} with 2 classes: the prototype-level structural term is constant (centred 2x2 Gram / a "
                   f"single RDM entry), only the instance-level term acts; use labels 'subtype' (3 classes)")
            self.warning(msg)
            self.record["notes"].append(msg)
        self.info(f"{self.method}: alignment {kind}, global prototypes {self.prototypes}, C x d = {C} x {d}, "
                  f"lambda {self.task_config.get('lambda')}, gamma {self.task_config.get('gamma')}, "
                  f"evaluation {self.task_config.get('eval') or 'head'}")
        fixed = np.asarray(fixed_hypersphere_prototypes(C, d, seed=self.seed), np.float32) \
            if self.prototypes == "fixed" else None
        gp, gmask, tgp_state = None, None, None
        self.record["effective_rank"] = []
        self.record["payload"] = {"unit": "bytes of float32 arrays per site",
                                  "theory": f"up C*d + C = {C * d + C} numbers; down 0 in round 0, then C*d + C",
                                  "per_round": []}
        for rnd in range(self.num_rounds):
            params = {}
            if gp is not None:
                params = {"global_prototypes": np.asarray(gp, np.float32), "global_mask": np.asarray(gmask, np.float32)}
            res = self.broadcast("fedsaf_train", rnd, params)
            payload_round(self.record, rnd, 4 * (C * d + C), 0 if gp is None else 4 * (C * d + C))
            self.set_phase("averaging prototypes", round=rnd)
            t0 = time.perf_counter()
            P = [torch.as_tensor(np.asarray(r.params["prototypes"])) for r in res.values()]
            N = [torch.as_tensor(np.asarray(r.params["counts"])) for r in res.values()]
            stacked = torch.cat([p[n > 0] for p, n in zip(P, N)])
            er = float(effective_rank(stacked)) if len(stacked) else None
            self.record["effective_rank"].append(er)
            self.info(f"round {rnd}: effective rank of the {len(stacked)} stacked site prototypes "
                      f"({len(res)} sites) = {er if er is None else round(er, 4)} (max {min(len(stacked), d)})")
            if self.prototypes == "fedproto":
                gp, gmask = aggregate_fedproto(P, N)
            elif self.prototypes == "tgp":
                gp, gmask = train_tgp_prototypes(P, N, C, d, seed=self.seed, init=tgp_state)
                tgp_state = gp
            else:  # fixed (Eq. 4): the same hypersphere prototypes every round, all classes available
                gp, gmask = fixed, np.ones(C, bool)
            gp, gmask = np.asarray(gp, np.float32), np.asarray(gmask, bool)
            self.record["server_seconds"].setdefault("aggregation", 0.0)
            self.record["server_seconds"]["aggregation"] += time.perf_counter() - t0
        self.record["global_prototypes"] = None if gp is None else np.asarray(gp).tolist()
        self.final_evaluation(self.num_rounds)


# ============================================================================ site handler
def fedsaf_train(rt, params, meta):
    """FedSAF round (FedSAF paper, Sec. III): train with the structural (or coordinate) alignment loss against the
    global prototypes, then upload class-mean prototypes of the training features and class counts.

    Round 0 receives no global prototypes (the server sends none), so it is supervised-only (CE); from round 1 the
    loss is Eq. 19, CE + lambda L_proto + gamma L_inst, with the alignment function of option ``alignment``,
    and the gradient norm clipped at option ``grad_clip``. Prototypes
    are computed *after* local training (eval-mode features of the whole training split) and also kept in the
    site's workspace for the optional nearest-local-prototype evaluation.
    """
    import warnings

    from hfl_components.alignment import FedSAFAuxLoss, local_prototypes

    tc = meta.get("task_config", {})
    rnd = int(meta.get("round", 0))
    rt.ensure_own_model()
    gp = params.get("global_prototypes")
    gmask = params.get("global_mask")
    aux = None
    if gp is not None and np.asarray(gp).size:
        with warnings.catch_warnings(record=True) as caught:  # the C = 2 warning goes to the site log, once
            warnings.simplefilter("always")
            aux = FedSAFAuxLoss(torch.as_tensor(np.asarray(gp), dtype=torch.float32),
                                kind=option(meta, "alignment"), lam=float(option(meta, "lambda")),
                                gamma=float(option(meta, "gamma")),
                                global_mask=None if gmask is None else torch.as_tensor(np.asarray(gmask)).bool())
        for w in caught:
            log.warning("site %s: %s", rt.site, w.message)
    clip = option(meta, "grad_clip") or None if aux is not None else None  # round 0 (plain CE) is not clipped
    hist = rt.train(task_epochs(rt, tc, "local_epochs", "local_epochs"), float(rt.cfg["lr"]), aux_loss=aux,
                    grad_clip=clip, tag=f"round {rnd}", rnd=rnd, total_rounds=meta.get("total_rounds"))
    Z, y = features(rt)
    P, counts = local_prototypes(torch.as_tensor(Z), torch.as_tensor(y), rt.num_classes)
    np.save(rt.state_dir / "local_prototypes.npy", np.asarray(P))
    np.save(rt.state_dir / "local_counts.npy", np.asarray(counts))
    out = {"prototypes": np.asarray(P, dtype=np.float32), "counts": np.asarray(counts, dtype=np.float32)}
    val = site_evaluate(rt, "val", tc)
    rt.deploy_round(val, rnd, extra_files=PROTOTYPE_FILES)  # the site config's deploy rule: last | best_val
    metrics = {"loss": [h["loss"] for h in hist], "val": val,
               "alignment_active": aux is not None,
               "alignment_terms_last_batch": dict(aux.last) if aux is not None else None}
    return out, metrics, ok_meta(rt)
