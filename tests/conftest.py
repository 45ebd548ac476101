"""Shared pytest fixtures.

``data_root``: the real data folder, ``$CXR_DATA`` if set, else ``../shared/data`` relative to the repository root;
``ingestion_cases``: the ingestion field cases (``../shared/cases/ingestion``); tests that use them are skipped
with a message when they are missing. Nothing from it is ever copied into the repo.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def find_data_root() -> Path:
    """``$CXR_DATA`` if set, else ``<repo>/../shared/data`` (may not exist)."""
    env = os.environ.get("CXR_DATA")
    return Path(env).resolve() if env else (REPO_ROOT.parent / "shared" / "data").resolve()


@pytest.fixture(scope="session")
def data_root() -> Path:
    root = find_data_root()
    if not root.is_dir():
        pytest.skip(f"real data not found at {root} (set $CXR_DATA or put the shared data at ../shared/data)")
    return root


def find_cases_root() -> Path:
    """The ingestion field cases: ``$CXR_CASES`` if set, else ``cases/ingestion`` beside the data folder
    (``<repo>/../shared/cases/ingestion`` by default)."""
    env = os.environ.get("CXR_CASES")
    return Path(env).resolve() if env else find_data_root().parent / "cases" / "ingestion"


@pytest.fixture(scope="session")
def ingestion_cases(data_root) -> Path:
    root = find_cases_root()
    if not (root / "README.md").is_file():
        pytest.skip(f"ingestion field cases not found at {root} (set $CXR_CASES or put them at "
                    "../shared/cases/ingestion)")
    return root


def pytest_collection_modifyitems(config, items):
    """Mark every test that uses ``data_root`` as ``realdata`` (select with ``-m realdata`` / ``-m "not realdata"``)."""
    for item in items:
        if "data_root" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.realdata)
