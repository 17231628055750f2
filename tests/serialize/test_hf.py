"""`femtotron import-hf` and `export-hf`, proven with transformers itself on models transformers wrote."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from femtotron.cli import main
from femtotron.generate import load_run
from femtotron.parallel.context import ParallelContext
from femtotron.serialize.hf import HFError, export_hf, import_hf
from femtotron.trainer import Trainer

SHAPE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA
    max_position_embeddings=64,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
)


def hf_directory(path, tied=False, shard="40KB", **changes):
    """A random LlamaForCausalLM saved by transformers, sharded into several safetensors files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**SHAPE, **changes}, tie_word_embeddings=tied)).float().eval()
    model.save_pretrained(path, max_shard_size=shard)
    return model


def logits_close(ours, theirs):
    assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max(), (ours - theirs).abs().max()


@pytest.mark.parametrize("tied", [False, True])
def test_an_imported_model_gives_transformers_logits_and_exports_back_bit_identical(tmp_path, tied):
    hf = hf_directory(tmp_path / "hf", tied)
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()  # several shards
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    config, ours = load_run(tmp_path / "run")
    assert (
        config.model.model_config_.rope_theta == 500000.0
        and config.model.model_config_.tie_word_embeddings == tied
    )
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 24))
    with torch.no_grad():
        logits_close(ours.logits(ids), hf(ids).logits)

    assert (
        main(["export-hf", str(tmp_path / "run"), "--out", str(tmp_path / "back"), "--shard-size", "30KB"])
        == 0
    )
    original = _tensors(tmp_path / "hf")
    exported = _tensors(tmp_path / "back")
    assert original.keys() == exported.keys()
    assert all(torch.equal(original[name], exported[name]) for name in original)


def test_llama3_rope_scaling_gives_transformers_logits_in_and_out(tmp_path):
    """Llama 3.1/3.2's RoPE: frequencies slowed past an original context of 32 positions; 100 tokens."""
    from transformers import LlamaForCausalLM

    rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0}
    rope.update(high_freq_factor=4.0, original_max_position_embeddings=32)
    hf = hf_directory(tmp_path / "hf", max_position_embeddings=128, rope_parameters=rope)
    import_hf(tmp_path / "hf", tmp_path / "run")
    config, ours = load_run(tmp_path / "run")
    assert config.model.model_config_.rope_scaling.factor == 8.0
    ids = torch.randint(0, SHAPE["vocab_size"], (1, 100))
    export_hf(tmp_path / "run", tmp_path / "back")
    back = LlamaForCausalLM.from_pretrained(tmp_path / "back").float().eval()
    with torch.no_grad():
        logits_close(ours.logits(ids), hf(ids).logits)
        logits_close(back(ids).logits, hf(ids).logits)


MOE = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, intermediate_size=32)),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=64, qkv_bias=False),
    ),
}


@pytest.mark.parametrize(
    "kind, changes",
    [("mixtral", {}), ("qwen2_moe", {"norm_topk_prob": False}), ("qwen2_moe", {"norm_topk_prob": True})],
)
def test_mixture_of_experts_models_give_transformers_logits_in_and_out(tmp_path, kind, changes):
    """Mixtral (top-2 of 4 experts, renormalised) and Qwen2-MoE (shared experts with a sigmoid gate, top-k
    probabilities as they are or renormalised), written by transformers in their checkpoints' per-expert
    layout: femtotron's logits equal theirs, and the export is the same files, which transformers loads."""
    import transformers

    config_name, model_name, shape = MOE[kind]
    model_class = getattr(transformers, model_name)
    torch.manual_seed(0)
    hf = model_class(getattr(transformers, config_name)(**{**SHAPE, **shape, **changes})).float().eval()
    with torch.no_grad():  # weights large enough that the routing differs between tokens
        for param in hf.parameters():
            param.normal_(0.0, 0.1)
    hf.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "run")
    config, ours = load_run(tmp_path / "run")
    assert config.model.model_config_.moe.num_experts == 4
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 24))
    export_hf(tmp_path / "run", tmp_path / "back", shard_bytes=30_000)
    back = model_class.from_pretrained(tmp_path / "back").float().eval()
    with torch.no_grad():
        logits_close(ours.logits(ids), hf(ids).logits)
        logits_close(back(ids).logits, hf(ids).logits)
    original = _tensors(tmp_path / "hf")
    exported = _tensors(tmp_path / "back")
    assert original.keys() == exported.keys()
    assert all(torch.equal(original[name], exported[name]) for name in original)


