"""Texts to measure on. Built-in sources come with every Python install, so defaults never need a download."""

from __future__ import annotations

import sysconfig
from pathlib import Path

BUILTIN_TEXTS = ("python-docs", "stdlib-code", "stdlib-code-train", "wikitext2")
DEFAULT_TEXT = "python-docs"  # what the comparison measures when no text is named (prose on every Python install)

# A fixed list keeps the stdlib-code text identical across machines of the same Python version.
STDLIB_MODULES = (
    "argparse.py",
    "ast.py",
    "calendar.py",
    "configparser.py",
    "csv.py",
    "dataclasses.py",
    "difflib.py",
    "fractions.py",
    "functools.py",
    "heapq.py",
    "inspect.py",
    "ipaddress.py",
    "logging/__init__.py",
    "pathlib.py",
    "pickle.py",
    "pprint.py",
    "shutil.py",
    "statistics.py",
    "string.py",
    "subprocess.py",
    "tarfile.py",
    "textwrap.py",
    "threading.py",
    "typing.py",
    "zipfile.py",
)


# Disjoint from STDLIB_MODULES: code to train or calibrate on without touching the code we measure on.
TRAIN_CODE_MODULES = (
    "asyncio/base_events.py",
    "collections/__init__.py",
    "email/message.py",
    "enum.py",
    "ftplib.py",
    "gettext.py",
    "http/client.py",
    "imaplib.py",
    "json/decoder.py",
    "locale.py",
    "optparse.py",
    "random.py",
    "smtplib.py",
    "tempfile.py",
    "traceback.py",
    "unittest/case.py",
    "urllib/parse.py",
    "uuid.py",
    "weakref.py",
    "xml/etree/ElementTree.py",
)


def python_docs() -> str:
    """Prose: the help topics of the Python documentation (`pydoc_data.topics`)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def stdlib_code(modules: tuple[str, ...] = STDLIB_MODULES) -> str:
    """Code: sources of a fixed list of standard-library modules (`TRAIN_CODE_MODULES` for training)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = [(root / name).read_text(encoding="utf-8") for name in modules if (root / name).exists()]
    if not parts:
        raise FileNotFoundError(f"no standard-library sources found under {root}")
    return "\n\n".join(parts)


def wikitext2() -> str:
    """WikiText-2 (raw) test split through `datasets` (needs the network or a local datasets cache)."""
    try:
        from datasets import load_dataset
    except ImportError as err:
        raise ImportError("--text wikitext2 needs the `datasets` package (pip install datasets)") from err
    data = load_dataset("wikitext", "wikitext-2-raw-v1", split="test")
    return "\n\n".join(data["text"])


def load_text(source: str) -> str:
    """A built-in source name (`python-docs`, `stdlib-code`, `stdlib-code-train`, `wikitext2`) or a file path."""
    if source == "python-docs":
        return python_docs()
    if source == "stdlib-code":
        return stdlib_code()
    if source == "stdlib-code-train":
        return stdlib_code(TRAIN_CODE_MODULES)
    if source == "wikitext2":
        return wikitext2()
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"--text must be one of {BUILTIN_TEXTS} or an existing file, got {source!r}")
    return path.read_text(encoding="utf-8")
