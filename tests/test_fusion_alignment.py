"""DP layer alignment (OHFL Sec. 3.1): known optimum (brute force), monotone, pinned ends, type constraints,
deterministic ties, and the random-alignment ablation."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from hfl_components.fusion import align_layers, map_cost

# cnn shallow (3 convs in 3 stages + 2 fc) vs cnn deep (stages [1, 2, 2] + 4 fc)
SHALLOW = (["conv", "conv", "conv", "fc", "fc"], [0, 1, 2, -1, -1])
DEEP = (["conv", "conv", "conv", "conv", "conv", "fc", "fc", "fc", "fc"], [0, 1, 1, 2, 2, -1, -1, -1, -1])


def brute_force(cost, ks, ss, kd, sd):
    """All feasible maps from the (shallower) rows into the columns, by enumeration."""
    mu, nu = len(ks), len(kd)
    maps = []
    for cols in itertools.combinations(range(nu), mu):
        if cols[0] != 0 or cols[-1] != nu - 1:
            continue
        if all(ks[i] == kd[j] and (ks[i] == "fc" or ss[i] == sd[j]) for i, j in enumerate(cols)):
            maps.append((sum(cost[i, j] for i, j in enumerate(cols)), cols))
    return maps


def test_dp_finds_known_optimum_of_constructed_cost():
    # zero cost on one chosen feasible map, 1 elsewhere: the DP must return exactly that map
    target = [0, 2, 4, 6, 8]
    cost = np.ones((5, 9))
    for i, j in enumerate(target):
        cost[i, j] = 0.0
    pairs = align_layers(cost, *SHALLOW, *DEEP)
    assert pairs == list(enumerate(target))
    assert map_cost(cost, pairs) == 0.0


@pytest.mark.parametrize("seed", range(20))
def test_dp_matches_brute_force_on_random_costs(seed):
    cost = np.random.default_rng(seed).random((5, 9))
    pairs = align_layers(cost, *SHALLOW, *DEEP)
    maps = brute_force(cost, *SHALLOW, *DEEP)
    assert len(maps) == 2 * 2 * 3  # stage 1: 2 choices, stage 2: 2, fc: first fc onto one of 3 (last pinned)
    best = min(c for c, _ in maps)
    assert map_cost(cost, pairs) == pytest.approx(best, abs=1e-12)
    cols = [j for _, j in pairs]
    assert [i for i, _ in pairs] == list(range(5))
    assert all(b > a for a, b in zip(cols, cols[1:]))  # strictly increasing
    assert cols[0] == 0 and cols[-1] == 8  # pinned first / last hidden layer
    for i, j in pairs:  # conv->conv of the same stage, fc->fc
        assert SHALLOW[0][i] == DEEP[0][j] and (SHALLOW[0][i] == "fc" or SHALLOW[1][i] == DEEP[1][j])


def test_dp_deeper_source_returns_pairs_in_source_target_orientation():
    cost = np.random.default_rng(7).random((9, 5))
    pairs = align_layers(cost, *DEEP, *SHALLOW)
    assert [j for _, j in pairs] == list(range(5))  # every target (shallower) layer once
    best = min(c for c, _ in brute_force(cost.T, *SHALLOW, *DEEP))
    assert map_cost(cost, pairs) == pytest.approx(best, abs=1e-12)


def test_dp_ties_are_deterministic_and_equal_layouts_give_identity():
    ks, ss = ["fc"] * 3, [-1] * 3
    kd, sd = ["fc"] * 5, [-1] * 5
    pairs = align_layers(np.zeros((3, 5)), ks, ss, kd, sd)
    assert pairs == [(0, 0), (1, 1), (2, 4)]  # ties go to the earliest predecessor
    assert align_layers(np.zeros((3, 5)), ks, ss, kd, sd) == pairs
    c = np.random.default_rng(0).random((9, 9))
    assert align_layers(c, *DEEP, *DEEP) == [(i, i) for i in range(9)]


def test_dp_rejects_infeasible_layouts_and_bad_input():
    # deeper overall but fewer convs in stage 0: no map respects the stages
    with pytest.raises(ValueError, match="no feasible"):
        align_layers(np.zeros((3, 4)), ["conv", "conv", "fc"], [0, 0, -1], ["conv", "fc", "fc", "fc"], [0, -1, -1, -1])
    with pytest.raises(ValueError, match="shape"):
        align_layers(np.zeros((4, 9)), *SHALLOW, *DEEP)
    with pytest.raises(ValueError, match="non-finite"):
        align_layers(np.full((5, 9), np.nan), *SHALLOW, *DEEP)
    with pytest.raises(ValueError):
        align_layers(np.zeros((5, 9)), *SHALLOW, *DEEP, method="greedy")


def test_random_alignment_respects_constraints_and_covers_all_feasible_maps():
    feasible = {cols for _, cols in brute_force(np.zeros((5, 9)), *SHALLOW, *DEEP)}
    seen = set()
    for seed in range(300):
        pairs = align_layers(None, *SHALLOW, *DEEP, method="random", seed=seed)
        cols = tuple(j for _, j in pairs)
        assert cols in feasible
        seen.add(cols)
    assert seen == feasible
    assert align_layers(None, *SHALLOW, *DEEP, method="random", seed=5) == \
        align_layers(None, *SHALLOW, *DEEP, method="random", seed=5)
