"""FedTopo (FedTopo paper, Algorithm 1): class-relation topology exchange; the method's NVFlare adapter (server controller
and site handler)."""
from __future__ import annotations

import time

import numpy as np

import torch

from hfl_components.flare.controllers.base import HFLController, payload_round
from hfl_components.flare.site_methods import features, ok_meta, option, site_evaluate, task_epochs

# ============================================================================ FedTopo
class FedTopoController(HFLController):
    """FedTopo (FedTopo paper, Algorithm 1): sites upload a C x C relation matrix R_k and class counts n_k; the
    server aggregates them with observation masks and harmonic reliability weights (Eq. 4-7), smooths with EMA
    (Eq. 8) and broadcasts (R^g, S^g): ``C*C + C`` float32 numbers up and ``2*C*C`` down per site and round.

    Uploads are validated (C x C, finite, in [0, 1], symmetric, counts (C,) finite and non-negative, and the unit
    diagonal of R_k marking exactly the classes with a positive count); a bad one is dropped for the round with
    the reason logged, and pairs no remaining site observed keep their previous global value (Eq. 8).

    Args:
        num_classes (int): C.
        rho (float): EMA factor (Eq. 8). Default 0.7.
        ablate (list): any of ``no_reliability``, ``no_ema`` (server side) and the site-side switches
            ``no_topq``, ``no_missing_mask``, ``local_topology`` (see ``topology.TopologyAblation``).
    """

    method = "fedtopo"

    def __init__(self, num_classes: int, rho: float = 0.7, ablate: list | None = None, num_rounds: int = 1,
                 min_sites: int = 1, task_config: dict | None = None, task_timeout: int = 0, seed: int = 0,
                 late_wait_s: int | None = None, entry_ref: str | None = None):
        super().__init__(num_rounds, min_sites, task_config, task_timeout, seed, late_wait_s, entry_ref)
        self.num_classes = int(num_classes)
        self.rho = float(rho)
        self.ablate = list(ablate or [])

    TASK_CONFIG_KEYS = {"lam": "lambda"}

    @classmethod
    def from_options(cls, method, profile, opts, common, task_config):
        from hfl_components.topology import TopologyAblation

        ablate = sorted(set(opts["ablate"] or []))
        TopologyAblation.from_names(ablate)  # ValueError on an unknown switch
        noisy = opts["noisy_counts"]
        tc = {**task_config, "lambda": float(opts["lam"]), "gamma": float(opts["gamma"]),
              "top_q": int(opts["top_q"]), "warmup": int(opts["warmup"]), "ablate": ablate,
              "noisy_counts": None if noisy is None else float(noisy),
              "eval": opts["eval"], "grad_clip": opts["grad_clip"]}
        num_classes = next(iter(profile.values()))["model"]["num_classes"]
        return cls(num_classes=num_classes, rho=float(opts["rho"]), ablate=ablate, task_config=tc, **common)

    def run_method(self):
        from hfl_components.topology import TopologyAblation, aggregate_topology, initial_topology, is_warmup_round

        C = self.num_classes
        tc = self.task_config
        abl = TopologyAblation.from_names(self.ablate)
        self.record["notes"] = []
        q = int(tc["top_q"])
        if abl.no_topq and TopologyAblation.topq_is_noop(q, C):
            msg = (f"ablation no_topq is identical to the default here: top_q = {q} >= C - 1 = {C - 1}, so the "
                   f"default already keeps every present negative")
            self.warning(msg)
            self.record["notes"].append(msg)
        if "no_topq" not in self.ablate and q > C - 1:
            self.record["notes"].append(f"top_q = {q} clipped to C - 1 = {C - 1}")
        warmup = int(tc["warmup"])
        if warmup >= self.num_rounds:
            msg = f"warm-up ({warmup} rounds) covers all {self.num_rounds} rounds: the topology loss never acts"
            self.warning(msg)
            self.record["notes"].append(msg)
        rho = abl.rho(self.rho)
        self.info(f"FedTopo: C = {C}, rho {rho}, reliability {not abl.no_reliability}, warm-up {warmup}, "
                  f"top_q {q}, lambda {tc.get('lambda')}, gamma {tc.get('gamma')}, ablations {self.ablate or 'none'}, "
                  f"noisy counts {tc.get('noisy_counts')}")
        R, S = initial_topology(C)
        self.record["topology_history"] = []
        self.record["payload"] = {"unit": "bytes of float32 arrays per site",
                                  "theory": f"up C*C + C = {C * C + C} numbers, down 2*C*C = {2 * C * C}",
                                  "per_round": []}
        for rnd in range(self.num_rounds):
            params = {"R_global": np.asarray(R, np.float32), "S_global": np.asarray(S, np.float32)}
            res = self.broadcast("fedtopo_train", rnd, params)
            payload_round(self.record, rnd, 4 * (C * C + C), 4 * 2 * C * C)
            self.set_phase("aggregating topology", round=rnd)
            t0 = time.perf_counter()
            R, S = aggregate_topology([np.asarray(r.params["R"]) for r in res.values()],
                                      [np.asarray(r.params["counts"]) for r in res.values()],
                                      np.asarray(R), np.asarray(S), rho=rho, reliability=not abl.no_reliability)
            self.record["server_seconds"].setdefault("aggregation", 0.0)
            self.record["server_seconds"]["aggregation"] += time.perf_counter() - t0
            diag = {s: {k: (r.metrics or {}).get(k) for k in ("D_r", "D_rs")} for s, r in res.items()}
            self.record["topology_history"].append({
                "round": rnd, "warmup": is_warmup_round(rnd, warmup), "sites": list(res),
                "R": np.asarray(R).tolist(), "S": np.asarray(S).tolist(), "diagnostics": diag})
            self.info(f"round {rnd}: R^g off-diagonal {np.round(np.asarray(R)[~np.eye(C, dtype=bool)], 3).tolist()}, "
                      f"D^r/D^rs per site {diag}")
        self.record["R_global"] = np.asarray(R).tolist()
        self.record["S_global"] = np.asarray(S).tolist()
        self.final_evaluation(self.num_rounds)


