import shutil
from pathlib import Path

import pytest

from generator import specs as S

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def specs():
    return S.load()


@pytest.fixture
def spec_copy(tmp_path):
    """A writable copy of specs/ (and templates/ beside it) to mutate."""
    shutil.copytree(ROOT / "specs", tmp_path / "specs")
    (tmp_path / "templates").symlink_to(ROOT / "templates")
    return tmp_path / "specs"


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")
