"""Reading chest X-ray files (JPEG, PNG, DICOM) into float32 grayscale arrays in [0, 1].

One entry point, :func:`read_image`, and one error type, :class:`ImageReadError`. DICOM objects go through
pydicom's grayscale pipeline in the order the standard prescribes (modality LUT, then VOI LUT or window, then the
MONOCHROME1 inversion); nothing patient-identifying ever leaves this module: the metadata returned is technical
only, and the one patient-level value a site needs for grouping, :func:`dicom_patient_id`, is a salted hash.

The package is one public face over private parts: ``_common`` (limits, suffixes, the error type, the warnings
lock), ``_pil`` (JPEG / PNG), ``_dicom_header`` (parsing and attribute checks), ``_dicom`` (decoding and the
grey-scale pipeline), ``_grayscale`` (the rules for missing, inconsistent or contradictory grey-scale attributes),
``_gdcm`` (12-bit JPEG Extended through GDCM), ``_pixel_bytes`` (what the Pixel Data bytes and the compressed stream
really are, when the Transfer Syntax or Samples per Pixel say otherwise), ``_salt`` (the site salt and the hashed patient ids) and ``_read``
(:func:`read_image`).
"""
from __future__ import annotations

from ._common import (
    DICOM_SUFFIXES,
    LATERAL_VIEWS,
    MAX_PIXELS,
    PIL_SUFFIXES,
    PROJECTION_MODALITIES,
    READ_ERROR_KINDS,
    SUPPORTED_SUFFIXES,
    ImageReadError,
    check_readable,
    is_dicom_file,
    printable,
    sniff_dicom,
    warnings_scope,
)
from ._dicom_header import (
    DICOM_DECODER_HINT,
    DIRECTORY_INDEX_REASON,
    FOR_PROCESSING_SOP_CLASSES,
    HTJ2K_DECODER_HINT,
    decoder_hint,
    dicom_header,
    dicom_skip,
    dicom_skip_reason,
    header_facts,
    header_notes,
    is_directory_index,
    read_dataset,
    rescale_problem,
    voi_problem,
)
from ._grayscale import polarity, voi_lut_bits
from ._pil import EXIF_SWAPS_AXES, exif_orientation, jpeg_entropy_problem, pil_size
from ._read import read_image
from ._salt import (
    PLACEHOLDER_PATIENT_IDS,
    SALT_ENV,
    PatientSaltError,
    dicom_grouping_ids,
    dicom_patient_id,
    is_placeholder_id,
    patient_id_key,
    site_salt,
)

__all__ = [
    "DICOM_DECODER_HINT",
    "DIRECTORY_INDEX_REASON",
    "HTJ2K_DECODER_HINT",
    "DICOM_SUFFIXES",
    "EXIF_SWAPS_AXES",
    "FOR_PROCESSING_SOP_CLASSES",
    "LATERAL_VIEWS",
    "MAX_PIXELS",
    "PIL_SUFFIXES",
    "PROJECTION_MODALITIES",
    "READ_ERROR_KINDS",
    "SALT_ENV",
    "SUPPORTED_SUFFIXES",
    "ImageReadError",
    "PLACEHOLDER_PATIENT_IDS",
    "PatientSaltError",
    "check_readable",
    "decoder_hint",
    "dicom_grouping_ids",
    "dicom_header",
    "dicom_patient_id",
    "dicom_skip",
    "dicom_skip_reason",
    "exif_orientation",
    "header_facts",
    "header_notes",
    "is_dicom_file",
    "is_directory_index",
    "is_placeholder_id",
    "jpeg_entropy_problem",
    "patient_id_key",
    "pil_size",
    "polarity",
    "printable",
    "read_dataset",
    "read_image",
    "rescale_problem",
    "site_salt",
    "sniff_dicom",
    "voi_lut_bits",
    "voi_problem",
    "warnings_scope",
]
