"""The CUDA backend: kernels over NVLink inside a node (work in progress; see README "Status")."""
