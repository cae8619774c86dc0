"""Evaluation: perplexity through a cache, text sources."""
