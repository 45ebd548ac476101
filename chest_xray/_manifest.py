"""CSV manifests as spreadsheets save them, and a manifest's rows as scan candidates."""
from __future__ import annotations

import codecs
import csv
import io
import os
import unicodedata
from collections.abc import Callable
from pathlib import Path

from ._walk import skip_entry
from .io import patient_id_key


def read_csv_rows(path: str | os.PathLike) -> tuple[list[str], list[dict[str, str]]]:
    """A CSV table as spreadsheet software saves it: ``(field names, rows)``.

    Accepted: UTF-8 with or without a byte-order mark (bytes that are not UTF-8, e.g. a cp1252 file name, are
    kept as surrogate escapes, so a path keeps its exact bytes on POSIX), UTF-16 with a BOM, LF / CRLF / CR line
    ends, and comma, semicolon (the default in many European locales) or tab delimiters, detected from the header
    line (the most frequent of the three; comma on a tie). Field names are stripped and lower-cased; values are
    stripped of surrounding whitespace.

    Raises:
        OSError: the file cannot be read.
        ValueError: not parseable as CSV (the message names the file and line).
    """
    p = Path(path)
    data = p.read_bytes()
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        text = data.decode("utf-16", errors="surrogateescape")
    else:
        text = data.decode("utf-8-sig", errors="surrogateescape")
    header = text.splitlines()[0] if text else ""
    delim = max((",", ";", "\t"), key=lambda c: (header.count(c), c == ","))
    try:
        reader = csv.reader(io.StringIO(text, newline=""), delimiter=delim)
        rows = list(reader)
    except csv.Error as e:
        raise ValueError(f"{p}: not a readable CSV file ({e})") from None
    if not rows:
        return [], []
    names = [h.strip().lower() for h in rows[0]]
    out = []
    for r in rows[1:]:
        if not any(c.strip() for c in r):
            continue  # blank line (spreadsheets add them at the end)
        out.append({n: (r[i].strip() if i < len(r) else "") for i, n in enumerate(names)})
    return names, out


def manifest_candidates(root: Path, skipped: list[dict[str, str]], notes: list[dict[str, str]] | None = None,
                        label_key: Callable[[str, Path], object] | None = None
                        ) -> list[tuple[Path, str, str | None]]:
    """Rows of a CSV manifest as (absolute path, label, patient id or None). A row with an empty path, a repeat of
    an earlier row (same file, same class), and every row of a file listed with different classes are listed in
    ``skipped`` with their row number (line of the CSV, header = line 1). Two labels are one class when they are
    the same text (any case) or ``label_key(label, path)`` gives them one value (the scan passes the scheme's
    class index, so ``0`` and ``NORMAL`` are one class); a later row whose label it refuses (ValueError: an
    unknown class, an index out of range) is no side of a conflict: it is returned for the scan to refuse by name,
    as a file listed once with that label is (a refused first row is returned as it stands). A path
    that names no file but matches one after Unicode normalisation (:func:`match_normalised`) is used, with a note
    in ``notes``. Patient ids that differ only in case or whitespace (:func:`chest_xray.io.patient_id_key`) are
    one patient, under the spelling of its first row."""
    cols, rows = read_csv_rows(root)
    if not {"path", "label"} <= set(cols):
        raise ValueError(f"{root}: manifest needs columns path and label (has {sorted(cols)})")
    first: dict[str, tuple[int, str]] = {}  # path -> (line, label) of its first row
    conflicting: dict[str, set[str]] = {}
    spelling: dict[str, str] = {}  # patient_id_key -> the id as first written
    kept: list[tuple[int, Path, str, str | None]] = []
    later: list[tuple[int, Path]] = []  # rows after the first of a file listed with another label
    for line, row in enumerate(rows, start=2):
        raw = row["path"]
        if not raw:
            skipped.append(skip_entry(f"{root}:{line}", f"manifest line {line}: empty path", "manifest row"))
            continue
        p = Path(raw)
        if not p.is_absolute():
            p = root.parent / p
        p = Path(os.path.abspath(p))
        found = match_normalised(p)
        if found is not None and found[1] is not None:
            p = found[0]
            if notes is not None:
                notes.append({"path": str(p), "note": f"manifest line {line}: {found[1]}",
                              "kind": "name normalisation"})
        label = row["label"]
        key = str(p)
        if key in first:
            line0, label0 = first[key]
            if label0.strip().upper() == label.strip().upper():
                skipped.append(skip_entry(p, f"manifest line {line}: duplicate of line {line0} (same file, same label)",
                                     "duplicate manifest row"))
            elif _one_class(label0, label, p, label_key):
                skipped.append(skip_entry(p, f"manifest line {line}: duplicate of line {line0} (same file; labels "
                                             f"{label0.strip()} and {label.strip()} name one class)",
                                          "duplicate manifest row"))
            elif _unusable(label, p, label_key) or _unusable(label0, p, label_key):
                if _unusable(label, p, label_key):  # the first row, kept, is refused by the scan if it is the bad one
                    kept.append((line, p, label, None))  # the scan refuses it by name (LabelError), as any row
            else:
                conflicting.setdefault(key, {label0}).add(label)
                later.append((line, p))
            continue
        first[key] = (line, label)
        pid = (row.get("patient_id") or "").strip() or None
        if pid is not None:  # one patient however its id is spelled (case, whitespace): its first spelling
            pid = spelling.setdefault(patient_id_key(pid), " ".join(pid.split()))
        kept.append((line, p, label, pid))
    out: list[tuple[Path, str, str | None]] = []
    for line, p in [(line, p) for line, p, _, _ in kept] + later:
        if str(p) in conflicting:
            labels = ", ".join(sorted({x.strip() for x in conflicting[str(p)]}))
            skipped.append(skip_entry(p, f"manifest line {line}: the file is listed with conflicting labels "
                                         f"({labels}); none is used", "conflicting labels"))
    out = [(p, label, pid) for _, p, label, pid in kept if str(p) not in conflicting]
    return sorted(out, key=lambda t: str(t[0]))



