"""Long contexts, where a compressed cache is needed: error against length, retrieval, multi-turn, memory.

One pass per model over one long real document (WikiText-2 test) read through every cache in chunks of `--chunk`
tokens, all caches in lockstep (each chunk attends to the history as that cache stores it):
a. error against length: KL divergence from DynamicCache (the model's own cache, fp32: fp16 storage differs from it
   by ~2e-4 in the logits, tests/test_families.py) per position bucket (every `--stride`-th position);
b. retrieval, RULER-style multi-key needles (Qwen2.5-Coder only, the model of the three that retrieves): the document
   is a chat turn whose text carries "One of the special magic numbers for <key> is: <7 digits>." needles, 10 per
   context length at depths 5 %, 15 %, ..., 95 % of that length (each a distractor for the others); when the
   document reaches 4K, 8K, 16K and 32K tokens, every cache is asked for each of that length's needles (a copy of
   the cache per question, the question ending the turn), greedy, correct when the 7 digits come back, with the
   right digits' teacher-forced margin (`answer_margin`: a near tie any cache may flip, or a loss of the cache's);
c. multi-turn: at 8K, the 10 questions of that length in successive turns on one copy of each cache (its own
   answers carried), answers compared with DynamicCache's turn by turn;
d. memory: a separate process per cache and length (prefill in chunks + 64 greedy decoding steps; 16 in --quick):
   peak resident memory, and above the loaded model; bytes held after the prefill and after decoding.
Eviction baselines decide what to drop after every chunk, before any question is known (as in a conversation over
a long shared context).

    python benchmarks/long_context.py                     # all parts, three models to 32K (hours on 2 cores)
    python benchmarks/long_context.py --max-tokens 8192   # every model to 8K (35 min + memory runs)
    python benchmarks/long_context.py --quick             # SmolLM2 to 1K, 2 needles: the CI's version (~1 min)
    python benchmarks/long_context.py --models gemma3-270m --no-memory      # one model; the other rows stay
    python benchmarks/long_context.py --memory-only --memory-lengths 32768   # memory rows only, merged into the JSON
    python benchmarks/long_context.py --models qwen2.5-coder-0.5b --caches delta --ask-cells 32768 --no-memory \
        --out benchmarks/results/long_context_32k.json    # one cell beside DynamicCache, in its own file
    python benchmarks/long_context.py --models qwen2.5-coder-0.5b --caches delta --max-tokens 16384 --needles 20 \
        --ask-cells 16384 --no-memory --out benchmarks/results/long_context_16k_20.json   # 20 trials in one cell
    python benchmarks/long_context.py --models qwen2.5-coder-0.5b --caches delta --max-tokens 16384 --draw 1 \
        --ask-cells 16384 --no-memory --out benchmarks/results/long_context_16k_draw1.json   # 10 more trials

Writes benchmarks/results/long_context.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import random
import re
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from paths import RESULTS, WIKITEXT_TEST, cache_bytes, fp16_bytes, reachable_bytes
from transformers.cache_utils import DynamicCache

from hf_deltakv.cli import split_specs
from hf_deltakv.compare import write_json
from hf_deltakv.models import load_model
from hf_deltakv.registry import build_cache

SPECS = {"delta-3.5": "delta:kf=64,key_bits=2.75,values=q3_0"}  # names of this table for longer specs
# Model -> (tokens, caches). A 32K pass of Qwen2.5-Coder-0.5B costs ~12 min per cache on 2 cores, so the two 32K
# models read fewer caches than SmolLM2 (8K), which reads KIVI's layout too; the retrieval model reads the 3.5-bit
# setting and both eviction baselines beside ours.
MODELS = {
    "qwen2.5-coder-0.5b": (32768, ("delta", "delta-3.5", "streaming-llm", "snapkv")),
    "smollm2-135m": (8192, ("delta", "delta-3.5", "kivi-pre-rope", "streaming-llm", "snapkv")),
    "gemma3-270m": (32768, ("delta",)),
}  # fmt: skip
RETRIEVAL_MODEL = "qwen2.5-coder-0.5b"
BUCKETS = (0, 512, 1024, 2048, 4096, 8192, 16384, 32768)
CELLS = (4096, 8192, 16384, 32768)
NEEDLES_PER_CELL = 10
DRAW = 0  # which draw of needles (`needles`); --draw
MULTI_TURN_CELL = 8192
ANSWER_TOKENS = 9  # " 1234567." and the end of the turn
NOUNS = ("river", "lantern", "orchard", "comet", "harbor", "violin", "glacier", "meadow", "falcon", "quartz", "canyon",
         "saffron", "compass", "pylon", "ember", "thicket", "marble", "cobalt", "tundra", "beacon")  # fmt: skip
ADJECTIVES = ("silent", "amber", "hollow", "rapid", "velvet", "brisk", "lunar", "crimson", "gentle", "rustic")


def needles(length: int, seed: int, taken: frozenset[str] = frozenset(), draw: int = 0) -> list[dict]:
    """Key-value needles at depths 5 %, 15 %, ..., 95 % of `length`: unique keys, 7-digit values. A key some shorter
    length's needle already uses (`taken`) is drawn again, so no question has two answers in one document. Another
    `draw` (> 0) draws other keys and values at the same depths: more trials of the same cells (draw 0: the fixed
    document)."""
    rng = random.Random(seed if not draw else f"{seed}/{draw}")
    every = [f"{a}-{n}" for a in ADJECTIVES for n in NOUNS]
    keys = rng.sample(every, NEEDLES_PER_CELL)
    rows = [{"key": k, "value": str(rng.randrange(10**6, 10**7)), "depth": (i + 0.5) / NEEDLES_PER_CELL,
             "cell": length} for i, k in enumerate(keys)]  # fmt: skip
    free = [key for key in every if key not in taken | set(keys)]
    for row in rows:  # redrawn after the values, so every needle whose key was free is as it always was
        if row["key"] in taken:
            row["key"] = free.pop(rng.randrange(len(free)))
    return rows


def document_needles(max_len: int) -> list[dict]:
    """Every needle of the cells a document of `max_len` tokens reaches, keys unique across them."""
    rows: list[dict] = []
    for cell in (c for c in CELLS if c <= max_len):
        rows += needles(cell, cell, frozenset(n["key"] for n in rows), DRAW)
    return rows


def build_document(tokenizer, max_len: int, with_needles: bool) -> tuple[torch.Tensor, list[dict], list[int]]:
    """Token ids of the document (a chat turn for the retrieval model), the needles placed (with their token
    position) and the chat prefix's length."""
    text = WIKITEXT_TEST.read_text()
    prefix = []
    if with_needles:
        prefix = tokenizer.apply_chat_template([{"role": "user", "content": "PLACEHOLDER"}], tokenize=False,
                                               add_generation_prompt=False).split("PLACEHOLDER")[0]  # fmt: skip
        prefix = tokenizer(prefix + "Read the text below; questions about it follow.\n\n").input_ids
    body = tokenizer(text[: max_len * 8]).input_ids
    placed, after = [], 0  # `after`: where the last needle placed ends in `body`
    if with_needles:  # in order of position, each at its depth of the document as it ends up (earlier needles in)
        for needle in sorted(document_needles(max_len), key=lambda n: n["depth"] * n["cell"]):
            at = max(int(needle["depth"] * needle["cell"]) - len(prefix), after)
            sentence = tokenizer(
                f" One of the special magic numbers for {needle['key']} is: {needle['value']}. "
            ).input_ids
            body, after = body[:at] + sentence + body[at:], at + len(sentence)
            placed.append({**needle, "position": len(prefix) + at, "end": len(prefix) + at + len(sentence)})
            if placed[-1]["end"] > needle["cell"]:
                raise ValueError(f"the needle at {needle['depth']:.0%} of {needle['cell']} tokens ends past them")
    ids = torch.tensor(prefix + body)[:max_len]
    return ids, placed, len(prefix)


