"""The portable backend: the whole API on torch.distributed collectives (gloo on CPU, NCCL on GPU).

It is the oracle every kernel is tested against, so it favours plain, obviously-correct code.
"""

from .backend import ReferenceBackend

__all__ = ["ReferenceBackend"]
