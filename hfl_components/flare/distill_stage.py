"""OHFL's server stage after fusion: one student per architecture group, taught by the ensemble of every upload.

No NVFlare here: the controller (``controllers.ohfl``) passes the uploads, the fused models and the probe images,
and this module only decides who is whose student and calls the pure functions of
:mod:`hfl_components.fusion.distill` / :mod:`hfl_components.fusion.datafree`. Tests call it without a federation.

Architecture groups (:func:`architecture_groups`): a fusable family (``cnn``, ``vgg11``) is one group whatever the
depths and widths of its sites (OT fusion joins them into one model); any other family is one group per distinct
spec (a DenseNet site and a DenseNet of another block layout need different global models). Each site receives the
global model of its group.

Students (:func:`initial_students`): a fusable group with two or more uploads starts from its fused model; any other
group with an upload starts from its largest site's model (most training samples, ties by name); a group with no
upload (its sites failed before uploading) starts from a fresh model of its spec. Teachers are every usable
upload, whatever its family.

Teacher (:data:`TEACHERS`, the catalogue option ``distill_teacher``): ``average``, the uploads' weighted ensemble, or
``stacked``, a learned combination of the same uploads (:func:`stacked_teacher`: a cross-fitted logistic-regression
stacker fitted on the probe images' public labels, :func:`probe_labels`). Both use only what the server already
holds (the uploads, the public probe); nothing more leaves a site.

Feature distillation (catalogue options ``distill_feature_weight``, off at 0, and ``distill_feature_layer``): beside
the logit loss, the student's similarity structure of a hidden layer (or of every hidden layer, paired with the
uploads' by OHFL's CKA + DP alignment) on each probe batch is taught by the teachers'
(:mod:`hfl_components.fusion.feature_distill`, Tung & Mori 2019), each teacher's layers computed once at its own
input size. Server-side only: it reads the same uploads and probe, so nothing more leaves a site either.
"""
from __future__ import annotations

import hashlib
import json

# torch and the model registry are imported where they are used: the OHFL controller imports this module's
# constants, and its import stays free of torch (the server starts its workflow sooner)

NO_PROBE = "none"  # the probe option's value for "this server holds no public images"


# Wall-clock caps of the server's distillation (each architecture group): the probe loop and the data-free loop.
# Safety nets for an overloaded server, far above a quiet machine's time for the default budget (a run that hits one
# says so in its record: distillation.<group>.stopped = "time").
DISTILL_MAX_SECONDS = 300.0
DATA_FREE_MAX_SECONDS = 300.0


def check_probe_or_data_free(probe, data_free, distill_steps) -> None:
    """Refuse a job with no probe pool (``probe == "none"``) whose distillation is not data-free.

    Args:
        probe: the probe option; data_free: the data-free option; distill_steps: the distillation steps (resolved:
            the catalogue owns the default).

    Raises:
        ValueError: one line naming the options (``option 'data_free'``, ``option 'probe'``).
    """
    if str(probe) == NO_PROBE and not data_free and int(distill_steps) > 0:
        raise ValueError("OHFL: no probe pool (option 'probe' none) and option 'data_free' is off: turn on "
                         "option 'data_free' (distil on generator images) or give option 'probe' DIR (public images)")


TEACHERS = ("average", "stacked")  # the distillation's teacher: the uploads' weighted average, or a learned stacker


def check_teacher(teacher, probe, data_free, augment) -> None:
    """Refuse a learned (``stacked``) teacher where it cannot be fitted: it needs the labels of a real probe pool
    (not ``generated`` / ``none``, not data-free) and fixed targets per image (no distillation augmentation).

    Raises:
        ValueError: one line naming the options (``option 'distill_teacher'`` and the one in conflict).
    """
    if str(teacher) not in TEACHERS:
        raise ValueError(f"OHFL: option 'distill_teacher' must be one of {TEACHERS}, got {teacher!r}")
    if str(teacher) != "stacked":
        return
    if str(probe) in ("generated", NO_PROBE) or data_free:
        raise ValueError("OHFL: option 'distill_teacher' stacked is fitted on the labels of a public probe pool: give "
                         "option 'probe' a probe CSV with a label column (or the chest_xray_224 folder), not "
                         f"{probe!r}" + (", and turn option 'data_free' off" if data_free else ""))
    if augment:
        raise ValueError("OHFL: option 'distill_teacher' stacked labels each probe image once; turn option "
                         "'distill_augment' off")


