"""`model.init_from`: the first weights from an HF directory, a run directory or a checkpoint, at any mesh."""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks
from safetensors.torch import load_file

from femtotron.errors import ConfigError
from femtotron.models.hf_conversion import from_hf
from femtotron.parallel.context import ParallelContext
from femtotron.parallel.tensor_parallel import full_tensor
from femtotron.trainer import Trainer


def trained(tiny_config, run, **more):
    """A 2-step run on one process with a checkpoint and its final weights; returns its config."""
    config = tiny_config(
        f"general.run={run}", "checkpoints.checkpoint_interval=2", "tokens.train_steps=2", **more
    )
    Trainer(config, ParallelContext(), log_to_console=False).train()
    return config


def _full_weights(rank, config):
    ctx = ParallelContext.from_config(config)
    trainer = Trainer(config, ctx, log_to_console=False)
    model = trainer.model
    out = {
        name: full_tensor(p, p.shard, model.tp, model.ep.group).float()
        for name, p in model.named_parameters()
    }
    step = trainer.state.step
    ctx.close()
    return out, step


@pytest.mark.distributed
def test_init_from_a_run_directory_and_a_checkpoint_at_another_mesh(tiny_config, tmp_path):
    """Saved by one process; read by tp=2 (run directory) and pp=2 with ZeRO-1 over dp=2 (checkpoint): each
    rank's slices, gathered, are the saved weights; the run starts at step 0."""
    source = trained(tiny_config, "source")
    saved = load_file(str(source.run_dir / "model.safetensors"))
    cases = [
        ("tp=2", source.run_dir, ["parallelism.tp=2"], 2),
        (
            "pp=2 dp=2 ZeRO-1",
            source.run_dir / "checkpoints",
            ["parallelism.pp=2", "parallelism.dp=2", "optimizer.zero_stage=1"],
            4,
        ),
    ]
    for label, path, layout, world in cases:
        config = tiny_config(f"general.run=from-{world}", f"model.init_from={path}", *layout)
        for weights, step in run_ranks(_full_weights, world, config):
            assert step == 0, label
            for name, tensor in weights.items():
                assert torch.equal(tensor, saved[name].float()), (label, name)


def hf_weights(tiny_config, directory):
    """A random LlamaForCausalLM of the tiny config's shape saved by transformers; its weights by femtotron
    name."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = tiny_config("general.run=from-hf")
    cfg = config.model.model_config_
    hf = LlamaForCausalLM(
        LlamaConfig(
            **{key: getattr(cfg, key) for key in ("vocab_size", "hidden_size", "intermediate_size")},
            **{
                key: getattr(cfg, key)
                for key in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads")
            },
            max_position_embeddings=cfg.max_position_embeddings,
            rope_theta=cfg.rope_theta,
            rms_norm_eps=cfg.rms_norm_eps,
            tie_word_embeddings=cfg.tie_word_embeddings,
        )
    )
    hf.save_pretrained(directory, max_shard_size="40KB")
    return from_hf({k: v.float() for k, v in hf.state_dict().items()}, cfg)


def test_init_from_a_hugging_face_directory(tiny_config, tmp_path):
    expected = hf_weights(tiny_config, tmp_path / "hf")
    config = tiny_config("general.run=from-hf", f"model.init_from={tmp_path / 'hf'}")
    weights, step = _full_weights(0, config)
    assert step == 0 and weights.keys() == expected.keys()
    assert all(torch.equal(weights[name], expected[name]) for name in expected)


@pytest.mark.distributed
def test_each_tp_rank_reads_its_rows_of_the_fused_weights_from_hugging_face_files(tiny_config, tmp_path):
    """qkv_proj and gate_up_proj do not exist in an HF directory: each tp rank gathers its rows from q/k/v
    and gate/up, and the pieces, gathered, are the whole model."""
    expected = hf_weights(tiny_config, tmp_path / "hf")
    config = tiny_config("general.run=from-hf-tp", f"model.init_from={tmp_path / 'hf'}", "parallelism.tp=2")
    for weights, _ in run_ranks(_full_weights, 2, config):
        assert all(torch.equal(weights[name], expected[name]) for name in expected)


@pytest.mark.distributed
def test_each_rank_reads_its_experts_from_a_mixture_of_experts_directory(tiny_config, tmp_path):
    """A Qwen2-MoE directory holds each expert's gate/up/down (and the shared experts') as matrices of their
    own, q/k/v biases, and dense layers among the experts (decoder_sparse_step 2): at dp2 x ep2 x tp2 each
    rank reads its 2 experts' rows and its biases' rows, and gathered they are the imported model."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from femtotron.serialize.hf import read_as_run

    cfg = tiny_config("general.run=shape").model.model_config_
    shape = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    experts = dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=64)
    hf = Qwen2MoeForCausalLM(
        Qwen2MoeConfig(
            **{key: getattr(cfg, key) for key in shape},
            num_key_value_heads=cfg.num_key_value_heads,
            max_position_embeddings=cfg.max_position_embeddings,
            decoder_sparse_step=2,
            **experts,
        )
    )
    hf.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    imported, expected = read_as_run(tmp_path / "hf")
    chosen = imported.model.model_config_.moe.model_dump(exclude_none=True)
    moe = [f"model.model_config.moe.{key}={value}" for key, value in chosen.items()]
    assert imported.model.model_config_.moe.dense_layers == [0]  # layer 1 has experts
    layout = (
        "parallelism.dp=2",
        "parallelism.ep=2",
        "parallelism.tp=2",
        "model.model_config.rms_norm_eps=1e-6",
        "model.model_config.qkv_bias=true",
    )
    config = tiny_config("general.run=from-moe", f"model.init_from={tmp_path / 'hf'}", *moe, *layout)
    for weights, _ in run_ranks(_full_weights, 4, config):
        assert weights.keys() == expected.keys()
        assert all(torch.equal(weights[name], expected[name].float()) for name in expected)


