"""The portable backend: the whole API on torch.distributed collectives (gloo on CPU, NCCL on GPU).

The kernel tests compare against it on the same ranks; it is itself checked against the
single-process oracle (epcomm/oracle.py), which states what every operation must return.
"""

from .backend import ReferenceBackend

__all__ = ["ReferenceBackend"]
