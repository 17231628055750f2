"""Every model family of models/families.py, on tiny models transformers itself writes: imported, the logits
equal transformers'; `femtotron generate` decoding token for token as transformers' greedy `generate` with the
directory's own tokenizer conventions; exported back bit-identical and loadable by transformers. Refused
families name what they lack."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers import BF16_PATHS, assert_close_to_reference, precision_path
from safetensors import safe_open
from tokenizers import AddedToken, Tokenizer, processors

from femtotron.cli import main
from femtotron.config import LlamaConfig
from femtotron.errors import ConfigError
from femtotron.generate import load_run, prompt_convention, sample
from femtotron.models.families import FAMILIES, family_of
from femtotron.serialize.hf import HFError, read_as_run

TOKENIZER = Path(__file__).resolve().parents[2] / "examples" / "tokenizer.json"
BOS = "<|begin_of_text|>"
END = "<|end_of_text|>"
VOCAB = 2056  # the tokenizer's 2048, BOS and END, and a few ids no text maps to
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=None,  # the tokenizer's ids are in generation_config.json
    eos_token_id=None,
    pad_token_id=None,
)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
# Per family: transformers' config and model classes, its own config values, and whether its tokenizer
# begins a text with BOS (Llama 3, Mistral, Phi-3, Granite) or with nothing (Qwen, SmolLM3).
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}, True),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}, True),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, False),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 24}, False),  # 4 x 24 != 64
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"no_rope_layer_interval": 2}, False),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(embedding_multiplier=6.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=4.0),
        True,
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}, True),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}, False),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 4, "intermediate_size": 32},
        True,
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"num_experts": 4, "norm_topk_prob": True, **MOE},
        False,
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {"num_experts": 4, "shared_expert_intermediate_size": 64, **MOE},
        False,
    ),
    # Sliding windows shorter than the 40 positions the tests run: Mistral 7B v0.1, Phi-3-mini-4k, Qwen2 with
    # use_sliding_window on the layers from max_window_layers on, and Qwen3-MoE on every layer.
    "mistral window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 16}, True),
    "phi3 window": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": 16}, True),
    "qwen2 window": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
        False,
    ),
    # Dense layers among the experts: Qwen3-MoE's mlp_only_layers, Qwen2-MoE's decoder_sparse_step.
    "qwen3_moe dense": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"num_experts": 4, "mlp_only_layers": [1], **MOE},
        False,
    ),
    "qwen2_moe dense": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {"num_experts": 4, "shared_expert_intermediate_size": 64, "decoder_sparse_step": 2, **MOE},
        False,
    ),
    "qwen3_moe window": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"num_experts": 4, "use_sliding_window": True, "sliding_window": 16, **MOE},
        False,
    ),
}


def write_tokenizer(directory: Path, begins_with_bos: bool) -> list[int]:
    """The bundled tokenizer with BOS and END added, its post-processor adding BOS or nothing, and the
    tokenizer_config.json / generation_config.json transformers reads; the ids generation stops at."""
    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    tokenizer.add_special_tokens([AddedToken(BOS, special=True), AddedToken(END, special=True)])
    bos = tokenizer.token_to_id(BOS)
    if begins_with_bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)]
        )
        eos_ids = [tokenizer.token_to_id(END)]
    else:
        eos_ids = [0, tokenizer.token_to_id(END)]  # Qwen stops at either of two
    tokenizer.save(str(directory / "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": END, "pad_token": END}
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    generation = {"eos_token_id": eos_ids, "bos_token_id": bos if begins_with_bos else None}
    (directory / "generation_config.json").write_text(json.dumps(generation))
    return eos_ids


def randomized(model: torch.nn.Module) -> torch.nn.Module:
    """Every weight random (biases included, which transformers starts at zero; norms near 1), so each
    tensor's mapping is seen in the logits, and large enough that greedy decoding has no near ties."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * 0.2
            param.copy_(1 + noise if "norm" in name else noise)
    return model.float().eval()


