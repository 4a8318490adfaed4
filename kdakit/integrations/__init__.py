"""Integrations of kdakit's kernels into other libraries' models (each imported on its own;
nothing here imports an optional package)."""