# the hidden layers feature distillation can read (hfl_components.fusion.feature_distill.FEATURE_LAYERS, restated
# here so that this module's import stays free of torch; a test keeps the two and the catalogue's choices equal)
FEATURE_LAYERS = ("penultimate", "aligned")


def check_feature(weight, layer, data_free, augment, distill_steps=None) -> None:
    """Refuse feature distillation (``distill_feature_weight`` > 0) where it cannot run: a negative or non-finite
    weight, a layer that is not one of :data:`FEATURE_LAYERS`, data-free
    distillation (no fixed images to cache the teachers' layers on), distillation augmentation (the layers are
    cached for the original images) or, when ``distill_steps`` is given, no distillation at all (0 steps, e.g.
    ``paper``: the weight would never act). Weight 0 (the logit-only loss) needs nothing.

    Raises:
        ValueError: one line naming the option (``option 'distill_feature_weight'`` / ``'distill_feature_layer'``)
        and the one in conflict.
    """
    import math

    try:
        w = float(weight)
    except (TypeError, ValueError):
        w = math.nan
    if not 0.0 <= w < math.inf:
        raise ValueError(f"OHFL: option 'distill_feature_weight' must be a finite number >= 0, got {weight!r}")
    if str(layer) not in FEATURE_LAYERS:
        raise ValueError(f"OHFL: option 'distill_feature_layer' must be one of {FEATURE_LAYERS}, got {layer!r}")
    if w > 0 and data_free:
        raise ValueError("OHFL: option 'distill_feature_weight' > 0 distils the teachers' layers on the probe "
                         "images; turn option 'data_free' off (or give weight 0)")
    if w > 0 and augment:
        raise ValueError("OHFL: option 'distill_feature_weight' > 0 caches the teachers' layers of the original "
                         "probe images; turn option 'distill_augment' off (or give weight 0)")
    if w > 0 and distill_steps is not None and int(distill_steps) == 0:
        raise ValueError(f"OHFL: option 'distill_feature_weight' {weight} is a term of the distillation, and option "
                         "'distill_steps' is 0 (no distillation; option 'paper' sets it): give option 'distill_steps' "
                         "> 0 (or weight 0)")


def check_run(spec) -> None:
    """The OHFL catalogue entry's check of a resolved run (``nvflare_jobs.spec.RunSpec``): a probe pool or
    data-free distillation (:func:`check_probe_or_data_free`), a teacher that can be fitted
    (:func:`check_teacher`), feature distillation that can run (:func:`check_feature`) and a fusion order that fits
    the strategy (``hfl_components.fusion.aggregate.check_fusion_order``), so that ``simulate`` and ``compare``
    refuse them before anything is scanned or trained. Raises ValueError naming the options."""
    o = spec.options
    check_probe_or_data_free(o.get("probe"), o["data_free"], o["distill_steps"])
    check_teacher(o["distill_teacher"], o.get("probe"), o["data_free"], o["distill_augment"])
    check_feature(o["distill_feature_weight"], o["distill_feature_layer"], o["data_free"], o["distill_augment"],
                  o["distill_steps"])
    from hfl_components.fusion.aggregate import check_fusion_order  # imports torch: only when a run is checked

    check_fusion_order(o["strategy"], o["fusion_order"])


def probe_labels(source, names: list[str], labels: str) -> list[int]:
    """The public labels of the probe images the server loaded, in their batch order.

    Args:
        source: the probe option: a probe CSV (columns ``path`` and ``label``; ``subtype`` for the subtype scheme)
            or the ``chest_xray_224`` folder (its committed probe part's labels).
        names: file names of the loaded images, in batch order (``record["probe"]["files"]``).
        labels: the job's label scheme (``binary`` | ``subtype``).

    Returns:
        [class index] per name (``chest_xray.CLASS_NAMES[labels]``).

    Raises:
        ValueError: the source has no labels (a plain folder, a CSV without the column), a file name that is not in
        it or is listed twice, or a label outside the scheme, naming the source and the file.
    """
    import csv
    from pathlib import Path

    from chest_xray import CLASS_NAMES

    p = Path(str(source))
    col = "label" if labels == "binary" else labels
    if p.is_dir() and p.name == "chest_xray_224":
        from chest_xray.splits import split_rows

        rows = split_rows("probe")
    elif p.is_file() and p.suffix.lower() == ".csv":
        with p.open(newline="", encoding="utf-8-sig") as f:
            rows = list(csv.DictReader(f))
    else:
        raise ValueError(f"OHFL probe {str(source)!r} carries no labels: the stacked teacher needs a probe CSV with "
                         f"a {col!r} column or the chest_xray_224 folder")
    if rows and col not in rows[0]:
        raise ValueError(f"OHFL probe {str(source)!r}: no {col!r} column for the stacked teacher (has {sorted(rows[0])})")
    by_name: dict[str, str] = {}
    for r in rows:
        n = Path(r["path"]).name
        if n in by_name:
            raise ValueError(f"OHFL probe {str(source)!r}: file name {n!r} is listed twice; its label is ambiguous")
        by_name[n] = r[col].strip()
    classes = CLASS_NAMES[labels]
    out = []
    for n in names:
        if by_name.get(n) not in classes:
            raise ValueError(f"OHFL probe {str(source)!r}: image {n!r} has label {by_name.get(n)!r}, not one of "
                             f"{classes}")
        out.append(classes.index(by_name[n]))
    return out


