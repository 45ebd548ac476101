"""False-verdict rates of the intervals of ``hfl_components.stats`` in simulated paired comparisons with a known
answer (the simulation of ``tests/test_stats_coverage.py``, printed as a table for ``RESULTS.md``).

    python -m studies.statistics.coverage
"""
from __future__ import annotations

from collections import Counter

from hfl_components.stats import MARGINS, verdict
from tests.test_stats_coverage import N, R, STUDIES, false_rate, simulate


def main() -> None:
    print(f"{STUDIES} studies per row, {N} shared images, {R} bootstrap replicates; nominal false-verdict rate 5%")
    print("| seeds | sd image effect | cluster bootstrap-t | seed-level t (these images) | seed-level t (new images) "
          "| percentile |")
    print("|---|---|---|---|---|---|")
    for S, sc in ((3, 0.0), (5, 0.0), (10, 0.0), (5, 0.1), (10, 0.1)):
        sim = simulate(S, sd_image=sc, seed=S + int(sc * 10))
        print(f"| {S} | {sc} | {100 * false_rate(*sim['cluster'], 0.0):.1f}% | "
              f"{100 * false_rate(*sim['seed_t'], sim['cond']):.1f}% | {100 * false_rate(*sim['seed_t'], 0.0):.1f}% | "
              f"{100 * false_rate(*sim['percentile'], 0.0):.1f}% |")
    d = MARGINS["balanced_accuracy"]
    for name, kw in (("true difference -δ (non-inferiority false)", dict(mu=-d, sd_image=0.05, seed=7)),
                     ("true difference +0.06 (superiority true)", dict(mu=0.06, sd_image=0.05, seed=8)),
                     ("true difference 0, seed sd 0.01 (non-inferiority true)", dict(mu=0.0, sd_seed=0.01, seed=9))):
        lo, hi = simulate(5, **kw)["cluster"]
        c = Counter(verdict(a, b, d) for a, b in zip(lo, hi))
        print(f"5 seeds, {name}: " + ", ".join(f"{k} {100 * v / STUDIES:.1f}%" for k, v in c.most_common()))


if __name__ == "__main__":
    main()