def question_ids(tokenizer, key: str) -> torch.Tensor:
    """The rest of the user's turn (the question) and the start of the answer."""
    question = (f"\n\nWhat is the special magic number for {key} mentioned in the text above? Answer with the number "
                "only.")  # fmt: skip
    turn = tokenizer.apply_chat_template([{"role": "user", "content": "PLACEHOLDER"}], tokenize=False,
                                         add_generation_prompt=True).split("PLACEHOLDER")[1]  # fmt: skip
    return tokenizer(question + turn + f"The special magic number for {key} is", return_tensors="pt").input_ids


@torch.no_grad()
def answer(model, cache, ids: torch.Tensor) -> list[int]:
    """Greedy answer tokens after feeding `ids` (the question) through `cache`."""
    out, token = [], None
    logits = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits
    for _ in range(ANSWER_TOKENS):
        token = logits[:, -1].argmax(-1, keepdim=True)
        out.append(int(token))
        logits = model(token, cache=cache, use_cache=True).logits
    return out


@torch.no_grad()
def answer_margin(model, cache, ids: torch.Tensor, tokenizer, value: str) -> float:
    """How surely the model gives the right number after the question `ids`, teacher-forced on " <value>": the
    smallest, over the value's digit tokens, of the right token's logit minus the best other token's (the log-prob
    margin; negative: greedy decoding leaves the value there). A miss near 0 is a near tie the model makes with any
    cache, one far below 0 where the ceiling is far above is what a cache lost."""
    target = tokenizer(" " + value, return_tensors="pt").input_ids
    logits = model(torch.cat([ids, target], dim=1), cache=cache, use_cache=True,
                   logits_to_keep=target.shape[1] + 1).logits[0, :-1].float()  # fmt: skip
    margins = []
    for row, token in zip(logits, target[0].tolist(), strict=True):
        if any(ch.isdigit() for ch in tokenizer.decode([token])):
            right = float(row[token])
            row[token] = -math.inf
            margins.append(right - float(row.max()))
    return min(margins)


