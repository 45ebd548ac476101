"""FedTopo (FedTopo paper, Algorithm 1): class-relation topology exchange."""
from __future__ import annotations

import time

import numpy as np

from hfl_components.flare.controllers.base import HFLController, _payload_round

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
                 late_wait_s: int | None = None):
        super().__init__(num_rounds, min_sites, task_config, task_timeout, seed, late_wait_s)
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
              "noisy_counts": None if noisy is None else float(noisy)}
        num_classes = next(iter(profile.values()))["model"]["num_classes"]
        return cls(num_classes=num_classes, rho=float(opts["rho"]), ablate=ablate, task_config=tc, **common)

    def run_method(self):
        from hfl_components.topology import TopologyAblation, aggregate_topology, initial_topology, is_warmup_round

        C = self.num_classes
        tc = self.task_config
        abl = TopologyAblation.from_names(self.ablate)
        self.record["notes"] = []
        q = int(tc.get("top_q", 3))
        if abl.no_topq and TopologyAblation.topq_is_noop(q, C):
            msg = (f"ablation no_topq is identical to the default here: top_q = {q} >= C - 1 = {C - 1}, so the "
                   f"default already keeps every present negative")
            self.warning(msg)
            self.record["notes"].append(msg)
        if "no_topq" not in self.ablate and q > C - 1:
            self.record["notes"].append(f"top_q = {q} clipped to C - 1 = {C - 1}")
        warmup = int(tc.get("warmup", 3))
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
            _payload_round(self.record, rnd, 4 * (C * C + C), 4 * 2 * C * C)
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