def _tensors(directory):
    out = {}
    for file in directory.glob("*.safetensors"):
        out.update(load_file(str(file)))
    return out


def test_an_export_from_a_checkpoint_saved_at_another_mesh_loads_in_transformers(tiny_config, tmp_path):
    """No consolidate step: the checkpoint's slices are gathered by export-hf itself. The checkpoint here is a
    one-process one rewritten for dp=2 tp=2 pp=2 (8 rank files); transformers gets femtotron's logits."""
    from transformers import LlamaForCausalLM

    config = tiny_config(
        "general.run=export",
        "model.model_config.num_hidden_layers=4",
        "checkpoints.checkpoint_interval=2",
        "tokens.train_steps=2",
    )
    Trainer(config, ParallelContext(), log_to_console=False).train()
    mesh = ["--dp", "2", "--tp", "2", "--pp", "2"]
    assert main(["reshard", str(config.run_dir / "checkpoints"), "--out", str(tmp_path / "mesh"), *mesh]) == 0
    assert (
        main(["export-hf", str(tmp_path / "mesh"), "--out", str(tmp_path / "hf"), "--dtype", "float32"]) == 0
    )
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_hidden_layers"] == 4
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
    _, ours = load_run(config.run_dir)  # the same weights, as the run saved them at its end
    ids = torch.randint(0, config.model.model_config_.vocab_size, (2, 16))
    with torch.no_grad():
        logits_close(ours.logits(ids), hf(ids).logits)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"attention_bias": True}, "attention_bias=True: femtotron's model has none"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0}}, "rope type 'yarn'"),
        ({"architectures": ["MistralForCausalLM"]}, "architectures=['MistralForCausalLM']"),
        # Qwen's own Qwen2-MoE config.json files leave qkv_bias out: transformers then adds q/k/v biases
        (
            {"architectures": ["Qwen2MoeForCausalLM"], "moe_intermediate_size": 48},
            "qkv_bias=True: femtotron's",
        ),
    ],
)
def test_a_model_femtotron_does_not_compute_is_refused_naming_the_field(tmp_path, change, message):
    hf_directory(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(HFError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        import_hf(tmp_path / "hf", tmp_path / "run")


def test_bad_directories_get_clear_errors(tmp_path):
    with pytest.raises(HFError, match="config.json does not exist"):
        import_hf(tmp_path, tmp_path / "run")
    hf_directory(tmp_path / "sharded")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / "sharded" / shard).unlink()
    with pytest.raises(HFError, match=f"lists {shard}, which"):
        import_hf(tmp_path / "sharded", tmp_path / "run")

    hf_directory(tmp_path / "one", shard="1GB")
    weights = load_file(str(tmp_path / "one" / "model.safetensors"))
    weights["model.norm.weight"] = torch.ones(32)
    save_file(weights, str(tmp_path / "one" / "model.safetensors"))
    with pytest.raises(
        HFError, match=r"model.norm.weight .* has shape \(32,\), but config.json makes it \(64,\)"
    ):
        import_hf(tmp_path / "one", tmp_path / "run")

    (tmp_path / "one" / "model.safetensors").unlink()
    (tmp_path / "one" / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(HFError, match="pickles .*pytorch_model.bin.* can run any code"):
        import_hf(tmp_path / "one", tmp_path / "run")
    assert main(["import-hf", str(tmp_path / "one"), "--out", str(tmp_path / "run")]) == 2


def test_the_shard_size_is_checked():
    with pytest.raises(SystemExit):
        main(["export-hf", "run", "--out", "hf", "--dtype", "int8"])
    assert main(["export-hf", "run", "--out", "hf", "--shard-size", "lots"]) == 2


def test_export_writes_what_transformers_expects(tmp_path):
    hf_directory(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "run")
    export_hf(tmp_path / "run", tmp_path / "back", dtype="bfloat16", shard_bytes=10**9)
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "bfloat16"
    assert (tmp_path / "back" / "generation_config.json").is_file()
    assert not (tmp_path / "back" / "model.safetensors.index.json").exists()  # one file when it fits
    assert all(
        t.dtype == torch.bfloat16 for t in load_file(str(tmp_path / "back" / "model.safetensors")).values()
    )
