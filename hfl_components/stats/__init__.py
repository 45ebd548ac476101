"""Statistics of method comparisons: seeds as clusters, images as the design says, and the reporting rule.

Pure numpy / scipy (``scipy.stats`` for the t quantiles). Every reporter (``cxr-hfl compare``, the site-model
evaluation of the personalised methods, the benchmarks and the report) goes through :mod:`.paired`:

* :func:`paired_crossed`: every seed and site scores the same images (pigeonhole bootstrap, Owen 2007);
* :func:`paired_nested`: each site scores its own images, pools drawn separately (Davison & Hinkley 1997, Sec. 3.8;
  Field & Welsh 2007);
* :func:`paired_summaries` / :func:`seed_mean_interval`: one value per (seed, site), seed-level t-interval;
* :func:`verdict`, :data:`MIN_SEEDS`, :data:`MARGINS`, :func:`paired_cell`, :func:`endpoint_label`: the rule.
"""
from hfl_components.stats.intervals import (cluster_t_interval, combine_seeds, draw_image_counts, draw_seed_counts,
                                            percentile_interval, seed_t_interval)
from hfl_components.stats.metrics import (PAIRED_METRICS, SITE_METRICS, WeightedAUC, binary_metric_rows, site_metric,
                                          weighted_auc)
from hfl_components.stats.paired import (MARGINS, MIN_SEEDS, RULE_TEXT, VERDICTS, endpoint_label, margin_for,
                                         paired_cell, paired_crossed, paired_nested, paired_summaries,
                                         per_seed_text, seed_mean_interval, verdict, verdict_cell)

__all__ = ["MARGINS", "MIN_SEEDS", "PAIRED_METRICS", "RULE_TEXT", "SITE_METRICS", "VERDICTS", "WeightedAUC",
           "binary_metric_rows", "cluster_t_interval", "combine_seeds", "draw_image_counts", "draw_seed_counts",
           "endpoint_label", "margin_for", "paired_cell", "paired_crossed", "paired_nested", "paired_summaries",
           "per_seed_text", "percentile_interval", "seed_mean_interval", "seed_t_interval", "site_metric", "verdict",
           "verdict_cell", "weighted_auc"]
