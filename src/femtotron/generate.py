"""Sample text from a trained run: the run's saved config, weights and tokenizer."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from femtotron.config import Config
from femtotron.data.tokenizer import eos_token_id, load_tokenizer
from femtotron.errors import FemtotronError
from femtotron.models.llama import KVCache, Llama
from femtotron.serialize.hf import HF_CONFIG, read_as_run
from femtotron.serialize.weights import CONFIG_FILE, TOKENIZER_FILE, load_weights


def load_run(run_dir: str | Path, device: str = "cpu") -> tuple[Config, Llama]:
    """The fp32 model of `run_dir` (from `femtotron train`, `consolidate`, `import-hf`; or an HF Llama)."""
    run_dir = Path(run_dir)
    if not (run_dir / CONFIG_FILE).is_file() and (run_dir / HF_CONFIG).is_file():
        config, weights = read_as_run(run_dir)
    else:
        config, weights = load_weights(run_dir, device)
    # The init's std and seed are only used to build the model; every weight is then loaded over it.
    model = Llama(
        config.model.model_config_,
        std=config.model.init_method.std,
        seed=config.general.seed,
        dtype=torch.float32,
        device=torch.device(device),
    )
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        raise FemtotronError(
            f"the weights in {run_dir} do not hold this run's model ({run_dir / CONFIG_FILE}): "
            f"{str(e).splitlines()[0]}. Re-run the training that wrote them."
        ) from None
    return config, model.eval()


@torch.no_grad()
def sample(
    model: Llama,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
    stop_ids: frozenset[int] = frozenset(),
) -> list[int]:
    """Autoregressive sampling (temperature 0: greedy) with a key/value cache. When the context outgrows the
    model's max_position_embeddings it is cropped to its last half and the cache rebuilt from those tokens:
    RoPE knows no positions beyond the window, so the cache cannot slide, and cropping to the whole window
    would rebuild it for every new token."""
    generator = torch.Generator().manual_seed(seed)
    ids = list(prompt_ids)
    window = model.cfg.max_position_embeddings
    kept = max(1, window // 2)  # one rebuild per `window - kept` new tokens
    device = model.embed_tokens.weight.device
    cache = KVCache()
    feed = ids[-window:]  # the tokens the model has not seen yet
    for _ in range(max_new_tokens):
        if cache.length + len(feed) > window:
            cache = KVCache()
            feed = ids[-kept:]
        inputs = torch.tensor([feed], device=device)
        logits = model.logits(inputs, cache)[0, -1].float().cpu()
        if temperature <= 0:
            next_id = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k is not None and 0 < top_k < logits.numel():
                cutoff = logits.topk(top_k).values[-1]
                logits = logits.masked_fill(logits < cutoff, float("-inf"))
            next_id = int(torch.multinomial(logits.softmax(-1), 1, generator=generator))
        ids.append(next_id)
        feed = [next_id]
        if next_id in stop_ids:
            break
    return [i for i in ids[len(prompt_ids) :] if i not in stop_ids]


@dataclass(frozen=True)
class PromptConvention:
    """How a prompt becomes the model's first tokens, and which tokens end the text."""

    prompt_ids: list[int]
    stop_ids: frozenset[int]
    description: str  # for the log


def prompt_convention(config: Config, tokenizer: Tokenizer, prompt: str) -> PromptConvention:
    """The conventions the model was trained with (`tokenizer.add_special_tokens`): a Hugging Face model's
    tokenizer post-processor (BOS, or nothing) and its generation_config.json's EOS ids; or, for a model
    femtotron trained on EOS-separated documents, an EOS first, as a fresh document begins."""
    if config.tokenizer.add_special_tokens:
        prompt_ids = tokenizer.encode(prompt).ids
        stop_ids = frozenset(config.tokenizer.eos_token_ids) or frozenset({eos_token_id(tokenizer)})
        added = prompt_ids[: len(prompt_ids) - len(tokenizer.encode(prompt, add_special_tokens=False).ids)]
        begins = f"with {tokenizer.decode(added, skip_special_tokens=False)!r}" if added else "with nothing"
        description = f"the tokenizer's post-processor begins the prompt {begins}"
    else:
        eos = eos_token_id(tokenizer)
        prompt_ids = [eos] + tokenizer.encode(prompt, add_special_tokens=False).ids
        stop_ids = frozenset({eos})
        description = (
            f"the prompt begins after EOS ({tokenizer.id_to_token(eos)!r}), as a document in training"
        )
    names = ", ".join(repr(tokenizer.id_to_token(i)) for i in sorted(stop_ids))
    return PromptConvention(prompt_ids, stop_ids, f"{description}; generation stops at {names}")


def generate_text(
    run_dir: str | Path,
    prompt: str,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
) -> str:
    config, model = load_run(run_dir)
    # Training copies the tokenizer into the run directory, so a run can be sampled from anywhere.
    tokenizer_path = Path(run_dir) / TOKENIZER_FILE
    if not tokenizer_path.is_file():
        if config.tokenizer.tokenizer_name_or_path is None:
            raise FemtotronError(
                f"{run_dir} has no tokenizer.json and its config.yaml no tokenizer.tokenizer_name_or_path: "
                f"copy the model's tokenizer.json into {run_dir} (for a run of yours: the one its data was "
                "preprocessed with; set tokenizer.tokenizer_name_or_path for the next run)."
            )
        tokenizer_path = Path(config.tokenizer.tokenizer_name_or_path)
    tokenizer = load_tokenizer(tokenizer_path)
    convention = prompt_convention(config, tokenizer, prompt)
    print(f"generate: {convention.description}", file=sys.stderr)
    new_ids = sample(
        model,
        convention.prompt_ids,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        seed=seed,
        stop_ids=convention.stop_ids,
    )
    return prompt + tokenizer.decode(new_ids)
