"""Backends implementing the Buffer API: ``reference`` (portable torch.distributed) and ``cuda`` (kernels)."""
