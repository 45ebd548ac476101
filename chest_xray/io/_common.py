"""Shared pieces of the readers: limits, suffixes, the one error type, file checks and the warnings lock."""
from __future__ import annotations

import os
import stat
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np

#: Largest image (rows x columns) any reader will decode. A 4,300 x 3,500 detector image is 15 MP; 50 MP leaves
#: ample room while refusing decompression bombs (Pillow itself only *warns* at 89 MP).
MAX_PIXELS = 50_000_000

#: File suffixes the readers accept (lower case). Anything else is reported as unsupported by the scanner.
PIL_SUFFIXES = (".jpeg", ".jpg", ".png")
DICOM_SUFFIXES = (".dcm", ".dicom")
SUPPORTED_SUFFIXES = PIL_SUFFIXES + DICOM_SUFFIXES

#: DICOM modalities that are projection radiographs (computed / digital radiography).
PROJECTION_MODALITIES = ("CR", "DX", "DR")
#: ViewPosition values that are lateral (not PA/AP) projections.
LATERAL_VIEWS = ("LL", "RL", "LAT", "LATERAL", "LLD", "RLD", "RLO", "LLO")


#: libjpeg messages (lower case) that mean part of the image is missing or garbage: the file is refused. Other
#: libjpeg warnings (e.g. "N extraneous bytes before marker 0xd9", common in real exports and harmless to the
#: pixels) are kept in ``meta["decoder_warnings"]``.
FATAL_DECODER_MESSAGES = ("premature end", "bad huffman", "corrupt jpeg data: found marker", "huffman table")


#: Categories of :attr:`ImageReadError.kind` (and of the scan report's ``skipped_by_reason`` counts).
READ_ERROR_KINDS = (
    "missing file", "not a regular file", "empty file", "not an image", "corrupt or truncated", "too large",
    "multi-frame", "no pixel data", "colour image", "no decoder", "invalid DICOM attribute", "unreadable",
    "directory index",
)


def one_line(text: str, limit: int = 300) -> str:
    """``text`` with every run of whitespace (newlines included) collapsed to one space, cut to ``limit`` chars."""
    t = " ".join(str(text).split())
    return t if len(t) <= limit else t[: limit - 3] + "..."


def printable(text: str) -> str:
    """``text`` on one screen line: control characters (a newline, a carriage return or a terminal escape in a
    file name) and undecodable bytes (a cp1252 name, kept as surrogate escapes) written as Python escapes, e.g.
    ``two\\nlines.jpeg``, ``caf\\udce9.jpeg``. Everything a CLI prints that may hold a file name goes through it."""
    return "".join(c if c.isprintable() or c == " " else c.encode("unicode_escape", "backslashreplace").decode()
                   for c in str(text))


class ImageReadError(Exception):
    """A file could not be read as a chest X-ray image.

    Attributes:
        path: the file, as given (a non-UTF-8 name keeps its bytes as surrogate escapes, as ``os.fsdecode``).
        reason: what went wrong, in words, on one line (never contains patient-identifying DICOM fields).
        kind: the category of the problem, one of :data:`READ_ERROR_KINDS` (scan reports count skips by it).
    """

    def __init__(self, path: str | os.PathLike, reason: str, kind: str = "unreadable"):
        self.path = os.fsdecode(path) if isinstance(path, bytes) else str(path)
        self.reason = one_line(reason)
        self.kind = kind
        super().__init__(f"{self.path!s}: {self.reason}")

    def __reduce__(self):  # picklable across DataLoader workers
        return (type(self), (self.path, self.reason, self.kind))


def check_readable(path: str | os.PathLike) -> None:
    """Open ``path`` for reading once, so that a file the process may not read is named as such.

    Raises:
        ImageReadError: kind ``"unreadable"``, e.g. "cannot open file (Permission denied)".
    """
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise ImageReadError(path, f"cannot open file ({e.strerror or e})", "unreadable") from None