def make(name: str, model):
    if name == "dynamic":
        return DynamicCache(config=model.config)
    return build_cache(SPECS.get(name, name), model)


@torch.no_grad()
def run_model(
    name: str,
    max_len: int,
    caches: tuple[str, ...],
    chunk: int,
    stride: int,
    retrieval: bool,
    ask_cells: tuple[int, ...],
    first_chunk: int | None = None,
) -> dict:
    """One model's pass: KL per bucket for every cache; with `retrieval`, the needles of the cells in `ask_cells` (the
    document carries every cell's needles either way, so a cell asked alone is the cell of a full run). `first_chunk`:
    the first chunk's tokens (default `chunk`), a short prompt before the rest comes in chunks of `chunk`."""
    model, tokenizer = load_model(name)
    ids, placed, _ = build_document(tokenizer, max_len, retrieval)
    live = {n: make(n, model) for n in ("dynamic", *caches)}
    kl_sum = {n: [0.0] * (len(BUCKETS) - 1) for n in caches}
    kl_count = [0] * (len(BUCKETS) - 1)
    retrieval_rows, turns = [], {}
    started = time.time()
    first = first_chunk or chunk
    for start in (0, *range(first, ids.numel(), chunk)):
        piece = ids[start : start + (first if start == 0 else chunk)][None]
        keep = torch.arange(0, piece.shape[1], stride)  # positions scored in this chunk
        logprobs = {}
        for n, cache in live.items():
            logits = model(piece, cache=cache, use_cache=True, logits_to_keep=keep).logits[0].float()
            logprobs[n] = torch.log_softmax(logits, dim=-1)
        reference = logprobs["dynamic"]
        positions = start + keep
        bucket = torch.bucketize(positions, torch.tensor(BUCKETS[1:]), right=True)
        for b in range(len(BUCKETS) - 1):
            kl_count[b] += int((bucket == b).sum())
        for n in caches:
            kl = (reference.exp() * (reference - logprobs[n])).sum(-1)
            for b in range(len(BUCKETS) - 1):
                kl_sum[n][b] += float(kl[bucket == b].sum())
        end = start + piece.shape[1]
        if retrieval and end in ask_cells:
            for needle in (p for p in placed if p["cell"] == end):
                question = question_ids(tokenizer, needle["key"])
                for n, cache in live.items():
                    text = tokenizer.decode(answer(model, copy.deepcopy(cache), question))
                    margin = answer_margin(model, copy.deepcopy(cache), question, tokenizer, needle["value"])
                    retrieval_rows.append({"cache": n, "cell": end, "depth": needle["depth"], "key": needle["key"],
                                           "correct": needle["value"] in text, "answer": text,
                                           "margin": round(margin, 3)})  # fmt: skip
            if end == MULTI_TURN_CELL:
                turns = multi_turn(model, tokenizer, live, [p for p in placed if p["cell"] == end])
        print(f"  {name}: {end} tokens, {time.time() - started:.0f} s", file=sys.stderr, flush=True)
    nbytes = {n: cache_bytes(c) for n, c in live.items()}
    reachable = {n: reachable_bytes(c) for n, c in live.items() if hasattr(c, "nbytes")}  # what nbytes() must match
    kl_rows = [{"cache": n, "buckets": [{"from": BUCKETS[b], "to": BUCKETS[b + 1], "kl": kl_sum[n][b] / kl_count[b]}
                                        for b in range(len(BUCKETS) - 1) if kl_count[b]]} for n in caches]  # fmt: skip
    return {"model": name, "tokens": int(ids.numel()), "chunk": chunk, "first_chunk": first, "stride": stride,
            "cells": [c for c in ask_cells if c <= ids.numel()] if retrieval else [], "kl": kl_rows,
            "retrieval": retrieval_rows,
            "multi_turn": turns, "bytes_held": nbytes, "reachable_bytes": reachable,
            "fp16_bytes": fp16_bytes(live["dynamic"]),
            "seconds": round(time.time() - started, 1)}  # fmt: skip


