"""Depth balancing of a source model to a target's layer count (OHFL Sec. 3.2), in both directions.

After :func:`~.layer_alignment.align_layers` has matched the hidden layers of a source and a target model, the source
is rewritten so that its hidden layers correspond one-to-one with the target's; the OT fusion of Sec. 3.3–3.4 then
only has to deal with different widths.

* Source shallower (:func:`insert_identity_layers`, the operation of Sec. 3.2 / Fig. 3): for every target layer that
  no source layer maps to, an identity layer is inserted at that position: identity fc = eye(n), identity conv =
  3x3 kernel with 1 at the centre for channel i -> i (padding 1, stride 1), zero bias, as wide as the layer before
  it. Its input is always post-ReLU (or post-pool of post-ReLU) and hence non-negative, so ReLU(I x + 0) = x and the
  balanced model computes *exactly* the same function. (The first hidden layer is pinned, so nothing is inserted in
  front of the raw image.)
* Source deeper (:func:`merge_layers`, the merge Sec. 3.2 sketches but does not define): every unmatched source layer
  is merged into a matched layer of the same segment (the same conv stage, or the fc block): into the next matched
  layer after it when there is one, otherwise into the previous one. A merged group L_q ∘ … ∘ L_p is composed as
  one linear map, *ignoring the ReLUs between them* (approximate; fine-tuning repairs it):
    - fc:   W = W_q ⋯ W_p,   b = W_q(⋯(W_{p+1} b_p + b_{p+1})⋯) + b_q.
    - conv: two 3x3 cross-correlations compose into a 5x5 one, K(g) = Σ_{d+e=g} K_next(d) · K_cur(e) (channel matrix
      products, offsets d, e ∈ {−1,0,1}²). Fusable layers are 3x3, so we keep the central 3x3 of that 5x5
      kernel (the Frobenius-nearest 3x3 kernel; the outer ring is dropped). Bias: b = b_next + (Σ_xy K_next) b_cur
      (the interior value; at image borders zero padding makes even the linear composition differ).
  The truncation is exact whenever one of the two kernels is centre-only (e.g. an inserted identity layer or a
  1x1-like kernel), and the whole merge is exact on identity layers: inserting identities and merging them back
  returns the original weights.
"""
from __future__ import annotations

import torch

from hfl_components.fusion._arch import LayerRow, check_compatible, hidden_rows, resolve
from hfl_components.models.fusable import explicit_spec

StateDict = dict[str, torch.Tensor]


def _validate_pairs(pairs, rows_s: list[LayerRow], rows_t: list[LayerRow], cover: str) -> list[tuple[int, int]]:
    pairs = [(int(i), int(j)) for i, j in pairs]
    if not pairs:
        raise ValueError("layer map is empty")
    for (i0, j0), (i1, j1) in zip(pairs, pairs[1:]):
        if not (i1 > i0 and j1 > j0):
            raise ValueError(f"layer map must be strictly increasing, got {pairs}")
    for i, j in pairs:
        if not (0 <= i < len(rows_s) and 0 <= j < len(rows_t)):
            raise ValueError(f"layer map pair {(i, j)} out of range ({len(rows_s)} source, {len(rows_t)} target)")
        a, b = rows_s[i], rows_t[j]
        if a.kind != b.kind or (a.kind == "conv" and a.stage != b.stage):
            raise ValueError(f"layer map pairs {a.name} ({a.kind}, stage {a.stage}) with {b.name} "
                             f"({b.kind}, stage {b.stage}): only same-kind, same-stage layers may match")
    side = [i for i, _ in pairs] if cover == "src" else [j for _, j in pairs]
    n = len(rows_s) if cover == "src" else len(rows_t)
    if side != list(range(n)):
        raise ValueError(f"layer map must cover every {cover} hidden layer exactly once, got {pairs}")
    return pairs


def _get(sd: StateDict, key: str) -> torch.Tensor:
    if key not in sd:
        raise ValueError(f"state dict lacks {key!r}")
    return torch.as_tensor(sd[key])


