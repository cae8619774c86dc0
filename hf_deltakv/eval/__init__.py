"""Measurement: perplexity and KL divergence through a cache, text sources, per-layer K/V statistics."""
