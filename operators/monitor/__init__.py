"""Monitors over what the pipeline wrote: embedding drift (``embedding_drift``)."""
