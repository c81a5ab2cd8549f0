"""Bundled data: LAVE demonstration sets and a sample VQA file."""
