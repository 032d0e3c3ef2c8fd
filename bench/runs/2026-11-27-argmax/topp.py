"""ms a top-p sampling step takes per row (`target_probs`, one torch thread), on the embedded
SmolLM2-135M-Instruct's own logits (80 positions of a sampled answer): every token sorted
(as before) against `top_p_mask`'s candidates (now), taking turns; and how many tokens the
top-p set keeps.

Usage, from a clone of the commit measured: `PYTHONPATH=$PWD python topp.py`.
"""

import functools
import timeit

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from workers.engine.loader import default_cache_dir
from workers.speculation import sampling
from workers.speculation.sampling import SamplingParams, target_probs

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def full_sort(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """top_p_mask as it was (e256e8a): every token of every row sorted."""
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    keep_sorted = sorted_p.cumsum(dim=-1) - sorted_p < top_p
    keep_sorted[..., 0] = True
    return torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    path = default_cache_dir() / "models" / "smollm2-135m-instruct"
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    messages = [{"role": "user", "content": PROMPT}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    out = model.generate(ids, max_new_tokens=80, do_sample=True, temperature=0.7, top_p=0.9)
    with torch.no_grad():
        logits = model(out).logits[0, ids.shape[1] - 1 : -1]  # (80, V)
    rows = len(logits)
    now = sampling.top_p_mask
    for temperature, top_p in ((0.7, 0.9), (1.0, 0.95)):
        params = SamplingParams(temperature=temperature, top_p=top_p)
        probs = torch.softmax(logits / temperature, dim=-1)
        kept = full_sort(probs, top_p).sum(dim=-1).float()
        assert torch.equal(now(probs, top_p), full_sort(probs, top_p))
        print(
            f"T {temperature} top_p {top_p}: kept median {kept.median():.0f}, max {kept.max():.0f}"
        )
        for turn in range(2):
            for name, mask in (("before", full_sort), ("now", now)):
                sampling.top_p_mask = mask
                step = functools.partial(target_probs, logits, params)
                ms = min(timeit.repeat(step, number=2, repeat=3))
                print(f"  turn {turn} {name}: {ms / 2 / rows * 1e3:.2f} ms a row")
        sampling.top_p_mask = now


if __name__ == "__main__":
    main()
