"""Checkpoints: object stores, the manifest commit protocol, save, load and retention."""