def _identity(kind: str, width: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "fc":
        return torch.eye(width, dtype=dtype), torch.zeros(width, dtype=dtype)
    w = torch.zeros(width, width, 3, 3, dtype=dtype)
    idx = torch.arange(width)
    w[idx, idx, 1, 1] = 1.0
    return w, torch.zeros(width, dtype=dtype)


def _assemble(spec: dict, kinds_stages: list[tuple[str, int]], params: list[tuple[torch.Tensor, torch.Tensor]],
              classifier: tuple[torch.Tensor, torch.Tensor]) -> tuple[dict, StateDict]:
    """Build (explicit spec, state dict) from per-hidden-layer (kind, stage) and (weight, bias)."""
    n_stages = len(resolve(spec)["stages"])
    stages: list[list[int]] = [[] for _ in range(n_stages)]
    hidden: list[int] = []
    sd: StateDict = {}
    ci = fi = 0
    for (kind, stage), (w, b) in zip(kinds_stages, params):
        if kind == "conv":
            stages[stage].append(int(w.shape[0]))
            sd[f"convs.{ci}.weight"], sd[f"convs.{ci}.bias"] = w, b
            ci += 1
        else:
            hidden.append(int(w.shape[0]))
            sd[f"fcs.{fi}.weight"], sd[f"fcs.{fi}.bias"] = w, b
            fi += 1
    sd["classifier.weight"], sd["classifier.bias"] = classifier
    if any(len(s) == 0 for s in stages):
        raise ValueError("balancing produced an empty conv stage")
    return explicit_spec(spec, stages=stages, hidden=hidden), sd


def insert_identity_layers(spec: dict, state_dict: StateDict, layer_map, target_spec: dict) -> tuple[dict, StateDict]:
    """Deepen a shallower source to the target's layer layout with identity layers (OHFL Sec. 3.2, Fig. 3).

    Args:
        spec: fusable spec of the source (the shallower model).
        state_dict: its state dict (``convs.<i>.*``, ``fcs.<j>.*``, ``classifier.*``; tensors, any float dtype).
        layer_map: ``(i_src, j_tgt)`` pairs from :func:`align_layers`, covering every source hidden layer once.
        target_spec: fusable spec of the deeper target (only its layer layout is used, not its widths).

    Returns:
        ``(balanced_spec, balanced_state_dict)``: an explicit spec (``stages``/``hidden``) whose hidden layer j
        corresponds to target hidden layer j; matched layers keep their tensors (shared, not copied), inserted
        layers are identities (eye / centre-1 3x3 kernels, zero bias) as wide as the layer before them, in the
        source's dtype. The balanced model computes exactly the source's function.

    Raises:
        ValueError: incompatible specs, a map that is not strictly increasing / mixes kinds or stages / misses a
            source layer, or a source deeper than the target.
    """
    check_compatible(spec, target_spec)
    rows_s, rows_t = hidden_rows(spec), hidden_rows(target_spec)
    if len(rows_s) > len(rows_t):
        raise ValueError("insert_identity_layers needs a source no deeper than the target; use merge_layers")
    pairs = _validate_pairs(layer_map, rows_s, rows_t, cover="src")
    matched = {j: i for i, j in pairs}
    r = resolve(spec)
    kinds_stages, params = [], []
    width = r["in_channels"]
    prev_kind = "conv"
    dtype = _get(state_dict, "classifier.weight").dtype
    for j, rt in enumerate(rows_t):
        if rt.kind == "fc" and prev_kind == "conv":
            width = width * r["pool"] * r["pool"]
        if j in matched:
            rs = rows_s[matched[j]]
            w, b = _get(state_dict, f"{rs.name}.weight"), _get(state_dict, f"{rs.name}.bias")
            if w.shape[1] != width:
                raise ValueError(f"{rs.name} expects {w.shape[1]} inputs but the balanced model feeds {width}")
        else:
            w, b = _identity(rt.kind, width, dtype)
        kinds_stages.append((rt.kind, rt.stage))
        params.append((w, b))
        width, prev_kind = int(w.shape[0]), rt.kind
    cls = (_get(state_dict, "classifier.weight"), _get(state_dict, "classifier.bias"))
    return _assemble(spec, kinds_stages, params, cls)


def compose_conv3x3(k_next: torch.Tensor, b_next: torch.Tensor, k_cur: torch.Tensor,
                    b_cur: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """3x3 conv approximating conv_next ∘ conv_cur (ReLU ignored): central 3x3 of the exact 5x5 composition.

    Args:
        k_next: (C_out, C_mid, 3, 3); b_next: (C_out,); k_cur: (C_mid, C_in, 3, 3); b_cur: (C_mid,).

    Returns:
        (kernel (C_out, C_in, 3, 3), bias (C_out,)) in float64. Exact when either kernel is centre-only.
    """
    kn, kc = k_next.to(torch.float64), k_cur.to(torch.float64)
    out = torch.zeros(kn.shape[0], kc.shape[1], 3, 3, dtype=torch.float64)
    for dy in range(3):
        for dx in range(3):
            for ey in range(3):
                for ex in range(3):
                    gy, gx = dy + ey - 2, dx + ex - 2  # offsets of the composite tap, in [-2, 2]
                    if abs(gy) <= 1 and abs(gx) <= 1:
                        out[:, :, gy + 1, gx + 1] += kn[:, :, dy, dx] @ kc[:, :, ey, ex]
    bias = b_next.to(torch.float64) + kn.sum(dim=(2, 3)) @ b_cur.to(torch.float64)
    return out, bias


def _compose(kind: str, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = layers[0][0].dtype
    w, b = layers[0][0].to(torch.float64), layers[0][1].to(torch.float64)
    for wn, bn in layers[1:]:
        if kind == "fc":
            wn64 = wn.to(torch.float64)
            w, b = wn64 @ w, wn64 @ b + bn.to(torch.float64)
        else:
            w, b = compose_conv3x3(wn, bn, w, b)
    return w.to(dtype), b.to(dtype)


def merge_layers(spec: dict, state_dict: StateDict, layer_map, target_spec: dict) -> tuple[dict, StateDict]:
    """Make a deeper source as shallow as the target by merging unmatched layers (OHFL Sec. 3.2, merge direction).

    Each unmatched source hidden layer joins the next matched layer of its segment (same conv stage / fc block),
    or the previous matched one when none follows; each group is composed into one layer ignoring the ReLUs inside
    it (fc: exact matrix product; conv: central 3x3 of the 5x5 composition — see the module docstring).

    Args:
        spec: fusable spec of the source (the deeper model).
        state_dict: its state dict (tensors, any float dtype; output keeps the dtype).
        layer_map: ``(i_src, j_tgt)`` pairs from :func:`align_layers`, covering every target hidden layer once.
        target_spec: fusable spec of the shallower target (its layer layout is used, not its widths).

    Returns:
        ``(balanced_spec, balanced_state_dict)``: explicit spec with the target's per-segment layer counts; hidden
        layer j of it corresponds to target hidden layer j; its width is that of the last layer of its group.
        Approximate in general; exact when every merged-away layer is an identity (eye / centre-1 kernel, zero bias).

    Raises:
        ValueError: incompatible specs, a malformed map, a source shallower than the target, or a source segment
            with no matched layer to merge into.
    """
    check_compatible(spec, target_spec)
    rows_s, rows_t = hidden_rows(spec), hidden_rows(target_spec)
    if len(rows_s) < len(rows_t):
        raise ValueError("merge_layers needs a source at least as deep as the target; use insert_identity_layers")
    pairs = _validate_pairs(layer_map, rows_s, rows_t, cover="tgt")
    matched_src = {i: j for i, j in pairs}

    def seg(r: LayerRow):
        return (r.kind, r.stage)

    # group id (target index) of every source hidden layer
    group = [-1] * len(rows_s)
    for i, r in enumerate(rows_s):
        if i in matched_src:
            group[i] = matched_src[i]
            continue
        nxt = next((k for k in range(i + 1, len(rows_s)) if seg(rows_s[k]) == seg(r) and k in matched_src), None)
        prv = next((k for k in range(i - 1, -1, -1) if seg(rows_s[k]) == seg(r) and k in matched_src), None)
        if nxt is None and prv is None:
            raise ValueError(f"cannot merge {r.name}: no matched layer in its segment ({r.kind}, stage {r.stage})")
        group[i] = matched_src[nxt if nxt is not None else prv]
    kinds_stages, params = [], []
    for j, rt in enumerate(rows_t):
        members = [i for i in range(len(rows_s)) if group[i] == j]
        layers = [(_get(state_dict, f"{rows_s[i].name}.weight"), _get(state_dict, f"{rows_s[i].name}.bias"))
                  for i in members]
        kinds_stages.append((rt.kind, rt.stage))
        params.append(_compose(rt.kind, layers))
    cls = (_get(state_dict, "classifier.weight"), _get(state_dict, "classifier.bias"))
    return _assemble(spec, kinds_stages, params, cls)


__all__ = ["insert_identity_layers", "merge_layers", "compose_conv3x3"]
