"""Serve unmodified mlx-lm models on the paged cache (filled in by the adapter modules)."""