def check_buildable(site_specs: dict[str, dict]) -> None:
    """Refuse a federation holding a site whose model the server cannot build (before any site trains).

    Args:
        site_specs: {site: model spec}.

    Raises:
        ValueError: one line naming the site, its family and why (unknown family, bad keys or sizes).
    """
    from hfl_components.models import validate_spec

    for site, spec in sorted(site_specs.items()):
        fam = spec.get("family") if isinstance(spec, dict) else None
        try:
            validate_spec(spec)
        except (ValueError, TypeError) as e:
            raise ValueError(f"OHFL: site {site}: the server cannot build model family {fam!r}, so it could neither "
                             f"distil nor send a global model for it ({e})") from None


def _spec_key(spec: dict) -> str:
    return hashlib.sha1(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:6]


def architecture_groups(site_specs: dict[str, dict]) -> dict[str, str]:
    """{site: group key}: the family name for fusable families; for any other family the family name when all its
    sites share one spec, else ``<family>-<6 hex digits of the spec>`` per distinct spec."""
    from hfl_components.models import is_fusable

    out: dict[str, str] = {}
    by_fam: dict[str, set] = {}
    for site, spec in site_specs.items():
        if not is_fusable(spec):
            by_fam.setdefault(spec["family"], set()).add(_spec_key(spec))
    for site, spec in site_specs.items():
        fam = spec["family"]
        out[site] = fam if is_fusable(spec) or len(by_fam[fam]) == 1 else f"{fam}-{_spec_key(spec)}"
    return out


def fusable_groups(groups: dict[str, str], uploads: dict[str, dict]) -> dict[str, list[str]]:
    """{group: [sites with an upload]} of the fusable groups with at least two uploads (the ones OT fusion joins)."""
    from hfl_components.models import is_fusable

    out: dict[str, list[str]] = {}
    for site, g in groups.items():
        if site in uploads and is_fusable(uploads[site]["spec"]):
            out.setdefault(g, []).append(site)
    return {g: sorted(s) for g, s in out.items() if len(s) >= 2}


def initial_students(groups: dict[str, str], site_specs: dict[str, dict], uploads: dict[str, dict],
                     fused: dict[str, tuple[dict, dict]]) -> dict[str, dict]:
    """The student of every group before distillation.

    Args:
        groups: {site: group} (:func:`architecture_groups`), every site of the job.
        site_specs: {site: spec} of every site (a group without uploads is built from it).
        uploads: {site: {"spec", "state_dict", "n_samples", ...}} of the usable uploads.
        fused: {group: (spec, state_dict)} of the groups OT fusion joined.

    Returns:
        {group: {"spec", "state_dict" (None for a fresh model), "start": "fusion" | "site <name>" | "fresh",
        "sites": [sites of the group]}}.
    """
    out = {}
    for g in sorted(set(groups.values())):
        sites = sorted(s for s, k in groups.items() if k == g)
        have = [s for s in sites if s in uploads]
        if g in fused:
            spec, sd = fused[g]
            start = "fusion"
        elif have:
            best = max(have, key=lambda s: (float(uploads[s]["n_samples"]), s))
            spec, sd, start = uploads[best]["spec"], uploads[best]["state_dict"], f"site {best}"
        else:
            spec, sd, start = site_specs[sites[0]], None, "fresh"
        out[g] = {"spec": dict(spec), "state_dict": sd, "start": start, "sites": sites}
    return out


def student_model(student: dict, seed: int = 0):
    """The ``nn.Module`` of a student entry (fresh models drawn from ``seed``)."""
    import torch

    from hfl_components.models import build_model

    torch.manual_seed(int(seed))
    m = build_model(student["spec"])
    if student["state_dict"] is not None:
        m.load_state_dict({k: torch.as_tensor(v) for k, v in student["state_dict"].items()})
    return m