def hf_family(directory: Path, family: str, **changes):
    """A random model of `family` saved by transformers (in several safetensors files), with a tokenizer."""
    import transformers

    config_class, model_class, values, begins_with_bos = CASES[family]
    config = getattr(transformers, config_class)(**{**SHAPE, **values, **changes})
    model = randomized(getattr(transformers, model_class)(config))
    model.save_pretrained(directory, max_shard_size="200KB")
    write_tokenizer(directory, begins_with_bos)
    return model


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118 - not a dict
    return out


def assert_logits_equal(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """fp32: the same products summed in other orders, about 1e-6 of the largest logit."""
    assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max(), (ours - theirs).abs().max()


@pytest.mark.parametrize("family", list(CASES))
def test_a_family_imports_decodes_like_transformers_and_exports_back_bit_identical(tmp_path, family, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = hf_family(tmp_path / "hf", family)
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    config, ours = load_run(tmp_path / "run")
    assert config.model.hf_architecture == CASES[family][1]
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_logits_equal(ours.logits(ids), hf(ids).logits)

    # Greedy decoding through `femtotron generate`, against transformers' with the directory's tokenizer.
    prompt = "ROMEO: But soft, what light"
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    encoded = tokenizer(prompt, return_tensors="pt")
    eos_ids = json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"]
    theirs = hf.generate(**encoded, max_new_tokens=32, do_sample=False, eos_token_id=eos_ids, pad_token_id=0)
    theirs = [i for i in theirs[0, encoded["input_ids"].shape[1] :].tolist() if i not in eos_ids]
    convention = prompt_convention(
        config, Tokenizer.from_file(str(tmp_path / "run" / "tokenizer.json")), prompt
    )
    assert convention.prompt_ids == encoded["input_ids"][0].tolist()
    assert sample(ours, convention.prompt_ids, 32, temperature=0, stop_ids=convention.stop_ids) == theirs
    capsys.readouterr()
    run = str(tmp_path / "run")
    assert main(["generate", run, "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "32"]) == 0
    printed = capsys.readouterr()
    assert printed.out == prompt + tokenizer.decode(theirs, skip_special_tokens=True) + "\n"
    begins = f"with '{BOS}'" if CASES[family][3] else "with nothing"
    assert f"the tokenizer's post-processor begins the prompt {begins}" in printed.err

    # Out again: the same tensors, bit for bit, which transformers loads as the same model.
    assert main(["export-hf", run, "--out", str(tmp_path / "back")]) == 0
    before = tensors(tmp_path / "hf")
    after = tensors(tmp_path / "back")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[name], after[name]) for name in before)
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "back").float().eval()
    assert type(again) is type(hf)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, hf(ids).logits)


@BF16_PATHS
@pytest.mark.parametrize("family", list(CASES))
def test_a_family_in_bf16_is_as_close_to_fp32_as_transformers_in_bf16(tmp_path, family, native):
    """Both models in bf16, on this CPU's two bf16 paths: femtotron's logits lie within the distance bf16
    rounding puts transformers' from the fp32 logits (assert_close_to_reference's bound), so no cast in a
    family's features is missing or misplaced; a wrong one is off by the size of the logits. Every token
    takes every expert: bf16 rounding flips near-tied routing choices in any two implementations (femtotron's
    router logits are fp32, transformers' bf16), a difference of the size of the logits."""
    values = CASES[family][2]
    experts = values.get("num_experts", values.get("num_local_experts"))
    hf = hf_family(tmp_path / "hf", family, **({"num_experts_per_tok": experts} if experts else {}))
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    _, ours = load_run(tmp_path / "run")
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), precision_path(native):
        exact = hf(ids).logits
        theirs = hf.to(torch.bfloat16)(ids).logits.float()
        got = ours.to(torch.bfloat16).logits(ids).float()
    assert_close_to_reference(got, theirs, exact, label=family)


