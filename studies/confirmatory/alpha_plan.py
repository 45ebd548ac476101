"""The error budget of a confirmatory protocol, fixed in advance: its α plan (``alpha_plan.json`` beside
``PROTOCOL.md``), read by the analysis, which refuses any test the plan does not list.

A plan names one family of tests, its total two-sided α and how that α is spent:

* ``fallback`` (Wiens 2003, *A fixed sequence Bonferroni procedure for testing multiple endpoints*, Pharmaceutical
  Statistics 2:211-215; Wiens & Dmitrienko 2005, J Biopharm Stat 15:929-942): the hypotheses are tested in the plan's
  order; hypothesis i has its own share α_i (Σ α_i = the total) and is tested at
  ``level_i = α_i + level_{i-1}`` when hypothesis i-1 was rejected, else at ``α_i`` (``level_1 = α_1``). It holds the
  family-wise error rate at the total for any dependence between the tests, and reduces to the fixed sequence
  (gatekeeping: all α on the first, a later test only after every earlier one succeeded) when α_1 is the total.
* ``single``: one test at the total α (the plans transcribed from protocols 1 and 2).
* ``bonferroni-look``: one test at ``total / looks`` (transcribed from protocol 3, which tested a hypothesis for the
  ``looks``-th time). Kept so that protocol 3's analysis can be rerun; as a rule for a new family it is wrong: summed
  over K tests it spends ``total × (1 + 1/2 + ... + 1/K)``, which grows without bound.

A test at level ``a`` is read from the two-sided ``1 - a`` interval of its endpoint (superiority: lower bound > 0;
non-inferiority: lower bound > -margin; ``at_least``: lower bound > threshold; ``at_most``: upper bound < threshold;
``within``: both bounds inside ±threshold).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

SCHEMA = "cxr-hfl alpha plan 1"
PROCEDURES = ("fallback", "single", "bonferroni-look")
HYPOTHESES = ("superiority", "non-inferiority", "at_least", "at_most", "within")


class PlanError(ValueError):
    """A missing or malformed α plan, or a test it does not list; the message names the plan file."""


def load_plan(path: str | Path) -> dict:
    """The α plan at ``path``, checked: the schema, ``total_alpha`` in (0, 1), a known ``procedure``, tests with
    unique text ids, each with a known ``hypothesis``, an ``alpha`` in (0, total], the comparison (``a``, ``b``,
    ``metric``) of a paired test or the ``endpoint`` of a one-sample test, a finite ``margin`` > 0 for
    non-inferiority, a ``threshold`` that is null or a finite number (> 0 for ``within``); the shares sum to the
    total (``fallback``, ``single``) or each is ``total / looks`` (``bonferroni-look``).

    Raises:
        PlanError: no such file, not JSON, or any rule above broken (the message names the file and the rule).
    """
    path = Path(path)
    if not path.is_file():
        raise PlanError(f"{path}: no α plan (a protocol commits alpha_plan.json beside PROTOCOL.md before any test)")
    try:
        plan = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise PlanError(f"{path}: not readable as JSON ({e})") from None
    bad = _problems(plan)
    if bad:
        raise PlanError(f"{path}: {bad}")
    return plan


def _problems(plan) -> str | None:
    if not isinstance(plan, dict) or plan.get("schema") != SCHEMA:
        return f"not an α plan (schema {SCHEMA!r} expected)"
    total = plan.get("total_alpha")
    if not isinstance(total, (int, float)) or not 0 < total < 1:
        return f"total_alpha {total!r} not in (0, 1)"
    proc = plan.get("procedure")
    if proc not in PROCEDURES:
        return f"procedure {proc!r} not one of {', '.join(PROCEDURES)}"
    tests = plan.get("tests")
    if not isinstance(tests, list) or not tests:
        return "no tests listed"
    ids = [t.get("id") if isinstance(t, dict) else None for t in tests]
    if not all(isinstance(i, str) and i for i in ids) or len(set(ids)) != len(ids):
        return "every test needs a unique id (a non-empty text)"
    for t in tests:
        if t.get("hypothesis") not in HYPOTHESES:
            return f"test {t['id']}: hypothesis {t.get('hypothesis')!r} not one of {', '.join(HYPOTHESES)}"
        a = t.get("alpha")
        if not isinstance(a, (int, float)) or not 0 < a <= total:
            return f"test {t['id']}: alpha {a!r} not in (0, {total}]"
        if not (all(isinstance(t.get(k), str) for k in ("a", "b", "metric")) or isinstance(t.get("endpoint"), str)):
            return f"test {t['id']}: names neither a comparison (a, b, metric) nor an endpoint"
        if t["hypothesis"] == "non-inferiority" and not _number(t.get("margin"), positive=True):
            return f"test {t['id']}: a non-inferiority test needs its margin, a finite number > 0, got {t.get('margin')!r}"
        thr = t.get("threshold")
        if thr is not None and not _number(thr, positive=t["hypothesis"] == "within"):
            return (f"test {t['id']}: threshold {thr!r} is neither null (fixed later in PROTOCOL.md) nor a finite "
                    f"number{' > 0' if t['hypothesis'] == 'within' else ''}")
    shares = [t["alpha"] for t in tests]
    if proc == "bonferroni-look":
        wrong = [t["id"] for t in tests if not isinstance(t.get("looks"), int) or t["looks"] < 2
                 or not math.isclose(t["alpha"], total / t["looks"])]
        if wrong:
            return f"test {wrong[0]}: a bonferroni-look test needs looks >= 2 and alpha = total_alpha / looks"
    elif not math.isclose(sum(shares), total, rel_tol=0, abs_tol=1e-12):
        return f"the tests' alpha shares sum to {sum(shares):g}, not total_alpha {total:g}"
    if proc == "single" and len(tests) != 1:
        return "a single plan lists exactly one test"
    return None


def _number(v, positive: bool = False) -> bool:
    """Whether ``v`` is a finite JSON number (not a boolean, not NaN / Infinity), and > 0 when ``positive``."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return ok and (v > 0 or not positive)


