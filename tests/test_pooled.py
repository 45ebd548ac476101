"""The pooled description of protocols 1-3 (``studies/confirmatory/pooled.py``): copies with the images in other
orders are aligned, the description is ``paired_crossed`` without any verdict, and the committed numbers are those
of the committed per-seed predictions."""
from __future__ import annotations

import json

import numpy as np
import pytest

from studies.confirmatory import pooled as P


def _copy(root, name, seed, method, paths, y, probs):
    d = root / name / "seeds" / f"seed{seed}" / method / "external" / P.SET
    d.mkdir(parents=True)
    np.savez_compressed(d / "predictions.npz", paths=np.asarray(paths), y=np.asarray(y),
                        **{f"site-{k + 1}_deployed": p for k, p in enumerate(probs)})


def test_copies_in_other_image_orders_pool_into_one_crossed_design(tmp_path):
    from hfl_components.stats import paired_crossed

    rng = np.random.default_rng(1)
    names = [f"train/{c}/im{i:02d}.jpeg" for i, c in enumerate(["NORMAL"] * 6 + ["PNEUMONIA"] * 6)]
    y = np.array([0] * 6 + [1] * 6)
    protocols = {"p1": (1, 100), "p2": (2, 300)}
    want = {}
    for name, seeds in (("p1", [10, 11]), ("p2", [30, 31, 32])):
        for s in seeds:
            for m in P.METHODS:
                pn = rng.random((2, 12))  # p(NORMAL) of two sites, in the sorted image order
                want[(s, m)] = 1.0 - pn
                order = rng.permutation(12)
                probs = [np.stack([pn[k][order], 1 - pn[k][order]], axis=1).astype(np.float32) for k in range(2)]
                _copy(tmp_path, name, s, m, [names[i] for i in order], y[order], probs)
    yy, A, B, seeds, proto = P.load(protocols, tmp_path)
    assert seeds == [10, 11, 30, 31, 32] and proto[31] == "p2"
    assert (yy == y).all()
    assert np.allclose(A, [want[(s, "ohfl")] for s in seeds], atol=1e-6)
    assert np.allclose(B, [want[(s, "fedavg")] for s in seeds], atol=1e-6)
    d = P.describe(yy, A, B, seeds, n_boot=50)
    ref = paired_crossed(yy, A, B, "auc", n_boot=50, seed=0, seeds=seeds)
    assert (d["diff"], d["ci_low"], d["ci_high"]) == (ref["diff"], ref["ci_low"], ref["ci_high"])
    assert not {"verdict", "superior", "non_inferior", "reliable", "margin"} & set(d)


def test_a_copy_of_other_images_is_refused_by_name(tmp_path):
    y = [0, 1]
    p = [np.array([[0.9, 0.1], [0.2, 0.8]], np.float32)]
    _copy(tmp_path, "p1", 10, "ohfl", ["a", "b"], y, p)
    _copy(tmp_path, "p1", 10, "fedavg", ["a", "c"], y, p)
    with pytest.raises(ValueError, match="fedavg/external/.*predictions.npz: other images or labels"):
        P.load({"p1": (1, 100)}, tmp_path)


def test_the_committed_description_is_that_of_the_committed_predictions():
    """Recomputed without the bootstrap (seconds): the same seeds, per-seed differences, mean and seed-level
    t-interval as the committed file; its bootstrap interval is the one the script wrote."""
    y, A, B, seeds, proto = P.load()
    got = json.loads(P.OUT.read_text())
    assert len(seeds) == 20 and got["n_images"] == y.size == 1715
    d = P.describe(y, A, B, seeds, n_boot=0)
    c = got["all_seeds"]
    assert d["per_seed"] == pytest.approx(c["per_seed"]) and d["diff"] == pytest.approx(c["diff"])
    assert (d["t_low"], d["t_high"]) == pytest.approx((c["t_low"], c["t_high"]))
    assert c["n_boot"] == P.N_BOOT and c["ci_low"] < c["diff"] < c["ci_high"]
    assert "no verdict" in got["what"] and "verdict" not in c
