"""What travels between the server and the sites: message helpers shared by the controllers and the site runtime
(the controllers import these, not the whole site runtime).

Messages carry NumPy arrays in ``FLModel.params`` (models the server sends under the :data:`GLOBAL_PREFIX`) and plain
JSON in ``meta`` / ``metrics``.
"""
from __future__ import annotations

import numpy as np

# torch is imported where a tensor is made (from_numpy_state), not here: the server's controllers import this
# module, and keeping torch out of their import lets the NVFlare server start its workflow sooner (the
# server needs torch only once uploads arrive)
GLOBAL_PREFIX = "global."


def to_numpy_state(state_dict: dict, prefix: str = "") -> dict[str, np.ndarray]:
    """state dict of tensors -> {prefix+key: float32 ndarray}."""
    return {prefix + k: v.detach().cpu().numpy().astype(np.float32) for k, v in state_dict.items()}


def from_numpy_state(params: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """{prefix+key: ndarray} -> state dict of tensors (keys without the prefix); other keys are ignored."""
    import torch

    return {k[len(prefix):]: torch.as_tensor(np.asarray(v)) for k, v in params.items() if k.startswith(prefix)}


def payload_bytes(params: dict | None) -> int:
    """Bytes of the arrays in a message's params (the communication cost we report)."""
    if not params:
        return 0
    return int(sum(np.asarray(v).nbytes for v in params.values()))
