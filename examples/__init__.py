"""Example training scripts and models (importable as `examples.*` from the repository root)."""
