"""Depth balancing (OHFL Sec. 3.2): identity insertion is function-preserving on real chest X-rays, merging the
identities back restores the weights, and the conv/fc compositions used for merging are exact where promised."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hfl_components.fusion import (align_layers, cka_cost_matrix, compose_conv3x3, insert_identity_layers,
                                   merge_layers)
from hfl_components.models.fusable import build_fusable
from tests.fusion_helpers import forward, he_model

torch.set_num_threads(1)


def load_real_images(data_root: Path, n: int = 8, size: int = 32) -> torch.Tensor:
    """n real chest X-rays (half NORMAL, half PNEUMONIA) as (n, 1, size, size) float32 in [0, 1], via PIL."""
    from PIL import Image

    root = data_root / "chest_xray_224" / "train"
    files = sorted((root / "NORMAL").glob("*.jpeg"))[: n // 2] + sorted((root / "PNEUMONIA").glob("*.jpeg"))[: n - n // 2]
    if len(files) < n:
        pytest.skip(f"need {n} images under {root}, found {len(files)}")
    arrs = [np.asarray(Image.open(f).convert("L").resize((size, size), Image.BILINEAR), dtype=np.float32) / 255.0
            for f in files]
    return torch.from_numpy(np.stack(arrs))[:, None]


@pytest.fixture(scope="module")
def real_images(data_root):
    return load_real_images(data_root)


def _rows(m):
    hidden = m.layers()[:-1]
    return [l.kind for l in hidden], [l.stage for l in hidden]


@pytest.mark.parametrize("family,width,src_depth,tgt_depth", [
    ("cnn", 0.25, "shallow", "deep"), ("cnn", 0.25, "shallow", "medium"), ("cnn", 0.25, "medium", "deep"),
    ("vgg11", 0.125, "shallow", "deep"),
])
def test_identity_insertion_preserves_outputs_on_real_images_and_merge_restores_weights(
        real_images, family, width, src_depth, tgt_depth):
    src_spec = {"family": family, "depth": src_depth, "width": width, "in_channels": 1, "num_classes": 2}
    tgt_spec = {**src_spec, "depth": tgt_depth}
    src, tgt = he_model(src_spec, 0), he_model(tgt_spec, 1)
    sd = src.state_dict()
    ref = forward(src_spec, sd, real_images)
    maps = [align_layers(cka_cost_matrix(src, tgt, real_images), *_rows(src), *_rows(tgt))]
    maps += [align_layers(None, *_rows(src), *_rows(tgt), method="random", seed=s) for s in range(4)]
    for pairs in maps:
        bal_spec, bal_sd = insert_identity_layers(src_spec, sd, pairs, tgt_spec)
        bal = build_fusable(bal_spec)
        assert len(bal.layers()) == len(tgt.layers())
        assert [l.kind for l in bal.layers()] == [l.kind for l in tgt.layers()]
        assert [l.stage for l in bal.layers()] == [l.stage for l in tgt.layers()]
        out = forward(bal_spec, bal_sd, real_images)
        assert (out - ref).abs().max().item() < 1e-5, pairs
        # merging the inserted identities back gives the original architecture and weights
        back_pairs = [(j, i) for i, j in pairs]
        m_spec, m_sd = merge_layers(bal_spec, bal_sd, back_pairs, src_spec)
        assert build_fusable(m_spec).stages == src.stages and build_fusable(m_spec).hidden == src.hidden
        assert set(m_sd) == set(sd)
        for k in sd:
            assert torch.equal(m_sd[k], sd[k]), k


def test_inserted_layers_are_identities():
    spec = {"family": "cnn", "depth": "shallow", "width": 0.25, "in_channels": 1, "num_classes": 2}
    deep = {**spec, "depth": "deep"}
    sd = he_model(spec, 0).state_dict()
    pairs = [(0, 0), (1, 2), (2, 3), (3, 5), (4, 8)]  # target conv 1, conv 4, fc 6, fc 7 get identities
    bal_spec, bal_sd = insert_identity_layers(spec, sd, pairs, deep)
    assert bal_spec["stages"] == [[2], [2, 4], [8, 8]] and bal_spec["hidden"] == [250, 250, 250, 125]
    w = bal_sd["convs.1.weight"]  # leading identity of stage 1: as wide as its input (2 channels of stage 0)
    expect = torch.zeros(2, 2, 3, 3)
    expect[0, 0, 1, 1] = expect[1, 1, 1, 1] = 1.0
    assert torch.equal(w, expect) and torch.equal(bal_sd["convs.1.bias"], torch.zeros(2))
    assert torch.equal(bal_sd["convs.2.weight"], sd["convs.1.weight"])
    ctr = torch.zeros(8, 8, 3, 3)
    ctr[:, :, 1, 1] = torch.eye(8)
    assert torch.equal(bal_sd["convs.4.weight"], ctr)
    assert torch.equal(bal_sd["fcs.1.weight"], torch.eye(250)) and torch.equal(bal_sd["fcs.2.weight"], torch.eye(250))
    assert torch.equal(bal_sd["fcs.3.weight"], sd["fcs.1.weight"])
    assert torch.equal(bal_sd["fcs.0.weight"], sd["fcs.0.weight"])


def test_conv_composition_exact_when_one_kernel_is_centre_only():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 9, 9)
    conv = lambda w, b, t: torch.nn.functional.conv2d(t, w, b, padding=1)  # noqa: E731
    k_gen, b_gen = torch.randn(4, 3, 3, 3, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    k_ctr = torch.zeros(5, 4, 3, 3, dtype=torch.float64)
    k_ctr[:, :, 1, 1] = torch.randn(5, 4, dtype=torch.float64)
    b_ctr = torch.randn(5, dtype=torch.float64)
    x = x.to(torch.float64)
    # centre-only kernel applied after a general one (any biases): exact everywhere
    w, b = compose_conv3x3(k_ctr, b_ctr, k_gen, b_gen)
    assert torch.allclose(conv(w, b, x), conv(k_ctr, b_ctr, conv(k_gen, b_gen, x)), atol=1e-12)
    # general kernel after a centre-only one with zero bias: exact everywhere (zero padding maps to zero)
    k_c2 = torch.zeros(4, 3, 3, 3, dtype=torch.float64)
    k_c2[:, :, 1, 1] = torch.randn(4, 3, dtype=torch.float64)
    k_g2 = torch.randn(5, 4, 3, 3, dtype=torch.float64)
    w, b = compose_conv3x3(k_g2, b_ctr, k_c2, torch.zeros(4, dtype=torch.float64))
    assert torch.allclose(conv(w, b, x), conv(k_g2, b_ctr, conv(k_c2, torch.zeros(4, dtype=torch.float64), x)),
                          atol=1e-12)
    # two general kernels: the result is the central 3x3 of the full 5x5 composition (checked on the interior
    # against the 5x5 kernel obtained from impulse responses)
    w, _ = compose_conv3x3(k_g2, torch.zeros(5, dtype=torch.float64), k_gen, torch.zeros(4, dtype=torch.float64))
    imp = torch.zeros(3, 3, 5, 5, dtype=torch.float64)
    for c in range(3):
        imp[c, c, 2, 2] = 1.0
    full = conv(k_g2, None, conv(k_gen, None, imp.new_zeros(3, 3, 9, 9).index_put_(
        (torch.arange(3), torch.arange(3), torch.tensor([4] * 3), torch.tensor([4] * 3)), torch.ones(3,
                                                                                                     dtype=torch.float64))))
    k5 = full[:, :, 2:7, 2:7].flip(-1, -2).permute(1, 0, 2, 3)  # impulse response -> cross-correlation kernel
    assert torch.allclose(w, k5[:, :, 1:4, 1:4], atol=1e-12)


def test_fc_merge_is_the_linear_composition():
    spec = {"family": "cnn", "depth": "shallow", "width": 0.05, "in_channels": 1, "num_classes": 2,
            "stages": [[2], [2], [2]], "hidden": [6, 5, 4]}
    tgt = {**spec, "hidden": [6, 4]}
    sd = he_model(spec, 3).state_dict()
    m_spec, m_sd = merge_layers(spec, sd, [(0, 0), (1, 1), (2, 2), (3, 3), (5, 4)], tgt)  # fcs.1 merges into fcs.2
    assert m_spec["hidden"] == [6, 4]
    w1, b1, w2, b2 = sd["fcs.1.weight"].double(), sd["fcs.1.bias"].double(), sd["fcs.2.weight"].double(), \
        sd["fcs.2.bias"].double()
    assert torch.allclose(m_sd["fcs.1.weight"].double(), w2 @ w1, atol=1e-6)
    assert torch.allclose(m_sd["fcs.1.bias"].double(), w2 @ b1 + b2, atol=1e-6)
    assert torch.equal(m_sd["fcs.0.weight"], sd["fcs.0.weight"])


def test_balancing_rejects_bad_maps():
    spec = {"family": "cnn", "depth": "shallow", "width": 0.25, "in_channels": 1, "num_classes": 2}
    deep = {**spec, "depth": "deep"}
    sd = he_model(spec, 0).state_dict()
    with pytest.raises(ValueError, match="strictly increasing"):
        insert_identity_layers(spec, sd, [(0, 0), (1, 2), (2, 1), (3, 5), (4, 8)], deep)
    with pytest.raises(ValueError, match="same-kind"):
        insert_identity_layers(spec, sd, [(0, 0), (1, 1), (2, 5), (3, 6), (4, 8)], deep)
    with pytest.raises(ValueError, match="merge_layers"):
        insert_identity_layers(deep, he_model(deep, 0).state_dict(), [(i, i) for i in range(5)], spec)
    with pytest.raises(ValueError):
        insert_identity_layers(spec, sd, [(0, 0), (4, 8)], deep)  # misses source layers
