"""Weight skip on the embedded default model: for each calibrated sparsity, the fraction of weights left unread while
decoding, how fast it decodes, and whether the greedy answer changes (the first call calibrates, a few seconds).

python examples/weight_skip.py
"""

from __future__ import annotations

import time

import torch

from hf_deltakv import enable_weight_skip
from hf_deltakv.models import load_model


def main() -> None:
    model, tokenizer = load_model()
    messages = [{"role": "user", "content": "Give three reasons why the sky is blue."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt_length = inputs["input_ids"].shape[1]

    def generate() -> tuple[torch.Tensor, float]:
        start = time.perf_counter()
        out = model.generate(**inputs, max_new_tokens=40, do_sample=False)
        return out[0, prompt_length:], time.perf_counter() - start

    plain, seconds = generate()
    print(f"plain model: {seconds:.2f} s\n{tokenizer.decode(plain, skip_special_tokens=True)!r}\n")
    for sparsity in (0.1, 0.25, 0.4):
        with enable_weight_skip(model, sparsity=sparsity) as handle:
            tokens, seconds = generate()
        total = handle.stats()["total"]
        same = tokens.shape == plain.shape and bool((tokens == plain).all())
        print(
            f"sparsity {sparsity:g}: {100 * total['skipped_fraction']:.1f} % of the weights not read, "
            f"{seconds:.2f} s, {'same answer' if same else 'answer changed:'}"
        )
        if not same:
            print(f"  {tokenizer.decode(tokens, skip_special_tokens=True)!r}")


if __name__ == "__main__":
    main()