@pytest.mark.distributed
def test_each_tp_rank_reads_its_heads_of_olmo2_s_q_k_norms(tiny_config, tmp_path):
    """OLMo2's q/k norm weights span all heads: each tp rank reads its heads' part of them."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    from femtotron.serialize.hf import read_as_run

    cfg = tiny_config("general.run=shape").model.model_config_
    shape = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    hf = Olmo2ForCausalLM(
        Olmo2Config(
            **{key: getattr(cfg, key) for key in shape},
            num_key_value_heads=cfg.num_key_value_heads,
            max_position_embeddings=cfg.max_position_embeddings,
        )
    )
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)  # not all ones: a rank reading another's heads shows
    hf.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    _, expected = read_as_run(tmp_path / "hf")
    olmo2 = (
        "model.model_config.qk_norm=true",
        "model.model_config.qk_norm_span=all_heads",
        "model.model_config.norm_placement=after",
        "model.model_config.rms_norm_eps=1e-5",  # OLMo2's
    )
    config = tiny_config(
        "general.run=from-olmo2", f"model.init_from={tmp_path / 'hf'}", "parallelism.tp=2", *olmo2
    )
    for weights, _ in run_ranks(_full_weights, 2, config):
        assert weights.keys() == expected.keys()
        assert all(torch.equal(weights[name], expected[name].float()) for name in expected)


def test_a_source_of_another_model_is_refused_naming_each_field(tiny_config, tmp_path):
    source = trained(tiny_config, "small")
    config = tiny_config(
        "general.run=bigger", f"model.init_from={source.run_dir}", "model.model_config.hidden_size=128"
    )
    with pytest.raises(ConfigError, match=r"model.model_config.hidden_size: source 64, config 128"):
        Trainer(config, ParallelContext(), log_to_console=False)
    with pytest.raises(ConfigError, match="model.init_from=.*does not exist"):
        Trainer(
            tiny_config(f"model.init_from={tmp_path / 'nowhere'}"), ParallelContext(), log_to_console=False
        )


def test_a_run_initialised_from_a_trained_model_is_not_warned_about_its_low_first_loss(tiny_config, capsys):
    """N3 compares the first loss with ln(vocab), where only a fresh model starts: from trained weights a
    loss far below it is the point, not inputs leaking into the targets."""
    lr = "optimizer.learning_rate_scheduler.learning_rate=0.01"
    source = tiny_config("general.run=source", "tokens.train_steps=30", lr)
    results = Trainer(source, ParallelContext(), log_to_console=False).train()
    assert results[-1].loss < 5.545 - 1.5  # far enough below ln(256) for the check
    capsys.readouterr()
    continued = tiny_config(
        "general.run=continued", "tokens.train_steps=1", f"model.init_from={source.run_dir}"
    )
    first = Trainer(continued, ParallelContext()).train()[0].loss
    assert first < 5.545 - 1.5
    assert "should start near ln(vocab_size)" not in capsys.readouterr().out
