import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from epcomm.utils.launch import LocalCluster  # noqa: E402

_clusters: dict[int, LocalCluster] = {}

# Ranks raise quickly in tests if a peer never arrives, instead of after 100 s.
TEST_ENV = {"EPCOMM_TIMEOUT_S": "30", "OMP_NUM_THREADS": "1"}


def cluster(num_ranks: int) -> LocalCluster:
    """A shared gloo cluster of ``num_ranks`` CPU processes, restarted after a failure."""
    c = _clusters.get(num_ranks)
    if c is None or c.broken:
        c = LocalCluster(num_ranks, backend="gloo", env=TEST_ENV)
        _clusters[num_ranks] = c
    return c


@pytest.fixture(scope="session", autouse=True)
def _close_clusters():
    yield
    for c in _clusters.values():
        c.close()