def teachers_of(uploads: dict[str, dict]):
    """:class:`~hfl_components.fusion.distill.Teacher` of every upload (name order)."""
    import torch

    from hfl_components.fusion.distill import Teacher
    from hfl_components.models import build_model

    out = []
    for site in sorted(uploads):
        u = uploads[site]
        m = build_model(u["spec"])
        m.load_state_dict({k: torch.as_tensor(v) for k, v in u["state_dict"].items()})
        out.append(Teacher(site, m.eval(), int(u["input_size"])))
    return out


def weights_of(uploads: dict[str, dict], mode: str):
    """Teacher weights in name order (:func:`hfl_components.fusion.distill.teacher_weights`): ``samples`` from the
    uploads' ``n_samples``, ``score`` from their reported validation AUC (``val_auc``), ``equal``."""
    from hfl_components.fusion.distill import teacher_weights

    sites = sorted(uploads)
    return teacher_weights([uploads[s]["n_samples"] for s in sites], [uploads[s].get("val_auc") for s in sites],
                           mode=mode)


def teacher_logits(teachers, probe: dict, device, batch: int = 64):
    """Every teacher's logits on every probe image at its own input size: float32 tensor (K, N, C) on the CPU."""
    import torch

    out = []
    with torch.no_grad():
        for t in teachers:
            t.model.to(device).eval()
            x = probe[int(t.input_size)]
            out.append(torch.cat([t.model(x[i:i + batch].to(device, torch.float32)).float().cpu()
                                  for i in range(0, x.shape[0], batch)]))
    return torch.stack(out)


STACKER = {"folds": 5, "l2": 1e-2}  # the learned teacher's cross-fitting folds and ridge (hfl_components.fusion.stacking)


def stacked_teacher(teachers, weights, probe: dict, labels: list[int], temperature: float, seed: int, device
                    ) -> tuple[object, dict]:
    """The learned teacher's soft targets on the probe (:func:`hfl_components.fusion.stacking.stacked_targets`,
    cross-fitted with :data:`STACKER`) and its record: the folds and ridge, the stacker's weights fitted on every
    probe image, and the probe AUC of the cross-fitted stacker beside the weighted average's (``weights``) -- the
    two teachers' quality on the same labelled images.

    Returns:
        ``(targets (N, C) float32, record)``.
    """
    import torch

    from hfl_components.fusion.distill import ensemble_probs
    from hfl_components.fusion.stacking import (cross_fitted_logits, fit_stacker, stacked_targets,
                                                stacking_features)
    from hfl_components.training.metrics import compute_metrics

    z = teacher_logits(teachers, probe, device)
    y = torch.as_tensor(labels).long()
    c = int(z.shape[2])
    targets = stacked_targets(z, y, temperature, STACKER["folds"], STACKER["l2"], seed)
    oof = torch.softmax(cross_fitted_logits(z, y, STACKER["folds"], STACKER["l2"], seed), -1).numpy()
    avg = ensemble_probs(z, weights, 1.0).numpy()
    w, b = fit_stacker(stacking_features(z), y, c, STACKER["l2"])
    rec = {**STACKER, "n": int(y.numel()), "weights": w.tolist(), "bias": b.tolist(),
           "probe_auc_stacked_cross_fitted": compute_metrics(y.numpy(), oof, c)["auc"],
           "probe_auc_average": compute_metrics(y.numpy(), avg, c)["auc"]}
    return targets, rec


