import collections
import os
import shutil
import socket
from pathlib import Path

import pytest

from generator import specs as S

ROOT = Path(__file__).resolve().parent.parent
# the tests read the specs' own tuning tables, never this machine's tuned ones (a user tuning file)
os.environ[S.TUNING_ENV] = ""
_PROPERTY_STATS = pytest.StashKey[collections.Counter]()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing holds now (for a rendezvous a test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


@pytest.fixture(scope="session")
def property_stats(request) -> collections.Counter:
    """Session counter of property-test work (examples tried, rows checked), printed at the end."""
    return request.config.stash.setdefault(_PROPERTY_STATS, collections.Counter())


def pytest_terminal_summary(terminalreporter, config):
    stats = config.stash.get(_PROPERTY_STATS, None)
    if stats:
        terminalreporter.write_sep("-", "property tests")
        for key in sorted(stats):
            terminalreporter.write_line(f"{key}: {stats[key]}")
