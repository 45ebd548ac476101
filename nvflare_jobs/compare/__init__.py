"""``cxr-hfl compare``: every method on the identical partition, label scheme and seeds, at an equal epoch budget;
comparison tables, optionally on an external evaluation set with paired bootstrap CIs.

Layout of ``OUT``::

    OUT/seed<k>/partition/          one partition per seed (scanned and split once, reused by every method)
    OUT/seed<k>/<method>/           a run folder written by ``cxr-hfl simulate --profile`` (metrics.json, models...)
    OUT/seed<k>/<method>/external/<name>/   with --external: ``cxr-hfl evaluate`` of every saved model of the run
    OUT/comparison.csv              one row per (method, seed, site): the sites' own test splits
    OUT/comparison_external.csv     with --external: one row per (method, seed, model) on the external set
    OUT/comparison.md               budget, mean +- std, pooled CIs, per-site tables, paired differences
    OUT/compare.json                the command that ran (a ``--dry-run`` writes nothing) and the epoch budget of every method

**Equal budgets (default).** Every method trains the same number of epochs per site, E = OHFL's local epochs +
fine-tuning epochs (``--local-epochs`` L, default 20, ``--finetune-epochs`` F, default 10): Local (and ``local+ft``,
the same control under equal budgets) trains one run of E epochs; FedAvg and the prototype methods run R rounds of
E / R local epochs (``--rounds`` R must divide E; default 2 epochs per round for FedAvg, 3 for the prototype
methods, or the largest divisor of E below that); OHFL trains L local epochs, fuses, and fine-tunes F epochs.
``--unequal-budgets`` restores each method's own defaults (``--rounds`` and ``--local-epochs`` are then passed
through as they are), and the budget table says so.

**External evaluation.** ``--external DIR`` (optionally ``--part evaluation`` of ``chest_xray_224``) evaluates every
saved model of every run (each site's deployed and, for OHFL, pre-fusion local model, and the global model at each
site's size) with :func:`nvflare_jobs.evaluation.evaluate_run`, which leaves out the OHFL probe pool. The
endpoints are each site's deployed-model AUC and balanced accuracy on that set; the paired differences (same seed,
same site) against ``local+ft`` and against FedAvg carry 95% intervals with seeds as clusters and one shared image
draw (:func:`hfl_components.stats.paired_crossed`) and, from :data:`hfl_components.stats.MIN_SEEDS` seeds on, a
verdict; the deployed models' AUC against local+ft is the primary endpoint, every other verdict exploratory.

A method may carry extra ``simulate`` options as a variant, ``ohfl:strategy=cdd`` (benchmarks use this).
Resumable: a run whose ``metrics.json`` exists is not run again, nor an external evaluation already written.
"""
from nvflare_jobs.compare.plan import (  # the public face; the parts: plan, run, tables
    COMPARE_DEFAULTS,
    CONTROL,
    METHODS,
    CompareOptions,
    PROTO,
    BudgetError,
    budget_lines,
    check_variant,
    command_for,
    epoch_plan,
    proto_protocol,
    simulate_options,
    split_variant,
)
from nvflare_jobs.compare.run import (
    command_line,
    compare,
    evaluate_external,
    prepare_partition,
    probe_part_csv,
    record_command,
    relative,
    run_compare,
    write_method_profile,
)
from nvflare_jobs.compare.tables import (
    COLUMNS,
    EXT_COLUMNS,
    METRICS,
    method_order,
    collect_runs,
    comparison_markdown,
    comparison_rows,
    control_method,
    external_markdown,
    external_tables,
    load_external,
    paired_diff,
    val_threshold_metrics,
    write_tables,
)