# ============================================================================ site handler
def fedtopo_train(rt, params, meta):
    """FedTopo round (FedTopo paper, Algorithm 1): train with the topology-guided loss from the broadcast (R^g, S^g),
    then upload only the local relation matrix R_k and class counts (optionally noisy).

    Warm-up: in rounds ``r <`` option ``warmup`` (0-based) the topology term is off (``TopologyLoss(warmup_active=True)``
    returns 0, so the loss is plain CE). Site-side ablations (option ``ablate``): ``no_topq`` keeps every present
    negative (q = C - 1), ``no_missing_mask`` drops the presence mask of Eq. 10, ``local_topology`` guides with the
    site's own R_k of the previous round and S = 1 on its observed pairs (round 0 has no R_k yet: the broadcast
    initial state, which gives B_y = 0). D^r / D^rs (Eq. 25-26) compare this round's R_k with the broadcast
    (R^g, S^g); they are None when the site holds fewer than two classes.
    """
    import zlib

    from hfl_components.topology import (TopologyLoss, is_warmup_round, local_guidance, local_relation_topology,
                                         noisy_counts, topology_inconsistency)

    tc = meta.get("task_config", {})
    rnd = int(meta.get("round", 0))
    rt.ensure_own_model()
    counts_true = rt.class_counts()
    present = torch.as_tensor(counts_true > 0)
    ablate = set(option(meta, "ablate") or [])
    Rg = torch.as_tensor(np.asarray(params["R_global"]), dtype=torch.float32)
    Sg = torch.as_tensor(np.asarray(params["S_global"]), dtype=torch.float32)
    R_guide, S_guide = Rg, Sg
    if "local_topology" in ablate:
        p = rt.state_dir / "local_topology.npy"
        if p.is_file():
            Rl, Sl = local_guidance(np.load(p), counts_true > 0)
            R_guide, S_guide = torch.as_tensor(Rl, dtype=torch.float32), torch.as_tensor(Sl, dtype=torch.float32)
    warm = is_warmup_round(rnd, int(option(meta, "warmup")))
    q = None if "no_topq" in ablate else int(option(meta, "top_q"))
    aux = TopologyLoss(R_guide, S_guide, present, lam=float(option(meta, "lambda")), gamma=float(option(meta, "gamma")),
                       q=q, warmup_active=warm, use_mask="no_missing_mask" not in ablate)
    hist = rt.train(task_epochs(rt, tc, "local_epochs", "local_epochs"), float(rt.cfg["lr"]), aux_loss=aux,
                    grad_clip=option(meta, "grad_clip") or None, tag=f"round {rnd}", rnd=rnd, total_rounds=meta.get("total_rounds"))
    val = site_evaluate(rt, "val", tc)
    rt.deploy_round(val, rnd)  # the site config's deploy rule: last | best_val
    Z, y = features(rt)
    R, mask, counts = local_relation_topology(torch.as_tensor(Z), torch.as_tensor(y), rt.num_classes)
    R = np.asarray(R, dtype=np.float32)
    np.save(rt.state_dir / "local_topology.npy", R)
    counts = np.asarray(counts, dtype=np.float32)
    if option(meta, "noisy_counts"):
        seed = int(rt.cfg["seed"]) * 100003 + zlib.crc32(rt.site.encode()) % 100003 + 7919 * rnd
        counts = np.asarray(noisy_counts(counts, np.asarray(mask), float(option(meta, "noisy_counts")), seed=seed),
                            dtype=np.float32)
    d_r, d_rs = topology_inconsistency(R, np.asarray(mask), Rg, Sg)
    metrics = {"loss": [h["loss"] for h in hist], "val": val,
               "D_r": d_r, "D_rs": d_rs, "warmup": bool(warm), "q_effective": int(aux.q_effective),
               "topq_active": bool(aux.topq_active), "n_present": int(np.asarray(mask).sum())}
    return {"R": R, "counts": counts}, metrics, ok_meta(rt)
