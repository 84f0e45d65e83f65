"""Tools that stand apart from the method: python -m tools.gpu_check."""
