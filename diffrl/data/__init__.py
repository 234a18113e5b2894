"""Datasets and synthetic worlds."""
