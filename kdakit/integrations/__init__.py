"""Engine integrations: kdakit's kernels installed into a serving engine without editing it."""
