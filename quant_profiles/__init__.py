"""Shipped quantization recipes, one TOML file per profile (see README.md in this folder)."""
