"""Trained models back from disk for inference: generation, lm-eval and export (scripts/)."""
