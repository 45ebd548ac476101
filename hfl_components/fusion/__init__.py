"""OHFL fusion library (pure PyTorch / NumPy / POT): one-shot cross-layer optimal-transport fusion of depth- and
width-varying fusable CNNs (paper ../shared/papers/003_6a6480883ac6b0c6.txt, Sec. 3–4).

Pipeline for one pair (:func:`fuse_pair`): linear CKA cost (:mod:`.cka`, Eq. 1) -> DP layer map
(:mod:`.layer_alignment`, Sec. 3.1) -> depth balancing by identity insertion or layer merging (:mod:`.balancing`,
Sec. 3.2) -> OT neuron alignment and weighted average (:mod:`.ot_fusion`, Sec. 3.3–3.4). Multi-model strategies
cid / cdd / cia / rand in :mod:`.aggregate` (Sec. 3.5, Algorithm 1), optionally with each architecture's models merged
at once first (:mod:`.group_merge`, C2M3-style); upload checks in :mod:`.validation`. Every
probe statistic (CKA Grams, repair statistics) comes from one hooked forward pass per model, cached across the
pairwise fusions (:mod:`.probe_stats`); the activation repair is one pass too (:mod:`.repair`).
"""
from hfl_components.fusion.aggregate import STRATEGIES, SiteModel, aggregate_models
from hfl_components.fusion.balancing import compose_conv3x3, insert_identity_layers, merge_layers
from hfl_components.fusion.cka import cka_cost_matrix, centred_gram, layer_activations, linear_cka
from hfl_components.fusion.group_merge import FUSION_ORDERS, match_group, merge_group
from hfl_components.fusion.layer_alignment import align_layers, map_cost
from hfl_components.fusion.ot_fusion import OTMarginalError, ot_fuse_balanced, solve_ot
from hfl_components.fusion.pairwise import PHASES, fuse_pair
from hfl_components.fusion.validation import validate_upload

__all__ = [
    "FUSION_ORDERS", "OTMarginalError", "PHASES", "STRATEGIES", "SiteModel", "aggregate_models", "align_layers",
    "centred_gram", "cka_cost_matrix", "compose_conv3x3", "fuse_pair", "insert_identity_layers", "layer_activations",
    "linear_cka", "map_cost", "match_group", "merge_group", "merge_layers", "ot_fuse_balanced", "solve_ot",
    "validate_upload",
]
