"""Chest X-ray data layer: reading images, scanning data roots, hospital-site partitions, MONAI transforms.

The transform helpers (``build_transforms``, ``make_site_dataset``, ``default_augment_classes``,
``resolve_augment_classes``, ``ApplyToClassesd``) import torch and MONAI, so they are loaded lazily on first access.
"""
from __future__ import annotations

from ._walk import detect_layout, dir_key, walk_files
from .aspect import ASPECTS, DEFAULT_ASPECT
from .dataset import LabelError, label_index, patient_id_from_name, scan_dataset
from .io import ImageReadError, dicom_patient_id, read_image
from .labels import (
    CLASS_NAMES,
    LABEL_SCHEMES,
    LabelSchemeMismatch,
    check_label_scheme,
    class_names,
    num_classes,
    one_label_scheme,
    scheme_for_num_classes,
)
from .partition import (
    PartitionResult,
    load_partition,
    partition_records,
    read_site_manifest,
    site_summary,
    write_partition,
)

_LAZY = {"build_transforms", "make_site_dataset", "default_augment_classes", "resolve_augment_classes",
         "ApplyToClassesd"}

__all__ = [
    "ASPECTS",
    "CLASS_NAMES",
    "DEFAULT_ASPECT",
    "ImageReadError",
    "LABEL_SCHEMES",
    "LabelError",
    "LabelSchemeMismatch",
    "PartitionResult",
    "detect_layout",
    "dicom_patient_id",
    "dir_key",
    "check_label_scheme",
    "class_names",
    "label_index",
    "load_partition",
    "num_classes",
    "one_label_scheme",
    "partition_records",
    "patient_id_from_name",
    "read_image",
    "read_site_manifest",
    "scan_dataset",
    "scheme_for_num_classes",
    "site_summary",
    "walk_files",
    "write_partition",
    *sorted(_LAZY),
]


def __getattr__(name: str):
    if name in _LAZY:
        from . import transforms

        return getattr(transforms, name)
    raise AttributeError(f"module 'chest_xray' has no attribute {name!r}")
