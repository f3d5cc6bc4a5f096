"""Failed-rank masking in normal mode on the kernels (enable_shrink; intranode, and hierarchical over
domains of two ranks), on GPUs (ranks may share one: EPCOMM_TEST_SHARE_GPUS=1): the cases of the
portable path's tests (test_reference_shrink.py), with the same checks against the oracle of the
live ranks, the same time bounds, and the kernels running again once the mask is cleaned."""

import pytest
from conftest import BACKEND, gpu_backend, nvshmem_found
from test_reference_shrink import (
    test_a_late_peer_is_not_masked as late_peer_not_masked,
)
from test_reference_shrink import (
    test_a_rank_masked_while_silent_raises_when_it_calls as silent_rank_raises,
)
from test_reference_shrink import (
    test_failed_peer_is_masked_and_the_call_completes as failed_peer_masked,
)
from test_reference_shrink import (
    test_masked_by_hand_then_cleaned_restores_every_rank as masked_by_hand,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(BACKEND != "nccl", reason="CUDA kernels: run with EPCOMM_TEST_BACKEND=nccl on GPUs"),
]

CASES = [("intranode", 2, 1, "before_combine"), ("intranode", 3, 1, "before_dispatch"),
         ("intranode", 4, 2, "before_combine"), ("intranode", 3, 1, "silent_before_dispatch"),
         ("intranode", 4, 3, "silent_before_combine"),
         ("intranode", 8, 5, "before_dispatch"),
         ("hierarchical", 4, 1, "before_dispatch"), ("hierarchical", 4, 2, "before_combine")]


def _needs(kind: str) -> None:
    if kind == "hierarchical" and not nvshmem_found():
        pytest.skip("NVSHMEM not installed (pip install nvidia-nvshmem-cu13)")


@pytest.mark.parametrize("kind,num_ranks,dead,when", CASES)
def test_failed_peer_is_masked_and_the_call_completes_on_the_kernels(kind, num_ranks, dead, when):
    _needs(kind)
    failed_peer_masked(num_ranks, dead, when, kind, gpu_backend(num_ranks))


def test_a_rank_masked_while_silent_raises_when_it_calls_on_the_kernels():
    silent_rank_raises("intranode", gpu_backend(3))


def test_masked_by_hand_then_cleaned_runs_on_the_kernels_again():
    masked_by_hand("intranode", gpu_backend(3))


def test_a_late_peer_is_not_masked_on_the_kernels():
    late_peer_not_masked("intranode", gpu_backend(3))