def multi_turn(model, tokenizer, live: dict, asked: list[dict]) -> dict:
    """The questions in successive turns on one copy per cache, each cache's answers carried into its next turn."""
    answers = {}
    end_turn = tokenizer("<|im_end|>\n<|im_start|>user\n", return_tensors="pt").input_ids  # ChatML
    for n, cache in live.items():
        carried, out = copy.deepcopy(cache), []
        for needle in asked:
            tokens = answer(model, carried, question_ids(tokenizer, needle["key"]))
            text = tokenizer.decode(tokens)
            out.append({"key": needle["key"], "tokens": tokens, "answer": _number(text),
                        "correct": needle["value"] in text})  # fmt: skip
            model(end_turn, cache=carried, use_cache=True)
        answers[n] = out
    reference = answers.get("dynamic", [])
    for n, out in answers.items():
        pairs = list(zip(out, reference, strict=True))
        answers[n] = {"turns": out, "same_as_dynamic": sum(a["answer"] == r["answer"] for a, r in pairs),
                      "same_tokens_as_dynamic": sum(a["tokens"] == r["tokens"] for a, r in pairs),
                      "correct": sum(a["correct"] for a in out), "of": len(out)}  # fmt: skip
    return answers


def _number(text: str) -> str:
    """The answer a turn gives: its first run of digits (the rest of the 9 tokens is the turn's end)."""
    found = re.search(r"\d+", text)
    return found.group(0) if found else text.strip()


DECODE_STEPS = 64  # decoding steps after the prefill in the memory runs


