"""Compute kernels with a backend-dependent implementation (e.g. the MoE grouped matmul)."""