def distil_groups(students: dict, uploads: dict, probe: dict, device, *, steps: int, temperature: float,
                  weighting: str, augment: bool, data_free: bool, data_free_rounds: int, in_channels: int,
                  seed: int, max_seconds: float | None, log=None, teacher: str, labels: list[int] | None = None,
                  feature_weight: float, feature_layer: str) -> dict:
    """Distil the ensemble of every upload into each group's student (state dicts replaced in place).

    Args:
        students: {group: student entry} (:func:`initial_students`, ``state_dict`` filled in).
        uploads: {site: upload} (the teachers, weighted by :func:`weights_of` with ``weighting``).
        probe: {input size: (N, C, S, S)} probe images at every site size (unused when ``data_free``).
        device: where it runs. steps, temperature, augment: :class:`~hfl_components.fusion.distill.DistillConfig`.
        data_free, data_free_rounds: use :func:`~hfl_components.fusion.datafree.distill_data_free` instead.
        in_channels: image channels (data-free). seed: group k uses ``seed + k``. max_seconds: wall-clock cap.
        log: callable for progress lines.
        teacher: ``average`` (the uploads' weighted ensemble) | ``stacked`` (a learned combination fitted on the
            probe's public ``labels``, :func:`stacked_teacher`; the same targets for every group).
        labels: the probe images' class indices (:func:`probe_labels`), required for ``stacked``.
        feature_weight, feature_layer: feature distillation beside the logits
            (:class:`~hfl_components.fusion.distill.FeatureDistill`: the student's similarity structure of
            ``feature_layer`` taught by the teachers' average, weight ``feature_weight``); weight 0 is the
            logit-only loop, unchanged.

    Returns:
        {group: record} with the loop's record plus ``mode`` (``probe`` | ``data_free``), ``sizes``, ``start``,
        ``sites``, ``teachers``, ``teacher_weights``, ``weighting`` and ``teacher`` (and ``stacker``, its record;
        ``feature``, the feature term's record, when its weight is > 0).

    Raises:
        ValueError: ``stacked`` without labels, or as :func:`check_teacher` / :func:`check_feature`.
    """
    from hfl_components.fusion.datafree import DataFreeConfig, distill_data_free
    from hfl_components.fusion.distill import DistillConfig, FeatureDistill, distill

    if teacher not in TEACHERS or (teacher == "stacked" and (labels is None or data_free or augment)):
        raise ValueError(f"OHFL: distillation teacher {teacher!r} (one of {TEACHERS}; stacked needs the probe's "
                         "labels, no data-free distillation and no distillation augmentation)")
    check_feature(feature_weight, feature_layer, data_free, augment)
    features = FeatureDistill(float(feature_weight), str(feature_layer)) if float(feature_weight) > 0 else None
    teachers = teachers_of(uploads)
    weights = weights_of(uploads, weighting)
    targets, stacker = stacked_teacher(teachers, weights, probe, labels, temperature, seed, device) \
        if teacher == "stacked" else (None, None)
    recs = {}
    for k, (g, st) in enumerate(sorted(students.items())):
        model = student_model(st, seed + k)
        sizes = sorted({int(uploads[s]["input_size"]) for s in st["sites"] if s in uploads}) or \
            sorted({t.input_size for t in teachers})
        if data_free:
            cfg = DataFreeConfig(rounds=data_free_rounds, temperature=temperature, max_seconds=max_seconds,
                                 seed=seed + k)
            rec = distill_data_free(model, sizes, teachers, weights, in_channels=in_channels,
                                    num_classes=int(st["spec"].get("num_classes", 2)), config=cfg, device=device)
            rec["mode"] = "data_free"
        else:
            cfg = DistillConfig(steps=steps, temperature=temperature, augment=augment, max_seconds=max_seconds,
                                seed=seed + k)
            rec = distill(model, sizes, teachers, probe, weights, cfg, device=device, targets=targets,
                          log=None if log is None else (lambda m, g=g: log(f"OHFL [{g}]: {m}")),
                          features=features).as_dict()
            rec["mode"] = "probe"
        rec.update({"sizes": sizes, "start": st["start"], "sites": st["sites"], "teachers": [t.name for t in teachers],
                    "teacher_weights": [float(w) for w in weights], "weighting": weighting, "teacher": teacher,
                    **({"stacker": stacker} if stacker else {})})
        st["state_dict"] = {kk: v.detach().cpu() for kk, v in model.state_dict().items()}
        recs[g] = rec
        if log:
            log(f"OHFL [{g}]: distilled ({rec['mode']}) in {rec['seconds']:.1f} s from {st['start']}")
    return recs


def references(uploads: dict, fused: dict, students: dict, server_seconds: dict) -> dict:
    """Cost of each one-shot reference point (its AUC comes from ``evaluate``): server seconds and the bytes a site
    would download to deploy it. ``ensemble``: every upload (no server work); ``fusion``: its group's fused model
    (the fusion's seconds); ``distilled``: its group's global model (fusion + distillation)."""
    from hfl_components.flare.messages import payload_bytes, to_numpy_state

    def nbytes(sd):
        return payload_bytes(to_numpy_state(sd))
    fusion_s = server_seconds.get("fusion_total", 0.0)
    return {"ensemble": {"server_seconds": 0.0,
                         "bytes_down_per_site": sum(nbytes(u["state_dict"]) for u in uploads.values())},
            "fusion": {"server_seconds": fusion_s, "bytes_down_per_site": {g: nbytes(f[1]) for g, f in fused.items()}},
            "distilled": {"server_seconds": fusion_s + server_seconds.get("distillation", 0.0),
                          "bytes_down_per_site": {g: nbytes(st["state_dict"]) for g, st in students.items()}}}
