"""The border study's probe (``studies/border/measure.py``) on hand-built images and tiny models with known answers:
a model that reads only the outermost pixel ring moves by the amount the band colour dictates, a model that reads
only the centre does not move, and the rule's eligibility and tie order on hand-made summaries."""
from __future__ import annotations

import csv
import math

import numpy as np
import pytest
import torch
from PIL import Image

from studies.border.measure import SUMMARY_COLUMNS, band_changes, decide, p_positive

torch.set_num_threads(1)
K = 10.0  # logit slope of the tiny models


class _Reader(torch.nn.Module):
    """p(PNEUMONIA) = sigmoid(K * (m - 0.5)), m the mean of the outermost pixel ring ("ring") or of the central
    quarter ("centre") of the (N, 1, S, S) input."""

    def __init__(self, where: str):
        super().__init__()
        self.where = where

    def features(self, x):
        s = x.shape[-1]
        if self.where == "ring":
            mask = torch.ones(s, s, dtype=torch.bool)
            mask[1:-1, 1:-1] = False
        else:
            mask = torch.zeros(s, s, dtype=torch.bool)
            mask[3 * s // 8:5 * s // 8, 3 * s // 8:5 * s // 8] = True
        return x[:, 0][:, mask].mean(dim=1, keepdim=True)

    def head(self, z):
        return torch.cat([torch.zeros_like(z), K * (z - 0.5)], dim=1)


def _sig(v):
    return 1 / (1 + math.exp(-v))


@pytest.fixture
def rows(tmp_path):
    """Four 100 x 100 PNGs: background 50, a centred 60 x 60 square of 200 (min 50 and max 200 survive banding)."""
    out = []
    for i in range(4):
        a = np.full((100, 100), 50, np.uint8)
        a[20:80, 20:80] = 200
        p = tmp_path / f"img{i}.png"
        Image.fromarray(a).save(p)
        out.append({"path": str(p), "label": i % 2})
    return out


def test_ring_reader_moves_by_the_band_colour(rows):
    ch = band_changes(_Reader("ring"), rows, 32, "stretch")
    base = _sig(-K / 2)  # the original ring is background, scaled to 0
    assert ch["black"]["mean"] == pytest.approx(0.0, abs=1e-6)  # black = the image's own darkest level = background
    assert ch["grey"]["mean"] == pytest.approx(_sig(0.0) - base, abs=1e-3)
    assert ch["white"]["mean"] == pytest.approx(_sig(K / 2) - base, abs=1e-3)
    assert ch["white"]["ci_low"] <= ch["white"]["mean"] <= ch["white"]["ci_high"]
    assert ch["worst"] == pytest.approx(ch["white"]["mean"]) and not ch["within"]


def test_centre_reader_does_not_move(rows):
    m = _Reader("centre")
    p0 = p_positive(m, rows, 32, "stretch")
    assert p0 == pytest.approx(np.full(4, _sig(K / 2)), abs=1e-4)  # the centre is the square, scaled to 1
    ch = band_changes(m, rows, 32, "stretch", p0)
    assert all(abs(ch[c]["mean"]) < 1e-6 for c in ("black", "grey", "white")) and ch["within"]


def _summary(path, rows):
    path.mkdir(parents=True)
    with (path / "summary.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=SUMMARY_COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def test_decide_eligibility_and_ties(tmp_path):
    def row(arm, within, auc, margin, own):
        return {"arm": arm, "all_within": str(within), "mean_tuning_auc": auc, "margin": margin, "own_test_auc": own}

    for k in (0, 1, 2):
        _summary(tmp_path / f"seed{k}", [row("default", False, 0.95, 0.15, 0.90),
                                         row("border", True, 0.945, 0.13, 0.88),   # AUC within 0.01: eligible
                                         row("crop", True, 0.93, 0.13, 0.99),      # AUC too low: (b) fails
                                         row("border_crop", True, 0.95, 0.13, 0.884)])  # tied with border
    d = decide(tmp_path)
    assert d["complete"] and d["eligible"] == ["border", "border_crop"]
    assert not d["criteria"]["crop"][1]["b"] and not d["criteria"]["default"][0]["a"]
    assert d["chosen"] == "border"  # within 0.005 of the best: stretch before crop
    (tmp_path / "seed2" / "summary.csv").unlink()
    assert decide(tmp_path)["chosen"] is None and not decide(tmp_path)["complete"]
