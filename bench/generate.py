"""Generation speed: femtotron's sampler with its key/value cache against the loop without one (the whole
context through the model for every token, as `generate` did before) and against transformers' `generate`,
greedy, on the same weights (the debug model's shape, examples/debug.yaml), in one process.

    python bench/generate.py [--new-tokens 256] [--repeats 3] [--threads N]

Prints tokens/s of each (median of the repeats, run in turn) and the ratios; the three must agree token for
token (greedy).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import headline  # also puts tests/ on the path for the HF reference below
from helpers import hf_llama

from femtotron.config import load_config
from femtotron.generate import sample
from femtotron.metrics import processor_name
from femtotron.models.llama import Llama


def uncached(model: Llama, ids: list[int], new: int) -> list[int]:
    ids, window = list(ids), model.cfg.max_position_embeddings
    for _ in range(new):
        ids.append(int(model.logits(torch.tensor([ids[-window:]]))[0, -1].argmax()))
    return ids[-new:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config("examples/debug.yaml").model.model_config_
    model = Llama(cfg, std=0.02, seed=0, dtype=torch.float32, device=torch.device("cpu")).eval()
    hf = hf_llama(cfg, dict(model.state_dict())).eval()
    prompt = [0]
    runs = {
        "femtotron, cache": lambda: sample(model, prompt, args.new_tokens, temperature=0),
        "femtotron, no cache (before)": lambda: uncached(model, prompt, args.new_tokens),
        "transformers generate": lambda: hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),  # else the pad id counts as padding
            max_new_tokens=args.new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, 1:].tolist(),
    }
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    tokens: dict[str, list[int]] = {}
    with torch.no_grad():
        for _ in range(args.repeats):
            for name, run in runs.items():
                start = time.perf_counter()
                tokens[name] = run()
                seconds[name].append(time.perf_counter() - start)
    print(
        f"{args.new_tokens} new tokens, greedy, debug model ({cfg.num_hidden_layers} layers, hidden "
        f"{cfg.hidden_size}, vocab {cfg.vocab_size}, {cfg.max_position_embeddings} positions), fp32, "
        f"{args.threads} thread(s), {processor_name() or 'CPU'}; median of {args.repeats}"
    )
    rate = {name: args.new_tokens / statistics.median(s) for name, s in seconds.items()}
    for name in runs:
        print(f"  {name:30s} {rate[name]:8.1f} tokens/s")
    print(
        f"cache / no cache: {rate['femtotron, cache'] / rate['femtotron, no cache (before)']:.2f}x; "
        f"femtotron / transformers: {rate['femtotron, cache'] / rate['transformers generate']:.2f}x"
    )
    for baseline in ("femtotron, no cache (before)", "transformers generate"):
        headline(
            f"generation tokens/s, {args.new_tokens} greedy tokens, debug model: femtotron with its KV cache "
            f"/ {baseline}",
            rate["femtotron, cache"],
            rate[baseline],
        )
    agree = len({tuple(t) for t in tokens.values()}) == 1
    print(f"the same tokens from all three: {agree}")


if __name__ == "__main__":
    main()
