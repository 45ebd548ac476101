"""The α plans of the confirmatory protocols (``studies/confirmatory/alpha_plan.py``): the fallback procedure's levels
by hand, its family-wise error rate by simulation under the global null, the committed plans, and the rules a plan
must keep (a broken plan is refused in one line naming its file)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from studies.confirmatory.alpha_plan import (PlanError, fallback_levels, find_test, load_plan, require_test, run_sequence,
                                             succeeds)

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
    # the fallback primary PROTOCOL.md states (no lever adopted), and the thresholds it fixed: none left open
    assert (p4["tests"][0]["hypothesis"], p4["tests"][0]["margin"]) == ("non-inferiority", 0.02)
    assert (p4["tests"][0]["a"], p4["tests"][0]["b"]) == ("ohfl", "fedavg")
    assert {t["id"]: t.get("threshold") for t in p4["tests"] if "threshold" in t} == {
        "sensitivity": 0.9, "specificity": 0.5, "operating_point_efficiency": 0.93, "refusal_rate": 0.167,
        "border_probe": 0.05, "metadata_margin": 0.0}
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


def test_succeeds_reads_each_hypothesis_from_its_bound():
    sup = {"id": "p", "hypothesis": "superiority"}
    ni = {"id": "n", "hypothesis": "non-inferiority", "margin": 0.02}
    least = {"id": "s", "hypothesis": "at_least", "threshold": 0.9}
    most = {"id": "r", "hypothesis": "at_most", "threshold": 0.2}
    within = {"id": "b", "hypothesis": "within", "threshold": 0.05}
    assert succeeds(sup, 0.001, 0.03) and not succeeds(sup, -0.001, 0.03)
    assert succeeds(ni, -0.019, 0.01) and not succeeds(ni, -0.021, 0.01)
    assert succeeds(least, 0.91, 0.99) and not succeeds(least, 0.89, 0.99)
    assert succeeds(most, 0.0, 0.19) and not succeeds(most, 0.0, 0.21)
    assert succeeds(within, -0.04, 0.04) and not succeeds(within, -0.06, 0.01) and not succeeds(within, -0.01, 0.06)
    assert not succeeds(sup, None, None)  # no reliable interval shows nothing
    with pytest.raises(PlanError, match="threshold is null"):
        succeeds({"id": "e", "hypothesis": "at_least", "threshold": None}, 0.95, 0.99)


def test_run_sequence_passes_a_level_on_only_after_a_success():
    """Normal intervals with known standard errors, worked out by hand from the normal quantiles: the primary
    succeeds at 0.03 (lower bound 0.03 - 2.170 x 0.01 > 0), so the second is tested at 0.04 and fails (0.905 -
    2.054 x 0.01 < 0.90); the third is then tested at its own 0.01, where +-2.576 x 0.0205 = +-0.053 leaves the
    +-0.05 band, although at the 0.02 a wrongly passed-on level would give (+-2.326 x 0.0205 = +-0.048) it would
    succeed."""
    from scipy import stats

    plan = {"procedure": "fallback", "tests": [
        {"id": "primary", "hypothesis": "superiority", "alpha": 0.03},
        {"id": "sens", "hypothesis": "at_least", "threshold": 0.9, "alpha": 0.01},
        {"id": "border", "hypothesis": "within", "threshold": 0.05, "alpha": 0.01}]}
    est = {"primary": (0.03, 0.01), "sens": (0.905, 0.01), "border": (0.0, 0.0205)}
    asked = []

    def interval_at(t, a):
        asked.append((t["id"], a))
        m, se = est[t["id"]]
        h = stats.norm.ppf(1 - a / 2) * se
        return {"estimate": m, "ci_low": m - h, "ci_high": m + h}

    out = run_sequence(plan, interval_at)
    assert [r["succeeded"] for r in out] == [True, False, False]
    assert [a for _, a in asked] == pytest.approx([0.03, 0.04, 0.01])
    assert [r["level"] for r in out] == pytest.approx(fallback_levels([0.03, 0.01, 0.01], [True, False]))
    est["sens"] = (0.93, 0.01)  # now the second succeeds and passes 0.04 on: the third at 0.05 succeeds
    asked.clear()
    assert [r["succeeded"] for r in run_sequence(plan, interval_at)] == [True, True, True]
    assert [a for _, a in asked] == pytest.approx([0.03, 0.04, 0.05])
    with pytest.raises(PlanError, match="fallback plan only"):
        run_sequence({**plan, "procedure": "single"}, interval_at)
