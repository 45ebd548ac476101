"""What may leave a site: helpers that keep patients' file paths out of messages sent to the server.

A site's own logs may name its image files (the hospital's operator needs them to fix a broken file); anything
sent to the server -- task results, metrics, error reasons -- must not. :func:`redact_paths` is applied to every
error reason a site sends (``hfl_components/flare/site_script.py``); the full message stays in the site's log.
"""
from __future__ import annotations

import re

from hfl_components.flare.catalogue import CATALOGUE
from hfl_components.flare.catalogue import what_leaves as catalogue_uploads

# an absolute POSIX path (/a/b...), a home path (~/...), a Windows drive path (C:\... or C:/...) or a UNC path
_PATH_RE = re.compile(r"(?<![\w.:/\\])(?:[A-Za-z]:[\\/]|\\\\|~/|/)[^\s'\"<>|,;:()\[\]{}]*")
_FILE_RE = re.compile(r"\b[\w.\-^]+\.(?:dcm|dicom|jpe?g|png|tiff?|bmp|nii(?:\.gz)?)\b", re.IGNORECASE)


def redact_paths(text: str) -> str:
    """Replace file-system paths and image file names in ``text`` by ``<path>`` / ``<file>``.

    >>> redact_paths("cannot read /data/pat/John^Doe/1.dcm: bad header")
    'cannot read <path>: bad header'
    >>> redact_paths("ImageReadError: person12_virus_3.jpeg is truncated")
    'ImageReadError: <file> is truncated'
    """
    text = _PATH_RE.sub("<path>", str(text))
    return _FILE_RE.sub("<file>", text)


#: What every site sends with every task answer, whatever the method.
COMMON_UPLOAD = ("task status (ok/error; an error's reason with paths and image file names removed), training-set "
                 "size, input size, model spec (architecture only), seconds of compute, per-epoch training losses "
                 "and validation metrics (accuracy, AUC, ..., confusion matrix, i.e. validation class counts)")
#: What the final ``evaluate`` task of every method adds.
EVALUATE_UPLOAD = ("final evaluate: aggregate test metrics and confusion matrix (test class counts); per-image "
                   "test probabilities and labels (no images, no identifiers) only if the site sets "
                   "share_predictions: true (default false)")
#: Per method, what a site uploads on top of :data:`COMMON_UPLOAD` and :data:`EVALUATE_UPLOAD` (the method
#: catalogue's ``uploads``).
METHOD_UPLOAD = {m: e.uploads for m, e in CATALOGUE.items()}


def what_leaves(method: str) -> str:
    """One sentence: everything a site running ``method`` sends to the server (docs/DEPLOYMENT.md, Privacy).

    Raises:
        KeyError: unknown method.
    """
    return f"{catalogue_uploads(method)}; plus, with every task, {COMMON_UPLOAD}; {EVALUATE_UPLOAD}"