def test_a_qwen2_moe_config_without_layer_types_slides_where_transformers_does(tmp_path):
    """config.json from before transformers 4.53 has no layer_types: Qwen2-MoE then slides on the even layers
    below max_window_layers, as transformers derives them. Odd layers instead (i % 2 == 1) put the window on
    the wrong layers, logits off by the size of the logits."""
    from transformers import AutoModelForCausalLM

    window = {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2}
    hf_family(tmp_path / "hf", "qwen2_moe", num_hidden_layers=3, **window)
    path = tmp_path / "hf" / "config.json"
    written = json.loads(path.read_text())
    assert written.pop("layer_types") == ["sliding_attention", "full_attention", "full_attention"]
    path.write_text(json.dumps(written))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()  # reads it without them
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    config, ours = load_run(tmp_path / "run")
    assert [config.model.model_config_.windowed(i) for i in range(3)] == [True, False, False]
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_logits_equal(ours.logits(ids), theirs(ids).logits)


@pytest.mark.parametrize(
    "family, changes, message",
    [
        (
            "phi3",
            {
                "rope_scaling": {
                    "rope_type": "longrope",
                    "short_factor": [1.0] * 8,
                    "long_factor": [1.0] * 8,
                    "original_max_position_embeddings": 64,
                }
            },
            "rope type 'longrope'",
        ),
        ("phi3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_what_a_family_turns_on_that_femtotron_lacks_is_refused_by_name(tmp_path, family, changes, message):
    hf_family(tmp_path / "hf", family, **changes)
    with pytest.raises(HFError, match=re.escape(message)):
        read_as_run(tmp_path / "hf")


@pytest.mark.parametrize(
    "architecture, lacks",
    [
        ("Gemma2ForCausalLM", "soft-capped attention scores and logits"),
        ("Gemma3ForCausalLM", "a RoPE of their own for its sliding-window layers"),
        ("Starcoder2ForCausalLM", "LayerNorm with biases"),
        ("GPT2LMHeadModel", "LlamaForCausalLM, MistralForCausalLM"),
    ],
)
def test_a_family_femtotron_refuses_is_named_with_what_it_lacks(tmp_path, architecture, lacks):
    hf_family(tmp_path / "hf", "llama")
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "architectures": [architecture]}))
    with pytest.raises(HFError, match=lacks):
        read_as_run(tmp_path / "hf")


def test_a_model_of_femtotrons_own_exports_as_the_first_family_that_computes_it():
    plain = LlamaConfig(vocab_size=64, hidden_size=32, num_attention_heads=4, intermediate_size=48)
    expected = [
        ({}, "LlamaForCausalLM"),
        ({"qkv_bias": True}, "Qwen2ForCausalLM"),
        ({"qk_norm": True, "head_dim": 16}, "Qwen3ForCausalLM"),
        ({"no_rope_layers": [3]}, "SmolLM3ForCausalLM"),
        ({"logits_scaling": 2.0}, "GraniteForCausalLM"),
        ({"sliding_window": 8}, "MistralForCausalLM"),
        # Qwen2's q, k and v always have biases, Qwen3's q/k norms: SmolLM3 has windows on some layers alone
        ({"sliding_window": 8, "full_attention_layers": [0]}, "SmolLM3ForCausalLM"),
        ({"sliding_window": 8, "full_attention_layers": [0], "qkv_bias": True}, "Qwen2ForCausalLM"),
    ]
    for changes, architecture in expected:
        assert family_of(plain.model_copy(update=changes)).architecture == architecture
    with pytest.raises(ConfigError, match="qk_norm, qkv_bias: no transformers class computes that"):
        family_of(plain.model_copy(update={"qkv_bias": True, "qk_norm": True}))
    with pytest.raises(ConfigError, match="Fix: model.hf_architecture one of Qwen2ForCausalLM"):
        family_of(plain.model_copy(update={"qkv_bias": True}), "MistralForCausalLM")


def test_every_family_is_tested_here():
    assert {family.model_type for family in FAMILIES} == {name.split()[0] for name in CASES}


def test_an_hf_directory_read_as_it_is_has_its_tokenizer_conventions(tmp_path):
    """`femtotron generate HF_DIR` (no import) follows the conventions of the directory too."""
    hf_family(tmp_path / "hf", "qwen2")
    config, _ = read_as_run(tmp_path / "hf")
    assert config.tokenizer.add_special_tokens and config.tokenizer.eos_token_ids == [0, 2049]