def _one_class(a: str, b: str, path: Path, label_key) -> bool:
    """Whether labels ``a`` and ``b`` of ``path`` name one class under ``label_key`` (False without it, or when it
    refuses either label: the scan names that label's problem itself)."""
    if label_key is None:
        return False
    try:
        return label_key(a, path) == label_key(b, path)
    except ValueError:
        return False


def _unusable(label: str, path: Path, label_key) -> bool:
    """Whether ``label_key`` refuses ``label`` of ``path`` (an unknown class or an index out of range): such a row
    is not one side of a label conflict but bad input the scan names (False without ``label_key``)."""
    if label_key is None:
        return False
    try:
        label_key(label, path)
    except ValueError:
        return True
    return False


def _legacy_decoded(comp: str) -> str | None:
    """A path component holding bytes that are not UTF-8 (kept as surrogate escapes by :func:`read_csv_rows`) read
    as Windows-1252, the encoding spreadsheet software in Western Europe saves CSV files in; NFC. None otherwise."""
    if not any("\udc80" <= c <= "\udcff" for c in comp):
        return None
    try:
        return unicodedata.normalize("NFC", comp.encode("utf-8", "surrogateescape").decode("cp1252"))
    except UnicodeError:
        return None


def match_normalised(path: str | os.PathLike) -> tuple[Path, str | None] | None:
    """The file ``path`` names, matched after Unicode normalisation where the exact name does not exist.

    macOS writes file names decomposed (NFD: "e" + combining accent); a manifest typed on another system holds
    them composed (NFC), or the other way round, and the bytes differ. A manifest saved in Windows-1252 holds
    bytes that are not UTF-8 where the disk holds UTF-8 names. Each path component that does not exist as written
    is compared, in NFC (and, when it holds non-UTF-8 bytes, read as Windows-1252), with the entries of its
    folder; one unique match is taken.

    Returns:
        ``(path on disk, message)``: the message says which normalisation was applied (None when the path exists
        as written); None when no file matches.
    """
    p = Path(path)
    if os.path.lexists(p):
        return p, None
    cur, forms = Path(p.anchor), set()
    for comp in p.parts[1:] if p.anchor else p.parts:
        cand = cur / comp
        if os.path.lexists(cand):
            cur = cand
            continue
        want, legacy = unicodedata.normalize("NFC", comp), _legacy_decoded(comp)
        try:
            hits = [e for e in os.listdir(cur) if unicodedata.normalize("NFC", e) in (want, legacy)]
        except OSError:
            return None
        if len(hits) != 1:
            return None
        on_disk = hits[0]
        if legacy is not None and unicodedata.normalize("NFC", on_disk) == legacy:
            forms.add("the manifest's bytes read as Windows-1252: the CSV is not UTF-8")
            cur = cur / on_disk
            continue
        forms.add(("NFD" if unicodedata.is_normalized("NFD", on_disk) else "NFC" if
                   unicodedata.is_normalized("NFC", on_disk) else "mixed") + " on disk, "
                  + ("NFC" if unicodedata.is_normalized("NFC", comp) else "NFD" if
                     unicodedata.is_normalized("NFD", comp) else "mixed") + " in the manifest")
        cur = cur / on_disk
    return cur, ("file name matched after Unicode normalisation (" + "; ".join(sorted(forms)) + ")")
