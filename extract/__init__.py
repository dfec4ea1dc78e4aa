"""Extraction stage: backbones, image data, the extraction pipeline and its CLI."""