def find_test(plan: dict, a: str, b: str, metric: str) -> dict | None:
    """The plan's paired test of ``a`` against ``b`` on ``metric``, or None."""
    return next((t for t in plan["tests"] if (t.get("a"), t.get("b"), t.get("metric")) == (a, b, metric)), None)


def require_test(plan: dict, path: str | Path, a: str, b: str, metric: str) -> dict:
    """:func:`find_test`, refusing a test the plan does not list.

    Raises:
        PlanError: the plan lists no test of ``a`` vs ``b`` on ``metric`` (the message names the file and the tests
            it lists).
    """
    t = find_test(plan, a, b, metric)
    if t is None:
        listed = ", ".join(f"{x['id']} ({x.get('a', x.get('endpoint'))} vs {x.get('b', '-')}, {x.get('metric', '')})"
                           for x in plan["tests"])
        raise PlanError(f"{path}: the α plan lists no test of {a} vs {b} on {metric} (it lists {listed}); a test the "
                        "plan does not list is refused")
    return t


def fallback_levels(shares: list[float], rejected: list[bool]) -> list[float]:
    """The level of each hypothesis of a fallback sequence: ``level_1 = α_1``, ``level_i = α_i + level_{i-1}``
    when hypothesis i-1 was rejected, else ``α_i`` (Wiens 2003).

    Args:
        shares: (n,) α_i in the plan's order. rejected: the outcomes of the hypotheses before the last, in order
            (length n - 1 or n; the last outcome is not used).

    Returns:
        (n,) levels. Testing each hypothesis at its level holds the family-wise error rate at Σ α_i, whatever the
        dependence between the tests.

    Raises:
        ValueError: fewer than n - 1 outcomes, or a share not in (0, 1).
    """
    if len(rejected) < len(shares) - 1:
        raise ValueError(f"{len(shares)} hypotheses need the outcomes of the first {len(shares) - 1}")
    if any(not 0 < s < 1 for s in shares):
        raise ValueError("every alpha share must be in (0, 1)")
    levels: list[float] = []
    for i, s in enumerate(shares):
        levels.append(s + (levels[-1] if i and rejected[i - 1] else 0.0))
    return levels


def primary(plan: dict) -> dict:
    """The plan's first test (its primary endpoint)."""
    return plan["tests"][0]


def succeeds(test: dict, low: float | None, high: float | None) -> bool:
    """Whether the two-sided interval ``[low, high]`` of ``test``'s endpoint (read at the test's level) shows its
    hypothesis (the module's reading rule): ``superiority`` low > 0; ``non-inferiority`` low > -margin; ``at_least``
    low > threshold; ``at_most`` high < threshold; ``within`` -threshold < low and high < threshold. A missing bound
    (an endpoint without a reliable interval) shows nothing: False.

    Raises:
        PlanError: a one-sample test whose threshold is still null (the plan leaves it to ``PROTOCOL.md``; such a
            test is not run), or a non-inferiority test without its margin.
    """
    h = test["hypothesis"]
    if h in ("at_least", "at_most", "within") and not isinstance(test.get("threshold"), (int, float)):
        raise PlanError(f"test {test['id']}: its threshold is null; PROTOCOL.md fixes it before any run, and a test "
                        "whose threshold is open is not run")
    if h == "non-inferiority" and not isinstance(test.get("margin"), (int, float)):
        raise PlanError(f"test {test['id']}: a non-inferiority test needs its margin")
    if low is None or high is None:
        return False
    if h == "superiority":
        return low > 0
    if h == "non-inferiority":
        return low > -float(test["margin"])
    thr = float(test["threshold"])
    if h == "at_least":
        return low > thr
    if h == "at_most":
        return high < thr
    return -thr < low and high < thr


def run_sequence(plan: dict, interval_at) -> list[dict]:
    """Test a ``fallback`` plan's hypotheses in order, each at its level (:func:`fallback_levels`: the level of a
    hypothesis is its own share plus the previous level when the previous hypothesis was rejected).

    Args:
        plan: a plan from :func:`load_plan` whose procedure is ``fallback``.
        interval_at: ``interval_at(test, alpha) -> {"estimate", "ci_low", "ci_high", ...}``, the two-sided
            ``1 - alpha`` interval of the test's endpoint (None for an endpoint the runs do not provide). Called once
            per test, in the plan's order, only after the previous outcome is known.

    Returns:
        One record per test in the plan's order: ``{"id", "hypothesis", "share", "level", "estimate", "ci_low",
        "ci_high", "succeeded", ...}`` (the interval record's other keys kept).

    Raises:
        PlanError: the plan is not a fallback plan, or a test's threshold is null (:func:`succeeds`).
    """
    if plan.get("procedure") != "fallback":
        raise PlanError(f"procedure {plan.get('procedure')!r}: run_sequence tests a fallback plan only")
    out: list[dict] = []
    level = 0.0
    for i, t in enumerate(plan["tests"]):
        level = t["alpha"] + (level if i and out[-1]["succeeded"] else 0.0)
        iv = interval_at(t, level) or {}
        ok = succeeds(t, iv.get("ci_low"), iv.get("ci_high"))
        out.append({**iv, "id": t["id"], "hypothesis": t["hypothesis"], "share": t["alpha"], "level": level,
                    "estimate": iv.get("estimate"), "ci_low": iv.get("ci_low"), "ci_high": iv.get("ci_high"),
                    "succeeded": ok})
    return out
