"""Shared pytest fixtures.

``data_root``: the real data folder, ``$CXR_DATA`` if set, else ``../shared/data`` relative to the repository root;
tests that use it are skipped with a message when it is missing. Nothing from it is ever copied into the repo.
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


def pytest_collection_modifyitems(config, items):
    """Mark every test that uses ``data_root`` as ``realdata`` (select with ``-m realdata`` / ``-m "not realdata"``)."""
    for item in items:
        if "data_root" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.realdata)
