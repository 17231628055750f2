"""Muon (optim/muon.py) on one process against a plain implementation written here on whole tensors."""

import itertools

import pytest
import torch
from checkpoint_runs import (
    assert_one_process_continues,
    assert_the_resume_is_bit_exact,
    make,
    ranks_train,
    whole_then_halves,
)
from distributed import run_ranks
from helpers import (
    BF16_PATHS,
    SMOOTH_ADAM,
    assert_steps_match,
    build_llama,
    check_layouts,
    layout_case,
    llama_config,
    precision_path,
    random_batch,
    record_steps,
)

import femtotron.optim.muon as muon_module
from femtotron.config import load_config_dict
from femtotron.config.zero_stages import ZERO_STAGES
from femtotron.errors import ConfigError
from femtotron.optim.muon import fused, matrices, newton_schulz, orthogonalised
from femtotron.optim.zero import ZeroOptimizer
from femtotron.parallel.comm import Comm, Group
from femtotron.parallel.context import ParallelContext
from femtotron.parallel.data_parallel import DataParallel
from femtotron.parallel.flat_layout import Replicas
from femtotron.serialize.files import CheckpointError, CheckpointReader
from femtotron.serialize.resume_source import resolve

LR = 2e-2
MUON_LR = 5e-2
WEIGHT_DECAY = 0.1
MUON_WEIGHT_DECAY = 0.3
BETA = 0.95
STEPS = 3
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32, "shared_expert_gate": True}
MOE["num_shared_experts"] = 1


def muon_section():
    optimizer = {
        "weight_decay": WEIGHT_DECAY,
        "learning_rate_scheduler": {"learning_rate": LR},
        "optimizer_factory": {
            "name": "muon",
            "muon_learning_rate": MUON_LR,
            "muon_weight_decay": MUON_WEIGHT_DECAY,
            "muon_momentum": BETA,
        },
        "clip_grad": None,
    }
    config = {"tokens": {"train_steps": 10}, "optimizer": optimizer, "data": {"dataset_folder": "unused"}}
    return load_config_dict(config).optimizer


