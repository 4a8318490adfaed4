import os

# Kernels are jitted at import: the interpreter must be chosen before kdakit loads.
os.environ.setdefault("TRITON_INTERPRET", "1")
