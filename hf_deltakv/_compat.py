"""What the installed libraries must offer, checked when hf_deltakv is imported."""

from __future__ import annotations

# The oldest transformers served (pyproject.toml's pin, tested equal): the first whose models take `cache=`. Older ones
# take `past_key_values=` only and pass an unknown `cache=` through their kwargs unread, so the library's own calls
# (its RoPE probe, perplexity, lm-eval, training) would run with no compressed cache at all, silently.
MIN_TRANSFORMERS = "5.24"


def _check_transformers(version: str) -> None:
    from packaging.version import Version

    if Version(version) < Version(MIN_TRANSFORMERS):
        raise ImportError(
            f"hf_deltakv needs transformers>={MIN_TRANSFORMERS} (found {version}): older versions do not take "
            f"`cache=` and would run without the compressed cache. Upgrade: pip install -U 'transformers>="
            f"{MIN_TRANSFORMERS}'"
        )


def _installed_transformers() -> str:
    import transformers

    return transformers.__version__


_check_transformers(_installed_transformers())
