import pytest
import torch
from helpers import BF16_PATHS, build_llama, hf_llama, llama_config, precision_path

from femtotron.models.hf_conversion import from_hf


def tiny_config(**overrides):
    return llama_config(
        **{
            "vocab_size": 128,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 64,
            **overrides,
        }
    )


def build(cfg, seed=7, dtype=torch.float32):
    return build_llama(cfg, dtype, seed)


def hf_twin(model, cfg):
    return hf_llama(cfg, dict(model.named_parameters())).eval()


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_hf_transformers(tied):
    cfg = tiny_config(tie_word_embeddings=tied)
    model = build(cfg)
    hf = hf_twin(model, cfg)
    ids = torch.randint(0, cfg.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.logits(ids)
        theirs = hf(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_hf_conversion_round_trips(tied):
    cfg = tiny_config(tie_word_embeddings=tied, num_attention_heads=8, num_key_value_heads=2, hidden_size=64)
    model = build(cfg)
    ours = {name: p.detach() for name, p in model.named_parameters()}
    hf = hf_twin(model, cfg)
    back = from_hf(hf.state_dict(), cfg)
    assert back.keys() == ours.keys()
    for name, tensor in ours.items():
        assert torch.equal(back[name], tensor), name


def test_loss_is_summed_cross_entropy_over_valid_tokens():
    cfg = tiny_config()
    model = build(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    targets = ids[:, 1:].clone()
    targets[0, :3] = -100
    loss_sum, count = model(ids[:, :-1], targets)
    logits = model.logits(ids[:, :-1])
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="mean")
    assert count.item() == 2 * 8 - 3
    torch.testing.assert_close(loss_sum / count, expected)


def test_init_is_a_function_of_seed_and_name_only():
    cfg = tiny_config()
    a, b, c = build(cfg, seed=1), build(cfg, seed=1), build(cfg, seed=2)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if pa.dim() == 2:
            assert not torch.equal(pa, pc), name
    # A deeper model shares the first layers' weights exactly: init does not depend on call order.
    deeper = build(tiny_config(num_hidden_layers=3), seed=1)
    assert torch.equal(deeper.layers[1].mlp.gate_up_proj.weight, a.layers[1].mlp.gate_up_proj.weight)


def test_parameters_carry_sharding_metadata_and_scaled_output_init():
    cfg = tiny_config(num_hidden_layers=8, hidden_size=256, num_attention_heads=4, intermediate_size=512)
    model = build(cfg)
    for name, p in model.named_parameters():
        assert p.shard.name == name
        assert p.shard.global_shape == tuple(p.shape)
    q_std = model.layers[0].self_attn.qkv_proj.weight.std().item()
    o_std = model.layers[0].self_attn.o_proj.weight.std().item()
    assert q_std == pytest.approx(0.02, rel=0.05)
    assert o_std == pytest.approx(0.02 / 4, rel=0.05)  # 0.02 / sqrt(2 * 8 layers)
    tied = build(tiny_config(tie_word_embeddings=True))
    assert tied.embed_tokens.weight.shard.tie_group == "embed_tokens.weight"
    assert not hasattr(tied, "lm_head")


@BF16_PATHS
def test_bf16_model_tracks_fp32_model(native):
    cfg = tiny_config()
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), precision_path(native):
        full = build(cfg).logits(ids)
        half = build(cfg, dtype=torch.bfloat16).logits(ids).float()
    assert (full - half).abs().max() < 0.05 * full.abs().max() + 1e-2


def test_upcast_path_for_cpus_without_bf16_units_matches_native_bf16():
    from femtotron.precision import cpu_low_precision_path

    cfg = tiny_config()
    model = build(cfg, dtype=torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    results = {}
    for native in (True, False):
        model.zero_grad()
        with cpu_low_precision_path(native):
            loss_sum, count = model(ids[:, :-1], ids[:, 1:])
            (loss_sum / count).backward()
            logits = model.logits(ids).float()
        grad = model.layers[0].self_attn.qkv_proj.weight.grad
        assert grad.dtype == torch.bfloat16
        results[native] = (logits, grad.float())
    (native_logits, native_grad), (upcast_logits, upcast_grad) = results[True], results[False]
    # Same maths, different accumulation: within a few bf16 ulps (2^-8 relative).
    torch.testing.assert_close(upcast_logits, native_logits, rtol=2e-2, atol=2e-2)
    assert (upcast_grad - native_grad).norm() <= 2e-2 * native_grad.norm()
