"""What may leave a site: helpers that keep patients' file paths out of messages sent to the server.

A site's own logs may name its image files (the hospital's operator needs them to fix a broken file); anything
sent to the server -- task results, metrics, error reasons -- must not. :func:`redact_paths` is applied to every
error reason a site sends (``hfl_components/flare/site_script.py``); the full message stays in the site's log.
"""
from __future__ import annotations

import re

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