def sniff_dicom(path: Path) -> bool:
    """A file (whatever its suffix) is DICOM when it has the Part-10 ``DICM`` marker at byte 128. Only a regular
    file is opened: opening a named pipe (FIFO) would block until a writer came, and a device may never end."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return False
        with open(path, "rb") as fh:
            head = fh.read(132)
    except OSError:
        return False
    return len(head) == 132 and head[128:132] == b"DICM"


def image_signature(path: Path) -> str | None:
    """"JPEG" or "PNG" when the file starts with that format's signature, else None."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
    except OSError:
        return None
    return "JPEG" if head.startswith(b"\xff\xd8") else "PNG" if head.startswith(b"\x89PNG\r\n\x1a\n") else None


def is_dicom_file(path: Path) -> bool:
    """A file the DICOM reader takes: suffix ``.dcm`` / ``.dicom`` (any case), or the ``DICM`` marker
    (:func:`sniff_dicom`)."""
    return path.suffix.lower() in DICOM_SUFFIXES or sniff_dicom(path)


#: ``warnings.catch_warnings`` swaps the process-wide filter list (and, with ``record=True``, ``showwarning``): two
#: threads inside it at once can record each other's warnings or leave a filter behind when they leave out of
#: order (Python < 3.14). Every warnings scope in this module holds this lock.
WARNINGS_LOCK = threading.RLock()


@contextmanager
def warnings_scope(record: bool = False):
    """``warnings.catch_warnings(record=record)`` held under :data:`WARNINGS_LOCK`, so that a scan verifying files
    in threads (:func:`chest_xray.dataset.scan_dataset`) attributes each warning to its own file and leaves the
    filters as it found them. Yields the list of caught warnings (``record=True``) or None."""
    with WARNINGS_LOCK, warnings.catch_warnings(record=record) as caught:
        yield caught



def scale_to_unit(a, lo: float, hi: float) -> np.ndarray:
    """``(a - lo) / (hi - lo)`` clipped to [0, 1]; zeros when ``hi <= lo`` (a constant image)."""
    a = np.asarray(a, dtype=np.float64)
    if hi <= lo:
        return np.zeros(a.shape, np.float32)
    return np.clip((a - lo) / (hi - lo), 0.0, 1.0)


#: Words (lower case) of the lines libjpeg / OpenJPEG / CharLS (inside GDCM or Pillow) write straight to the
#: C-level stderr while decoding; a captured line holding none of them is passed on to stderr unchanged.
DECODER_MESSAGE_WORDS = ("jpeg", "huffman", "marker", "sof ", "bogus", "quantization", "j2k", "jp2", "codestream",
                          "tile", "premature end", "gdcm", "warning:", "error:")


_FD2_LOCK = threading.Lock()


class decoder_messages:
    """Context manager: while decoding, what C libraries write to file descriptor 2 (libjpeg's "Corrupt JPEG data:
    ..." lines, which name no file) is captured; decoder messages are appended to ``into`` (one line each) and
    any other text written meanwhile (another thread's log line) is passed on to stderr unchanged. File descriptor
    2 is process-wide: a lock makes concurrent decodes in threads take turns, so that none restores another's
    redirection."""

    def __init__(self, into: list[str]):
        self.into = into

    def __enter__(self):
        import sys
        import tempfile

        _FD2_LOCK.acquire()
        self.tmp = None
        try:
            sys.stderr.flush()
            self.tmp = tempfile.TemporaryFile()
            self.saved = os.dup(2)
            os.dup2(self.tmp.fileno(), 2)
        except (OSError, ValueError, AttributeError):  # no usable fd 2 (embedded interpreter): do not capture
            if self.tmp is not None:
                self.tmp.close()
            self.tmp = None
        return self

    def __exit__(self, *exc):
        if self.tmp is None:
            _FD2_LOCK.release()
            return False
        try:
            os.dup2(self.saved, 2)
            os.close(self.saved)
        finally:
            _FD2_LOCK.release()
        self.tmp.seek(0)
        text = self.tmp.read().decode("utf-8", errors="replace")
        self.tmp.close()
        other = []
        for line in text.splitlines():
            if any(w in line.lower() for w in DECODER_MESSAGE_WORDS):
                self.into.append(one_line(line, 200))
            elif line.strip():
                other.append(line)
        if other:
            os.write(2, ("\n".join(other) + "\n").encode("utf-8", errors="replace"))
        return False
