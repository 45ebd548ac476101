"""The site-local salt and the salted DICOM patient id (the one patient-level value a site groups by)."""
from __future__ import annotations

import hashlib
import os
import secrets
import threading
import unicodedata
from pathlib import Path

from ._dicom_header import read_dataset

#: Environment variable holding the site-local salt for DICOM patient-id hashing.
SALT_ENV = "CXR_PATIENT_SALT"


class PatientSaltError(OSError):
    """The site-local patient salt file cannot be read or created (the message names the file and the way out)."""


#: Threads of one scan (:func:`chest_xray.dataset.scan_dataset`) may ask for the salt at the same moment.
_SALT_LOCK = threading.Lock()


def site_salt(salt: str | None = None) -> str:
    """The site-local salt for hashing DICOM patient IDs.

    Order: the ``salt`` argument, else ``$CXR_PATIENT_SALT``, else a random salt created once and kept in
    ``~/.config/cxr-hfl/patient_salt`` (``$XDG_CONFIG_HOME`` if set; mode 0600) so hashes are stable on this
    machine. The salt never leaves the site; ids hashed with different salts cannot be linked. Creating it is
    safe when threads or processes ask at once: the file appears with its content (written aside, then
    hard-linked), so every caller gets the same salt and none sees an empty file.

    Raises:
        PatientSaltError: the salt file cannot be read or created (e.g. a read-only home); the message names the
            file and says to set ``$CXR_PATIENT_SALT`` or ``$XDG_CONFIG_HOME``.
    """
    if salt:
        return salt
    env = os.environ.get(SALT_ENV)
    if env:
        return env
    f = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "cxr-hfl" / "patient_salt"
    with _SALT_LOCK:
        try:
            value = f.read_text().strip()
            if value:
                return value
        except FileNotFoundError:
            pass
        except OSError as e:
            raise PatientSaltError(f"cannot read the patient salt file {f} ({e.strerror or e}); set "
                                   f"${SALT_ENV} or $XDG_CONFIG_HOME") from None
        value = secrets.token_hex(16)
        tmp = f.with_name(f".patient_salt.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            f.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(value)
            try:
                os.link(tmp, f)  # atomic and exclusive: another process's salt, once there, wins
            except FileExistsError:
                existing = f.read_text().strip()
                if existing:
                    return existing
                os.replace(tmp, f)  # an empty file left by an interrupted older version: replaced
        except OSError as e:
            raise PatientSaltError(f"cannot create the patient salt file {f} ({e.strerror or e}); set "
                                   f"${SALT_ENV} or $XDG_CONFIG_HOME to a writable folder") from None
        finally:
            tmp.unlink(missing_ok=True)
        return value


def patient_id_key(value) -> str:
    """The form two patient ids are compared in: surrounding whitespace dropped, inner runs of whitespace made one
    space, Unicode composed (NFC), letters upper-cased (``"PAT01"``, ``" pat01 "`` and ``"Pat01\\t"`` are one patient; an id already in
    this form is unchanged, and so is its salted hash). Hospital systems and hand-typed manifests spell one id
    several ways; splitting them would put one patient in two splits, while joining two real ids that differ only
    in case merely groups them (never a leak)."""
    return " ".join(unicodedata.normalize("NFC", str(value)).split()).upper()


def dicom_patient_id(path: str | os.PathLike, salt: str | None = None) -> str | None:
    """Salted hash of a DICOM file's PatientID, for grouping a patient's images inside one site.

    Args:
        path: a DICOM file.
        salt: site-local secret; see :func:`site_salt` for the fallbacks.

    Returns:
        ``"dcm-" + sha256(salt + PatientID)[:16]`` (the PatientID in the form of :func:`patient_id_key`), or
        None when the file has no PatientID. The raw PatientID is never returned or logged.

    Raises:
        ImageReadError: not a parseable DICOM file.
    """
    ds = read_dataset(Path(path), stop_before_pixels=True)
    pid = patient_id_key(ds.get("PatientID", "") or "")
    if not pid:
        return None
    digest = hashlib.sha256((site_salt(salt) + "\x00" + pid).encode("utf-8")).hexdigest()
    return "dcm-" + digest[:16]


#: PatientID values (upper case, stripped) that anonymisers and modalities write instead of an identity. A value
#: made of one repeated character ("000000", "XXXX", "*") counts as well. See :func:`dicom_grouping_ids`.
PLACEHOLDER_PATIENT_IDS = frozenset({
    "ANONYMOUS", "ANONYMIZED", "ANONYMISED", "ANONYMIZE", "ANON", "UNKNOWN", "UNK", "NONE", "NULL", "N/A", "NA",
    "NOID", "NO ID", "NO_ID", "NO-ID", "NOT AVAILABLE", "PATIENT", "PATIENTID", "PATIENT ID", "REMOVED", "DELETED",
    "REDACTED", "BLANK", "EMPTY", "TEST", "DEFAULT", "NOPATIENTID", "DE-IDENTIFIED", "DEIDENTIFIED",
})


def is_placeholder_id(value: str) -> bool:
    """A PatientID that names no one: one of :data:`PLACEHOLDER_PATIENT_IDS` (any case), or one character
    repeated ("0000", "XXXXXX")."""
    v = " ".join(str(value).split()).upper()
    return v in PLACEHOLDER_PATIENT_IDS or len(set(v.replace(" ", ""))) <= 1


def dicom_grouping_ids(path: str | os.PathLike, salt: str | None = None) -> dict:
    """The salted ids a scan groups a DICOM file's images by, read from the header only.

    Returns:
        dict with ``patient`` (as :func:`dicom_patient_id`, or None), ``placeholder`` (True when the PatientID is
        a placeholder, :func:`is_placeholder_id`), ``study`` (``"dcm-study-" + hash`` of the Study Instance UID,
        or None) and ``accession`` (``"dcm-acc-" + hash`` of the Accession Number, or None). Raw values are never
        returned.

    Raises:
        ImageReadError: not a parseable DICOM file.
    """
    ds = read_dataset(Path(path), stop_before_pixels=True)
    out: dict = {"placeholder": False}
    for key, attr, prefix in (("patient", "PatientID", "dcm-"), ("study", "StudyInstanceUID", "dcm-study-"),
                              ("accession", "AccessionNumber", "dcm-acc-")):
        value = str(ds.get(attr, "") or "").strip()
        if key == "patient":
            out["placeholder"] = bool(value) and is_placeholder_id(value)
        if not value or (key == "accession" and is_placeholder_id(value)):
            out[key] = None
            continue
        # the patient hash stays dicom_patient_id's
        text = patient_id_key(value) if key == "patient" else f"{attr}\x00{value}"
        out[key] = prefix + hashlib.sha256((site_salt(salt) + "\x00" + text).encode("utf-8")).hexdigest()[:16]
    return out
