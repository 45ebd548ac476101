"""The α plans of the confirmatory protocols (``studies/confirmatory/alpha_plan.py``): the fallback procedure's levels
by hand, its family-wise error rate by simulation under the global null, the committed plans, and the rules a plan
must keep (a broken plan is refused in one line naming its file)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from studies.confirmatory.alpha_plan import PlanError, fallback_levels, find_test, load_plan, require_test

PROTOCOLS = Path(__file__).resolve().parents[1] / "studies" / "confirmatory" / "protocols"
SHARES = [0.025] + [0.003125] * 8


def test_fallback_levels_by_hand():
    assert fallback_levels([0.03, 0.01, 0.01], [True, True]) == pytest.approx([0.03, 0.04, 0.05])
    assert fallback_levels([0.03, 0.01, 0.01], [False, True]) == pytest.approx([0.03, 0.01, 0.02])
    assert fallback_levels([0.03, 0.01, 0.01], [True, False, True]) == pytest.approx([0.03, 0.04, 0.01])
    assert fallback_levels([0.05, 1e-9], [False]) == pytest.approx([0.05, 1e-9])  # the fixed sequence's limit
    with pytest.raises(ValueError, match="need the outcomes"):
        fallback_levels([0.03, 0.01, 0.01], [True])


@pytest.mark.parametrize("rho", [0.0, 0.5, 1.0])
def test_the_fallback_plan_holds_the_family_wise_error_at_its_total(rho):
    """Every hypothesis true (p uniform), the nine tests independent, correlated or identical: the share of
    simulated families with at least one rejection stays at or under 0.05 (Wiens 2003). The α/K rule over three
    looks, for contrast, spends more than 0.05."""
    from scipy import stats

    rng = np.random.default_rng(0)
    n = 200_000
    z = np.sqrt(rho) * rng.standard_normal((n, 1)) + np.sqrt(1 - rho) * rng.standard_normal((n, len(SHARES)))
    p = stats.norm.sf(z)  # one-sided p, uniform under the null
    level = np.zeros(n)
    any_rej = np.zeros(n, bool)
    prev = np.zeros(n, bool)
    for i, a in enumerate(SHARES):
        level = a + np.where(prev, level, 0.0) if i else np.full(n, a)
        prev = p[:, i] < level
        any_rej |= prev
    fwer = any_rej.mean()
    assert fwer <= 0.05 + 3 * np.sqrt(0.05 * 0.95 / n)
    if rho == 0.0:  # independent tests: the budget is nearly all used, not wasted
        assert fwer >= 0.045
    assert 0.05 * (1 + 1 / 2 + 1 / 3) > 0.09  # the replaced rule: three looks at 0.05 / K spend 0.092


def test_the_committed_plans_load_and_protocol_4_spends_0_05_in_its_order():
    plans = {p.parent.name: load_plan(p) for p in sorted(PROTOCOLS.glob("*/alpha_plan.json"))}
    assert set(plans) == {"confirmatory", "confirmatory_300", "confirmatory_10seeds", "protocol4"}
    p4 = plans["protocol4"]
    assert p4["procedure"] == "fallback" and p4["total_alpha"] == 0.05 and not p4["exploratory_verdicts"]
    ids = [t["id"] for t in p4["tests"]]
    assert ids == ["primary", "sensitivity", "specificity", "operating_point_efficiency", "refusal_rate",
                   "border_probe", "metadata_margin", "vs_local_ft", "vs_pooled_reference"]
    assert [t["alpha"] for t in p4["tests"]] == pytest.approx(SHARES)
    assert p4["tests"][0]["hypothesis"] == "superiority" and (p4["tests"][0]["a"], p4["tests"][0]["b"]) == \
        ("ohfl", "fedavg")
    assert plans["confirmatory_10seeds"]["tests"][0]["looks"] == 2
    assert find_test(plans["confirmatory"], "ohfl", "local", "auc")["alpha"] == 0.05


def _write(tmp_path, **change):
    plan = json.loads((PROTOCOLS / "protocol4" / "alpha_plan.json").read_text())
    plan.update(change)
    f = tmp_path / "alpha_plan.json"
    f.write_text(json.dumps(plan))
    return f, plan


@pytest.mark.parametrize("change, says", [
    ({"schema": "other"}, "not an α plan"),
    ({"total_alpha": 0.5 * 3}, "total_alpha 1.5 not in (0, 1)"),
    ({"procedure": "holm"}, "procedure 'holm' not one of"),
    ({"tests": []}, "no tests listed"),
])
def test_a_broken_plan_is_refused_naming_its_file(tmp_path, change, says):
    f, _ = _write(tmp_path, **change)
    with pytest.raises(PlanError, match=str(f).replace("\\", "\\\\")) as e:
        load_plan(f)
    assert says in str(e.value)


def test_shares_that_overspend_or_a_bad_test_are_refused(tmp_path):
    f, plan = _write(tmp_path)
    plan["tests"][1]["alpha"] = 0.01
    f.write_text(json.dumps(plan))
    with pytest.raises(PlanError, match="shares sum to 0.056875, not total_alpha 0.05"):
        load_plan(f)
    plan["tests"][1]["alpha"] = 0.003125
    plan["tests"][2]["id"] = "primary"
    f.write_text(json.dumps(plan))
    with pytest.raises(PlanError, match="unique id"):
        load_plan(f)
    plan["tests"][2]["id"] = "specificity"
    del plan["tests"][7]["margin"]
    f.write_text(json.dumps(plan))
    with pytest.raises(PlanError, match="vs_local_ft: a non-inferiority test needs its margin"):
        load_plan(f)
    with pytest.raises(PlanError, match="no α plan"):
        load_plan(tmp_path / "none.json")


def test_a_test_the_plan_does_not_list_is_refused():
    f = PROTOCOLS / "protocol4" / "alpha_plan.json"
    plan = load_plan(f)
    assert require_test(plan, f, "ohfl", "local", "auc")["id"] == "vs_local_ft"
    with pytest.raises(PlanError, match="lists no test of ohfl vs fedavg on balanced_accuracy") as e:
        require_test(plan, f, "ohfl", "fedavg", "balanced_accuracy")
    assert "a test the plan does not list is refused" in str(e.value)
