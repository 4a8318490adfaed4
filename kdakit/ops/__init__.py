"""One module per op: its Triton kernel, its launcher and its entry point."""