def memory_child(name: str, cache_name: str, length: int, chunk: int, steps: int) -> dict:
    """In a fresh process: RSS after the model loads, peak RSS of prefill + `steps` decoding steps, bytes held."""
    torch.set_grad_enabled(False)
    model, tokenizer = load_model(name)
    ids = torch.tensor(tokenizer(WIKITEXT_TEST.read_text()[: length * 8]).input_ids[:length])[None]
    model(ids[:, :16], cache=DynamicCache(config=model.config), use_cache=True)  # weights paged in (mmapped files)
    baseline = _rss_now()
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) from here on: loading the model is not counted
    cache = make(cache_name, model)
    for start in range(0, length, chunk):
        logits = model(ids[:, start : start + chunk], cache=cache, use_cache=True, logits_to_keep=1).logits
    after_prefill = cache_bytes(cache)
    token = logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(steps):
        token = model(token, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
    peak = _peak_rss()
    return {"model": name, "cache": cache_name, "tokens": length, "peak_rss": peak, "model_rss": baseline,
            "peak_above_model": peak - baseline, "held_after_prefill": after_prefill,
            "held_after_decode": cache_bytes(cache), "decode_steps": steps}  # fmt: skip


def _peak_rss() -> int:
    """VmHWM: the process's peak resident memory since the last reset (bytes)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rss_now() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory(
    name: str,
    caches: tuple[str, ...],
    lengths: tuple[int, ...],
    chunk: int,
    steps: int,
    rows: list[dict],
    save: Callable[[bool], None],
) -> None:
    """One fresh process per cache and length (the peak is the process's own), each row saved as it comes."""
    for length in lengths:
        for cache_name in caches:
            job = f"{name},{cache_name},{length},{chunk},{steps}"
            done = subprocess.run([sys.executable, __file__, "--memory-child", job],
                                  capture_output=True, text=True, cwd=Path(__file__).parent)  # fmt: skip
            if done.returncode:
                raise RuntimeError(f"memory run {cache_name} @ {length} failed: {done.stderr[-2000:]}")
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"  memory {cache_name} @ {length}: peak {rows[-1]['peak_rss'] / 2**20:.0f} MiB", file=sys.stderr)
            save(False)


def kept(earlier: dict | None, config: dict, models: dict, asked: set) -> tuple[dict, list[dict], list[dict]]:
    """What a run starts from: `config` with the earlier runs and caches read, the earlier rows of the models it
    does not read, and the earlier memory rows of the (model, cache, length) cells it does not measure."""
    config = {**config, "caches": {}, "runs": []}
    results, memory_rows = [], []
    if earlier:
        config.update(caches=dict(earlier["config"]["caches"]), runs=list(earlier["config"]["runs"]))
        results = [row for row in earlier["models"] if row["model"] not in models]
        memory_rows = [row for row in earlier["memory"] if (row["model"], row["cache"], row["tokens"]) not in asked]
    config["caches"].update({name: list(caches) for name, (_, caches) in models.items()})
    return config, results, memory_rows


def main(argv: list[str] | None = None) -> int:
    global CELLS, MULTI_TURN_CELL, NEEDLES_PER_CELL, DRAW
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="SmolLM2 to 1K tokens, every part (the CI's version)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--caches", default=None, help="caches for every model (default: each model's, MODELS)")
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument(
        "--first-chunk",
        type=int,
        default=None,
        help="the first chunk's tokens (a short prompt; default --chunk), the rest in --chunk",
    )
    parser.add_argument("--stride", type=int, default=4, help="score every stride-th position")
    parser.add_argument("--memory-caches", default="dynamic,delta")
    parser.add_argument("--memory-lengths", default="8192,32768")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--memory-only", action="store_true", help="only the memory runs, merged into --out's rows")
    parser.add_argument("--max-tokens", type=int, default=None, help="cap every model's document (and memory runs)")
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--needles", type=int, default=NEEDLES_PER_CELL, help="needles per cell (a new document)")
    parser.add_argument("--draw", type=int, default=0, help="another draw of the needles (more trials; 0: fixed)")
    parser.add_argument("--ask-cells", default=None,
                        help="retrieval cells asked, e.g. 32768 (default: every one reached; multi-turn runs only if "
                             "its cell is asked)")  # fmt: skip
    parser.add_argument("--out", default=str(RESULTS / "long_context.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    if args.memory_child:
        name, cache_name, length, chunk, steps = args.memory_child.split(",")
        print(json.dumps(memory_child(name, cache_name, int(length), int(chunk), int(steps))))
        return 0
    override = split_specs(args.caches) if args.caches else None  # "delta:values=q8_0,key_bits=5,kivi": two caches
    cap = args.max_tokens or max(BUCKETS)
    models = {m: (min(MODELS[m][0], cap), override or MODELS[m][1]) for m in args.models.split(",")}
    memory_lengths = tuple(n for n in (int(n) for n in args.memory_lengths.split(",")) if n <= cap) or (cap,)
    memory_caches = tuple(args.memory_caches.split(","))
    most = len(ADJECTIVES) * len(NOUNS) // len(CELLS)  # keys stay unique over every cell's needles
    if not 1 <= args.needles <= most:
        parser.error(f"--needles must be 1 to {most} (unique keys)")
    if args.draw < 0:
        parser.error("--draw must be 0 (the fixed document) or more")
    NEEDLES_PER_CELL, DRAW = args.needles, args.draw
    if args.quick:  # every part, small: ~1 min (two chunks, so eviction acts between them)
        models, memory_lengths = {"smollm2-135m": (1024, override or ("delta", "snapkv"))}, (1024,)
        memory_caches, args.chunk = ("dynamic", "delta"), 512
        CELLS, MULTI_TURN_CELL, NEEDLES_PER_CELL = (1024,), 1024, 2
    CELLS = tuple(c for c in CELLS if c <= max(length for length, _ in models.values()))
    MULTI_TURN_CELL = min(MULTI_TURN_CELL, max(CELLS))  # a shorter run asks its turns at its longest cell
    ask_cells = CELLS
    if args.ask_cells:
        given = [c.strip() for c in args.ask_cells.split(",")]
        if not all(c.isdigit() for c in given) or not {int(c) for c in given} <= set(CELLS):
            parser.error(f"--ask-cells must be among the cells this run reaches, {CELLS}")
        ask_cells = tuple(int(c) for c in given)
    if args.memory_only:
        models = {}
    retrieval_model = RETRIEVAL_MODEL if not args.quick else "smollm2-135m"
    memory_model = retrieval_model if retrieval_model in models or args.memory_only else next(iter(models))
    asked = set() if args.no_memory else {(memory_model, c, n) for c in memory_caches for n in memory_lengths}
    # What this run does not measure stays as --out has it (other models, other memory cells): a long run can be
    # done a model at a time. --quick starts afresh.
    earlier = json.loads(Path(args.out).read_text()) if Path(args.out).exists() and not args.quick else None
    started = time.time()
    run = {"date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:] if argv is None else argv,
           "models": list(models), "memory": sorted(f"{m} {c} @ {n}" for m, c, n in asked)}  # fmt: skip
    config = {"specs": SPECS, "needles_per_cell": NEEDLES_PER_CELL, "draw": DRAW, "text": "wikitext-2 test",
              "torch": torch.__version__, "python": platform.python_version(),
              "threads": torch.get_num_threads()}  # fmt: skip
    config, results, memory_rows = kept(earlier, config, models, asked)
    config["runs"].append(run)

    def save(done: bool) -> None:  # after every model and memory run: a long run stopped midway keeps what it measured
        run.update(seconds=round(time.time() - started, 1), complete=done)
        results.sort(key=lambda row: list(MODELS).index(row["model"]))
        write_json({"config": config, "models": results, "memory": memory_rows}, args.out)

    for name, (length, caches) in models.items():
        retrieval = name == retrieval_model
        results.append(run_model(name, length, caches, args.chunk, args.stride, retrieval, ask_cells,
                                 args.first_chunk))  # fmt: skip
        save(done=False)
    if asked:
        memory(memory_model, memory_caches, memory_lengths, args.chunk, 16 if args.quick else DECODE_STEPS,
               memory_rows, save)  # fmt: skip
    save(done=True)
    print(f"wrote {args.out} in {time.time() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
