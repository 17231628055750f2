import pytest
import torch
from helpers import (
    BF16_PATHS,
    FEATURES,
    OLMO2_FEATURES,
    build_llama,
    check_layouts,
    hf_llama,
    llama_config,
    precision_path,
)

from femtotron.attention import fused_kernel_takes_kv_groups
from femtotron.errors import ConfigError
from femtotron.models.hf_conversion import from_hf
from femtotron.models.llama import Rotary
from femtotron.precision import tf32_for_fp32


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


def test_the_logits_z_loss_adds_coef_times_log_z_squared_and_its_gradient():
    """Against an autograd reference written here: cross-entropy plus 1e-2 * logsumexp(logits)^2 per counted
    token, in value and in every gradient (the custom backward adds 2 coef log Z softmax)."""
    coef = 1e-2
    cfg = tiny_config(logits_z_loss_coef=coef)
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    targets = ids[:, 1:].clone()
    targets[0, :3] = -100
    model = build(cfg)
    loss_sum, _ = model(ids[:, :-1], targets)
    loss_sum.backward()
    reference = build(cfg)
    hidden = reference.hidden_states(ids[:, :-1])
    logits = reference.head_logits(hidden).float().flatten(0, 1)
    valid = targets.flatten() != -100
    cross_entropy = torch.nn.functional.cross_entropy(logits, targets.flatten(), reduction="sum")
    expected = cross_entropy + coef * (logits.logsumexp(-1).square() * valid).sum()
    expected.backward()
    torch.testing.assert_close(loss_sum, expected)
    plain, _ = build(tiny_config())(ids[:, :-1], targets)
    assert loss_sum > plain  # the z term is there, and positive
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, msg=name)


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
    from helpers import cpu_low_precision_path

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


@pytest.mark.parametrize(
    "device_type, dtype, capability, takes",
    [
        ("cpu", torch.float32, None, True),  # the CPU's flash kernel takes K/V groups in any dtype
        ("cpu", torch.bfloat16, None, True),
        ("cuda", torch.bfloat16, (9, 0), True),  # flash
        ("cuda", torch.float16, (8, 0), True),
        ("cuda", torch.float32, (9, 0), False),  # flash needs fp16/bf16
        ("cuda", torch.bfloat16, (7, 5), False),  # and sm80
        ("cuda", torch.float16, (7, 0), False),
    ],
)
def test_kv_heads_are_repeated_where_the_fused_kernel_would_not_take_groups(
    device_type, dtype, capability, takes
):
    assert fused_kernel_takes_kv_groups(device_type, dtype, capability) is takes


def test_repeated_kv_heads_give_the_same_attention_and_gradients_as_enable_gqa(monkeypatch):
    """The path for CUDA without flash (fp32, or before sm80), run on the CPU: query head i reads K/V head
    i // (heads / kv_heads), as with enable_gqa."""
    import femtotron.attention as attention

    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, heads, 12, 16, generator=generator) for heads in (8, 2, 2))
    sdpa, seen = torch.nn.functional.scaled_dot_product_attention, []

    def recording_sdpa(q, k, v, **kw):
        seen.append((k.shape[1], kw["enable_gqa"]))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recording_sdpa)
    results = []
    for takes_groups in (True, False):
        monkeypatch.setattr(
            attention, "fused_kernel_takes_kv_groups", lambda *args, takes=takes_groups: takes
        )
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attention.causal_attention(*inputs)
        out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
        results.append((out.detach(), *(t.grad for t in inputs)))
    assert seen == [(2, True), (8, False)]
    for grouped, repeated in zip(*results, strict=True):
        torch.testing.assert_close(repeated, grouped)


@pytest.mark.parametrize("queries", [12, 1], ids=["whole sequence", "one position against a cache"])
@pytest.mark.parametrize("window", [1, 4, 12])
def test_a_sliding_window_shows_each_query_the_window_latest_keys(queries, window):
    """causal_attention's window (GQA, forward and backward) against softmax over the keys 0 <= i - j <
    window, as transformers masks them: the queries are the last of the 12 keys' positions."""
    from femtotron.attention import causal_attention

    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, queries, 8, generator=generator, requires_grad=True)
    k, v = (torch.randn(2, 2, 12, 8, generator=generator, requires_grad=True) for _ in range(2))
    out = causal_attention(q, k, v, causal=queries > 1, window=window)
    distance = torch.arange(12 - queries, 12)[:, None] - torch.arange(12)
    allowed = (distance >= 0) & (distance < window)
    scores = q @ k.repeat_interleave(2, 1).transpose(-1, -2) / 8**0.5
    reference = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(out, reference)
    grad = torch.randn_like(out)
    ours = torch.autograd.grad((grad * out).sum(), (q, k, v))
    theirs = torch.autograd.grad((grad * reference).sum(), (q, k, v))
    for got, expected in zip(ours, theirs, strict=True):
        torch.testing.assert_close(got, expected)


