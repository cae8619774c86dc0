"""Documents for the offline rolling-perplexity tasks: a local text file or a built-in text, cut at blank lines
into documents of about `doc_chars` characters, like WikiText's document-level split."""

from __future__ import annotations

import re


def split_documents(text: str, doc_chars: int = 4000, max_docs: int | None = None) -> list[str]:
    """Consecutive paragraphs grouped into documents of at most ~`doc_chars` characters (one long paragraph is
    its own document)."""
    docs: list[str] = []
    current = ""
    for paragraph in re.split(r"\n\s*\n", text):
        if not paragraph.strip():
            continue
        if current and len(current) + len(paragraph) + 2 > doc_chars:
            docs.append(current)
            current = ""
        current = f"{current}\n\n{paragraph}" if current else paragraph
    if current:
        docs.append(current)
    return docs[:max_docs] if max_docs else docs


def load_documents(text: str = "python-docs", doc_chars: int = 4000, max_docs: int = 16, **_):
    """`custom_dataset` for lm-eval: a `test` split with one `page` per document. `text` is a built-in source
    (`python-docs`, `stdlib-code`) or a file path, set with `--metadata '{"text": "path/to/file.txt"}'`."""
    from datasets import Dataset, DatasetDict

    from hf_deltakv.eval.texts import load_text

    pages = split_documents(load_text(text), int(doc_chars), int(max_docs) if max_docs else None)
    return DatasetDict({"test": Dataset.from_dict({"page": pages})})


def process_results(doc: dict, results: tuple[float]) -> dict:
    """Word and byte perplexity of one document (the metrics of lm-eval's wikitext task)."""
    (loglikelihood,) = results
    words = len(re.split(r"\s+", doc["page"]))
    nbytes = len(doc["page"].encode("utf-8"))
    return {
        "word_perplexity": (loglikelihood, words),
        "byte_perplexity": (loglikelihood, nbytes),
        "bits_per_byte": (loglikelihood, nbytes),
    }