def reference_orthogonalise(matrix: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Jordan et al.'s quintic Newton-Schulz on one 2-D matrix, wide side along the columns, in fp32."""
    x = matrix.T if matrix.shape[0] > matrix.shape[1] else matrix
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        a = x @ x.T
        x = 3.4445 * x - 4.7750 * (a @ x) + 2.0315 * (a @ a @ x)
    return x.T if matrix.shape[0] > matrix.shape[1] else x


def logical_rows(name: str, shape: tuple[int, ...], cfg) -> list[tuple[tuple[int, ...], list[int]]]:
    """Each separate matrix of a weight: (its leading indices, its rows), spelled out one by one."""
    leading = list(itertools.product(*[range(n) for n in shape[:-2]]))
    if not name.endswith("qkv_proj.weight"):
        return [(index, list(range(shape[-2]))) for index in leading]
    d = cfg.hidden_size // cfg.num_attention_heads
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    period = (group + 2) * d
    q, k, v = [], [], []
    for head in range(cfg.num_key_value_heads):
        base = head * period
        q += list(range(base, base + group * d))
        k += list(range(base + group * d, base + (group + 1) * d))
        v += list(range(base + (group + 1) * d, base + period))
    return [((), q), ((), k), ((), v)]


class ReferenceMuon:
    """Liu et al.'s Muon as written in their paper (momentum as a sum, M <- beta M + G; Nesterov G + beta M;
    update 0.2 sqrt(max(A, B)) O), and torch's AdamW for the rest."""

    def __init__(self, model, cfg) -> None:
        self.cfg = cfg
        self.named = list(model.named_parameters())
        self.muon = [(n, p) for n, p in self.named if orthogonalised(n, p)]
        rest = [(n, p) for n, p in self.named if not orthogonalised(n, p)]
        self.sums = {n: torch.zeros_like(p) for n, p in self.muon}
        self.adam = torch.optim.AdamW(
            [
                {"params": [p for _, p in rest if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
                {"params": [p for _, p in rest if p.dim() < 2], "weight_decay": 0.0},
            ],
            lr=LR,
            betas=(0.9, 0.95),
            eps=1e-8,
        )

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for group in self.adam.param_groups:
            group["lr"] = lr
        self.adam.step()
        muon_lr = lr * MUON_LR / LR
        for name, param in self.muon:
            grad = param.grad.float()
            self.sums[name].mul_(BETA).add_(grad)
            ahead = grad + BETA * self.sums[name]
            update = torch.zeros_like(param)
            for index, rows in logical_rows(name, tuple(param.shape), self.cfg):
                matrix = ahead[index][rows]
                scale = 0.2 * max(matrix.shape) ** 0.5
                update[index][rows] = reference_orthogonalise(matrix) * scale
            param.mul_(1 - muon_lr * MUON_WEIGHT_DECAY).sub_(muon_lr * update)


def single_process(model, section) -> ZeroOptimizer:
    named = list(model.named_parameters())
    data_parallel = DataParallel.build(
        named,
        [list(range(len(named)))[::-1]],
        Comm(),
        Replicas(Group("dp", (0,)), 0),
        micro_batches=1,
        bucket_mb=0.01,  # several buckets: the gathers of one run while the last one's matrices are computed
        grad_dtype=torch.float32,
        zero=ZERO_STAGES[0],
        orthogonalised=[orthogonalised(n, p) for n, p in named],
    )
    return ZeroOptimizer([p for _, p in named], data_parallel, section)


@pytest.mark.parametrize("moe", [False, True])
def test_muon_on_one_process_equals_a_reference_written_on_whole_tensors(moe):
    cfg = llama_config(moe=MOE) if moe else llama_config()
    model = build_llama(cfg)
    reference = build_llama(cfg)  # the same seed: the same weights
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    ours = single_process(model, muon_section())
    theirs = ReferenceMuon(reference, cfg)
    stepped = [n for n, p in model.named_parameters() if orthogonalised(n, p)]
    assert stepped and len(stepped) < len(list(model.named_parameters()))
    lrs = [LR, LR / 2, LR / 3]
    for step in range(STEPS):
        ids, targets = random_batch(cfg.vocab_size, length=12)
        ids = ids.roll(step, dims=1)
        for each in (model, reference):
            loss_sum, count = each(ids, targets)
            (loss_sum / count).backward()
        ours.data_parallel.finish_reduction()
        ours.step(lrs[step])
        ours.zero_grad()
        theirs.step(lrs[step])
        theirs.adam.zero_grad()
        for param in reference.parameters():
            param.grad = None
    before = initial
    for name, param in model.named_parameters():
        expected = dict(reference.named_parameters())[name]
        change = (expected - before[name]).norm()
        assert change > 0, name
        # fp32 Newton-Schulz in another order of operations differs by ~2e-6 of its result (either is as
        # far from fp64's); a wrong matrix or scale is off by the update's size
        assert (param - expected).norm() <= 1e-4 * change, name


def test_orthogonalising_the_fused_qkv_matrix_whole_would_be_caught():
    """The comparison above sees q, k and v orthogonalised together: their update differs from each alone."""
    cfg = llama_config()
    whole = torch.randn(96, 64, generator=torch.Generator().manual_seed(0))
    fused_rows = (4 * 8, 8, 8)
    apart = fused([reference_orthogonalise(m) for m in matrices(whole, fused_rows)], fused_rows)
    together = reference_orthogonalise(whole)
    assert (apart - together).norm() > 0.1 * apart.norm()
    rows = [rows for _, rows in logical_rows("qkv_proj.weight", (96, 64), cfg)]
    for matrix, expected in zip(matrices(whole, fused_rows), rows, strict=True):
        assert torch.equal(matrix, whole[expected])
    assert torch.equal(fused(matrices(whole, fused_rows), fused_rows), whole)


@BF16_PATHS
@pytest.mark.parametrize("shape", [(48, 64), (64, 48), (3, 2, 40, 24)])
def test_newton_schulz_leaves_singular_values_near_one_in_fp32_and_bf16(native, shape):
    """Five quintic iterations take every singular value of a random matrix into about [0.7, 1.2] (Jordan et
    al.), batched over leading dimensions, in bf16 on either CPU path as in fp32, and the result's singular
    vectors are the input's (U V^T's direction)."""
    update = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    with precision_path(native):
        for dtype in (torch.float32, torch.bfloat16):
            result = newton_schulz(update, 5, dtype)
            assert result.dtype == dtype and result.shape == update.shape
            result = result.float()
            values = torch.linalg.svdvals(result)
            assert values.min() > 0.6 and values.max() < 1.25, (dtype, values)
            u, _, vh = torch.linalg.svd(update, full_matrices=False)
            cosine = (result * (u @ vh)).sum(dim=(-2, -1)) / (
                result.norm(dim=(-2, -1)) * (u @ vh).norm(dim=(-2, -1))
            )
            assert cosine.min() > 0.98, (dtype, cosine)


def test_the_decoder_matrices_take_muon_and_embeddings_norms_biases_and_routers_adam():
    cfg = llama_config(moe=MOE, qkv_bias=True)
    stepped = {n for n, p in build_llama(cfg).named_parameters() if orthogonalised(n, p)}
    layer = "layers.0."
    assert {n for n in stepped if n.startswith(layer)} == {
        layer + "self_attn.qkv_proj.weight",
        layer + "self_attn.o_proj.weight",
        layer + "mlp.experts.gate_up_proj",
        layer + "mlp.experts.down_proj",
        layer + "mlp.shared_expert.gate_up_proj.weight",
        layer + "mlp.shared_expert.down_proj.weight",
    }


def test_muon_settings_without_muon_are_refused_naming_the_fields():
    with pytest.raises(ConfigError) as caught:
        load_config_dict(
            {
                "tokens": {"train_steps": 10},
                "optimizer": {"optimizer_factory": {"muon_momentum": 0.9}},
                "data": {"dataset_folder": "unused"},
            }
        )
    message = str(caught.value)
    assert "optimizer.optimizer_factory.muon_momentum" in message and "name=muon" in message


# Adam's epsilon raised as in the bf16 comparisons: Newton-Schulz's fp32 rounding (~2e-6 of an update) moves
# the next steps' gradients of the embedding, and Adam's division of its smallest gradients by sqrt(v)
# amplifies that beyond the bound with the default 1e-8 (seen at dp2 x ep2 x tp2).
MUON = (
    "optimizer.optimizer_factory.name=muon",
    "optimizer.optimizer_factory.muon_learning_rate=1e-2",
    SMOOTH_ADAM,
)
EXPERTS = (
    "model.model_config.moe.num_experts=4",
    "model.model_config.moe.num_experts_per_tok=2",
    "model.model_config.moe.intermediate_size=32",
)


@pytest.mark.distributed
def test_muon_equals_one_process_over_dp_tp_and_cp(tiny_config):
    """Newton-Schulz sees each whole matrix whichever ranks hold its pieces: dp2 without ZeRO and with
    ZeRO-1 (the momentum sharded, N gathered a bucket at a time; bf16 on both CPU paths, Newton-Schulz in
    bf16), ZeRO-2 and ZeRO-3 (also under tp2); tp2 in both modes (q|k|v split per kv head, gate|up per
    part); cp2."""
    check_layouts(
        lambda *overrides: tiny_config(*MUON, *overrides),
        {
            ("parallelism.dp=2",): [("float32", None, ())],
            ("parallelism.dp=2", "optimizer.zero_stage=1"): [
                ("float32", None, ()),
                ("bfloat16", True, ()),
                ("bfloat16", False, ()),
            ],
            ("parallelism.dp=2", "optimizer.zero_stage=2"): [("float32", None, ())],
            ("parallelism.dp=2", "optimizer.zero_stage=3"): [("float32", None, ())],
            ("parallelism.dp=2", "parallelism.tp=2", "optimizer.zero_stage=3"): [("float32", None, ())],
            ("parallelism.tp=2",): [("float32", None, ())],
            ("parallelism.tp=2", "parallelism.tp_mode=REDUCE_SCATTER"): [("float32", None, ())],
            ("parallelism.cp=2",): [("float32", None, ())],
        },
    )


@pytest.mark.distributed
def test_muon_equals_one_process_over_pp_3d_and_experts(tiny_config):
    """pp2; dp2 x tp2 x pp2 with ZeRO-1; the experts' matrices, one per expert, over ep2 (with ZeRO-1 over
    their replicas) and with tp2 inside them."""
    check_layouts(
        lambda *overrides: tiny_config(*MUON, *overrides),
        {
            ("parallelism.pp=2",): [("float32", None, ())],
            ("parallelism.dp=2", "parallelism.tp=2", "parallelism.pp=2", "optimizer.zero_stage=1"): [
                ("float32", None, ())
            ],
            ("parallelism.dp=2", "parallelism.ep=2", "optimizer.zero_stage=1"): [("float32", None, EXPERTS)],
            ("parallelism.dp=2", "parallelism.ep=2", "parallelism.tp=2"): [("float32", None, EXPERTS)],
        },
    )


def count_newton_schulz(rank: int, config) -> dict:
    """`record_steps` on one rank, with how often it ran Newton-Schulz (a call of orthogonal_update: one
    weight's matrices), how many Muon weights it holds, its tp rank, and the bytes Muon's last step sent and
    those `bytes_per_step` counts."""
    calls = []
    computed = muon_module.orthogonal_update

    def counted(*args):
        calls.append(args)
        return computed(*args)

    muon_module.orthogonal_update = counted
    seen = {}
    par = config.parallelism
    with ParallelContext(par.dp, par.tp, par.pp, collective_timeout_seconds=120) as ctx:

        def prepare(trainer) -> None:
            muon = trainer.optimizer.muon
            seen["weights"] = sum(muon.orthogonalised)
            seen["counted"] = sum(muon.bytes_per_step().values())
            step = muon.step

            def step_counting_bytes(*args) -> None:
                before = sum(ctx.comm.bytes_sent.values())
                step(*args)
                seen["sent"] = sum(ctx.comm.bytes_sent.values()) - before

            muon.step = step_counting_bytes

        seen["steps"] = record_steps(config, ctx, prepare=prepare)
        seen["tp_rank"] = ctx.tp_rank
    return {**seen, "calls": len(calls)}


@pytest.mark.distributed
@pytest.mark.parametrize(
    "layout",
    [
        ("parallelism.dp=2", "optimizer.zero_stage=1"),
        ("parallelism.dp=4", "optimizer.zero_stage=2"),
        ("parallelism.dp=2", "parallelism.tp=2", "optimizer.zero_stage=1"),
        ("parallelism.dp=2",),
    ],
)
def test_newton_schulz_runs_once_per_matrix_on_one_replica(tiny_config, layout):
    """Buckets smaller than a matrix (each weight is gathered whole on every replica): one replica per
    weight computes it (with its tp peers), not every replica holding a piece of it; the steps still equal
    one process's, and Muon sends the bytes `bytes_per_step` (doctor) counts."""
    dp = int(layout[0].split("=")[1])
    config = layout_case(tiny_config, "float32", None, *MUON, *layout, dp=dp)
    per_rank = run_ranks(count_newton_schulz, config.parallelism.world_size, config, timeout=300)
    steps = 3  # record_steps' optimizer steps
    for tp_rank in range(config.parallelism.tp):
        replicas = [rank for rank in per_rank if rank["tp_rank"] == tp_rank]
        weights = replicas[0]["weights"]
        assert len(replicas) == dp and weights > dp and {weights} == {r["weights"] for r in replicas}
        calls = [r["calls"] for r in replicas]
        assert sum(calls) == steps * weights and min(calls) > 0, (layout, calls, weights)
    assert all(rank["sent"] == rank["counted"] > 0 for rank in per_rank), per_rank
    reference = record_steps(layout_case(tiny_config, "float32", None, *MUON), ParallelContext())
    assert_steps_match(per_rank[0]["steps"], reference, label=str(layout))


@pytest.mark.distributed
def test_muon_s_momentum_resumes_bit_exact_and_on_another_mesh(tiny_config):
    """dp2 x tp2 x pp2 with ZeRO-1: 3 steps, a checkpoint, 3 more equal 6 uninterrupted bit for bit; the
    checkpoint continues on one process without ZeRO. It holds Muon's momentum for the matrices and Adam's
    moments for the rest, not both."""
    per_rank, saved = whole_then_halves(tiny_config, "muon-", *MUON, dp=2, tp=2, pp=2, zero=1)
    assert_the_resume_is_bit_exact(per_rank)
    assert_one_process_continues(tiny_config, "muon-single", saved, per_rank, *MUON)
    with CheckpointReader(resolve(saved)[0]) as reader:
        for name in ("layers.0.self_attn.qkv_proj.weight", "layers.3.mlp.gate_up_proj.weight"):
            assert reader.has(f"momentum/{name}") and not reader.has(f"exp_avg/{name}"), name
        for name in ("embed_tokens.weight", "layers.0.input_layernorm.weight"):
            assert reader.has(f"exp_avg_sq/{name}") and not reader.has(f"momentum/{name}"), name


def test_an_adam_checkpoint_resumed_with_muon_is_refused_naming_both_and_the_fix(tiny_config):
    adam = make(tiny_config, "adam-then-muon", "checkpoints.checkpoint_interval=1", steps=1)
    ranks_train(0, [adam])
    muon = make(tiny_config, "adam-then-muon", *MUON, steps=2)
    with pytest.raises(CheckpointError) as caught:
        ranks_train(0, [muon])
    message = str(caught.value)
    assert "optimizer_factory.name=adamW" in message and "optimizer.optimizer_factory.name is muon" in message
    assert "checkpoints.load_optimizer=false" in message
