"""External validation of a run's saved models (``cxr-hfl evaluate``) and prediction on unlabelled images
(``cxr-hfl predict``).

``evaluate_run`` loads every model the run's index ``models.json`` lists (``models/<site>_deployed.pt``,
``models/<site>_local.pt``, ``global_model.pt`` at each input size the run's sites used; each file checked against
its SHA-256, :mod:`nvflare_jobs.models_index`), evaluates it on an external labelled set at the
model's own input size with :func:`hfl_components.training.compute_metrics` (the same metrics as the sites' test
splits, argmax decision) and, for binary labels, again at the decision threshold chosen (Youden's J) on the
validation split of the model's own site (the global model: all sites' validation splits pooled).

Each evaluated data set has its own folder ``RUN/external/<name>/`` (:func:`external_name`: the data set's folder or
CSV name, plus ``-<part>`` for a committed part of ``chest_xray_224``, see :mod:`chest_xray.splits`), holding one
JSON per model, ``summary.json`` and ``predictions.npz`` (every model's per-image probabilities, for paired
comparisons). The global model has no input size of its own: it is scored at every site's input size and the
headline ``global`` entry is the mean over sites (no size is chosen on the test set).

Leakage guards: :func:`training_overlap` compares the external set's file names and patient ids with every row of
the run's site manifests; ``evaluate_run`` refuses an overlapping set unless ``force=True``. The probe is never
scored: every image of the probe pool the run's OHFL server was given (:func:`probe_pool`: a folder, a probe CSV, or
the committed ``probe`` part) is left out, and ``summary.json`` records how many as ``probe_images_excluded``.
"""
from nvflare_jobs.evaluation.run_folder import (  # the public face; the parts: run_folder, evaluate, predict
    LeakageError,
    list_run_models,
    load_model_file,
    model_aspect,
    probe_overlap,
    probe_pool,
    run_input_sizes,
    run_labels,
    run_manifests,
    run_metrics,
    run_site_sizes,
    site_rows,
    training_overlap,
)
from nvflare_jobs.evaluation.evaluate import (
    SUMMARY_METRICS,
    ProbCache,
    evaluate_run,
    external_name,
    global_site_mean,
    load_external,
    part_required,
)
from nvflare_jobs.evaluation.predict import check_predict_args, collect_files, predict_files