def test_fp32_on_cuda_multiplies_in_tf32_unless_nvidia_tf32_override_is_0(monkeypatch):
    matmul = torch.backends.cuda.matmul
    before, matmul.allow_tf32 = matmul.allow_tf32, False
    try:
        monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
        tf32_for_fp32(torch.device("cuda"), torch.float32)
        assert not matmul.allow_tf32
        monkeypatch.delenv("NVIDIA_TF32_OVERRIDE")
        for device, dtype in (("cpu", torch.float32), ("cuda", torch.bfloat16)):
            tf32_for_fp32(torch.device(device), dtype)
            assert not matmul.allow_tf32, (device, dtype)
        tf32_for_fp32(torch.device("cuda"), torch.float32)
        assert matmul.allow_tf32 and matmul.fp32_precision == "tf32"  # as metrics.peak_flops reads it
    finally:
        matmul.allow_tf32 = before


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_attention_on_cuda_runs_in_a_fused_kernel_not_the_math_one(dtype):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from femtotron.attention import causal_attention

    q, k, v = (torch.randn(2, heads, 256, 64, device="cuda", dtype=dtype) for heads in (8, 2, 2))
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    with sdpa_kernel(fused):  # without the math kernel: SDPA raises where no fused one takes the inputs
        out = causal_attention(q, k, v)
    reference = causal_attention(*(t.double().cpu() for t in (q, k, v)))
    torch.testing.assert_close(out.double().cpu(), reference, rtol=0.02, atol=0.02)


def test_rotary_on_the_meta_device_computes_no_tables():
    rotary = Rotary(128, 2 * 10**8, 10000.0, device=torch.device("meta"))  # 51 GB of tables on a real device
    assert rotary.cos.device.type == "meta" and rotary.cos.shape == (2 * 10**8, 128)


def test_rotary_refuses_tables_no_machine_should_hold_naming_the_field():
    with pytest.raises(
        ConfigError, match="max_position_embeddings=200000000 with head_dim=128: RoPE's tables"
    ):
        Rotary(128, 2 * 10**8, 10000.0)


MOE = (
    "model.model_config.moe.num_experts=4",
    "model.model_config.moe.num_experts_per_tok=2",
    "model.model_config.moe.intermediate_size=32",
)


@pytest.mark.distributed
def test_the_families_features_equal_one_process_in_every_layout(documents_config):
    """With every feature on, on documents (masked): tp2 in both modes (biases split with their rows, the
    q/k norms' gradients summed over tp), pp2 with recomputation, cp2 (the ring, document masking), dp2 with
    ZeRO-1, and the MoE model's experts over ep2; loss, full-shape gradients and 3 optimizer steps equal one
    process (bf16 on both CPU paths at tp2)."""
    check_layouts(
        lambda *overrides: documents_config(*FEATURES, *overrides),
        {
            ("parallelism.tp=2",): [("float32", None, ()), ("bfloat16", True, ()), ("bfloat16", False, ())],
            ("parallelism.tp=2", "parallelism.tp_mode=REDUCE_SCATTER"): [("float32", None, ())],
            ("parallelism.pp=2",): [("float32", None, ("parallelism.recompute_layer=true",))],
            ("parallelism.cp=2",): [("float32", None, ())],
            ("parallelism.dp=2",): [("float32", None, ("optimizer.zero_stage=1",))],
            ("parallelism.dp=2", "parallelism.ep=2"): [("float32", None, MOE)],
        },
    )


@pytest.mark.distributed
def test_olmo2_s_norms_equal_one_process_in_every_layout(documents_config):
    """Norms after each block and q/k norms over all heads (each tp rank's sum of squares summed over tp, its
    slice of the weight split with its heads): tp2 in both modes (bf16 on both CPU paths), pp2, cp2."""
    check_layouts(
        lambda *overrides: documents_config(*OLMO2_FEATURES, *overrides),
        {
            ("parallelism.tp=2",): [("float32", None, ()), ("bfloat16", True, ()), ("bfloat16", False, ())],
            ("parallelism.tp=2", "parallelism.tp_mode=REDUCE_SCATTER"): [("float32", None, ())],
            ("parallelism.pp=2",): [("float32", None, ("parallelism.recompute_layer=true",))],
            ("parallelism.cp=2",): [("float32", None, ())],
        },
    )


def test_the_features_change_the_model_and_count_their_parameters():
    """Each feature on its own changes the loss (so the layout test above can fail), and the parameter count
    the FLOPs and doctor use is the model's."""
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    plain = llama_config(num_hidden_layers=2)
    base = build_llama(plain)(ids, ids)[0].item()
    for change in (
        {"head_dim": 24},
        {"qk_norm": True},
        {"no_rope_layers": [1]},
        {"embedding_multiplier": 2.0},
        {"residual_multiplier": 0.7},
        {"attention_multiplier": 0.2},
        {"logits_scaling": 1.5},
        {"sliding_window": 4},
        {"qk_norm": True, "qk_norm_span": "all_heads"},
        {"norm_placement": "after"},
        {"sliding_window": 4, "full_attention_layers": [0]},
    ):
        cfg = plain.model_copy(update=change)
        model = build_llama(cfg)
        assert sum(p.numel() for p in model.parameters()) == cfg.parameter_count, change
        assert abs(model(ids, ids)[0].item() - base) > 1e-4, change
    biased = plain.model_copy(update={"qkv_bias": True})
    model = build_llama(biased)
    assert sum(p.numel() for p in model.parameters()) == biased.parameter_count
    assert not any(p.any() for name, p in model.named_parameters() if name.endswith(".bias"))  # zeros at init
