"""Shortcut audit maths: a metadata baseline, perturbation probes, Grad-CAM saliency and their intervals.

Plain functions on arrays / tensors, no NVFlare and no file layout (``nvflare_jobs.audit`` wires them to a run):
:mod:`.metadata` (a cross-validated model on file-level facts), :mod:`.probes` (label-irrelevant perturbations and
the change of p(PNEUMONIA) they cause), :mod:`.saliency` (Grad-CAM and the share of saliency in the image border),
:mod:`.intervals` (the confidence intervals every audit number carries).
"""
