"""Context parallelism and document masking equal one process: the zigzag split, the attention blocks, ring
attention in every layout (loss, full-shape gradients, 3 optimizer steps), the ring's exact bytes, and
document masking against each document run on its own."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from distributed import run_ranks
from helpers import (
    assert_close_to_reference,
    build_llama,
    check_layouts,
    llama_config,
    precision_path,
)

from femtotron import attention
from femtotron.attention import (
    Window,
    attention_with_lse,
    attention_with_lse_backward,
    block_kernel,
    math_attention_with_lse,
    math_attention_with_lse_backward,
)
from femtotron.batch import MicroBatch
from femtotron.diagnostics.doctor import ring_bytes
from femtotron.diagnostics.start_report import cp_host_warnings
from femtotron.errors import ConfigError
from femtotron.mesh import Mesh
from femtotron.parallel.comm import Comm, Group
from femtotron.parallel.context import ParallelContext
from femtotron.parallel.context_parallel import (
    ContextParallel,
    _block_of,
    _sources,
    documents_of,
    place_tokens,
    ring_attention,
    zigzag_indices,
)
from femtotron.trainer import Trainer

EOS = 0


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_zigzag_gives_each_rank_two_chunks_and_equal_causal_work(cp):
    length = 8 * cp
    parts = [zigzag_indices(length, cp, rank) for rank in range(cp)]
    assert sorted(torch.cat(parts).tolist()) == list(range(length))
    assert parts[0].tolist()[: length // (2 * cp)] == list(range(length // (2 * cp)))
    work = {int((part + 1).sum()) for part in parts}  # a query at position p sees p + 1 keys
    assert len(work) == 1


def test_documents_end_with_their_end_token_and_positions_restart_after_it():
    inputs = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8, 9]])
    documents, positions = documents_of(inputs, EOS)
    assert documents.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3]]
    assert positions.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]


@pytest.mark.parametrize("cp", [1, 2])
def test_the_placement_s_positions_restart_at_each_document(cp):
    """RoPE's positions, read directly: no loss test can see them restart wrongly, since RoPE depends only
    on distances and the mask keeps attention inside a document."""
    inputs = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8, 9]])
    within = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1]])
    batch = MicroBatch(inputs=inputs, targets=inputs.roll(-1, 1))
    for rank in range(cp):
        placement = place_tokens(batch, cp, rank, EOS).placement
        assert placement.positions.tolist() == within[:, zigzag_indices(8, cp, rank)].tolist()


def _ring_step_holds(rank):
    ctx = ParallelContext(cp=4, collective_timeout_seconds=30)
    ring = ContextParallel(ctx.comm, ctx.cp_group, ctx.cp_rank, ctx.cp_links)
    held = [ring.rank]
    tensor = torch.tensor([float(ring.rank)])
    for step in range(1, ring.size):
        shift = ring.start_shift(tensor, tag=step)
        tensor = ring.finish_shift(shift)
        ring.finish_sends([shift])
        held.append(int(tensor.item()))
    ctx.close()
    return {"held": held, "sources": _sources(ring)}


@pytest.mark.distributed
def test_the_ring_passes_keys_to_the_following_rank_as_the_sources_say():
    """cp = 4, where the two directions differ: at each ring step a rank holds the block of the rank
    `_sources` names (the preceding one, then the one before), which the causal masks depend on."""
    for rank, out in enumerate(run_ranks(_ring_step_holds, 4)):
        assert out["held"] == out["sources"] == [(rank - step) % 4 for step in range(4)]


def _qkv(dtype=torch.float32, rows=12, cols=12, device="cpu"):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, rows, 8, generator=generator).to(dtype)
    k, v = (torch.randn(2, 2, cols, 8, generator=generator).to(dtype) for _ in range(2))
    return q.to(device), k.to(device), v.to(device)


def _fake_flash(q, k, v, dropout_p, is_causal):
    """CUDA's flash kernel as its callers see it (GQA; the lse (batch, heads, queries)), by the CPU's."""
    assert q.shape[1] % k.shape[1] == 0 and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    out, lse = attention._CPU_FLASH(q, k, v, dropout_p, is_causal)
    rng_state, unused = torch.empty(2, dtype=torch.uint64), torch.empty((), dtype=torch.uint64)
    return out, lse, None, None, q.shape[-2], k.shape[-2], rng_state, unused, torch.empty(0)


def _fake_flash_backward(grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, causal, *rng):
    """Its backward: it reads the lse as a contiguous fp32 array and takes no cumulative lengths (dense)."""
    assert lse.is_contiguous() and lse.shape == q.shape[:-1] and lse.dtype == torch.float32
    assert cum_q is None and cum_k is None and (max_q, max_k) == (q.shape[-2], k.shape[-2])
    assert out.dtype == grad_out.dtype == q.dtype and len(rng) == 2
    return attention._CPU_FLASH_BACKWARD(grad_out, q, k, v, out, lse, dropout_p, causal)


def _check_bias(bias, q, k):
    """The efficient kernel's rules for its bias: q's dtype, (batch, heads, queries, keys), rows aligned."""
    assert bias.dtype == q.dtype and bias.shape == (*q.shape[:3], k.shape[-2]) and bias.stride(-1) == 1
    assert all(stride % 8 == 0 for stride in bias.stride()[:-1])


def _fake_efficient(q, k, v, bias, compute_log_sumexp, dropout_p=0.0, is_causal=False):
    """CUDA's memory-efficient kernel: no GQA, an lse padded with +inf to a multiple of 32 queries, and (at
    worst) NaN for a query whose every key is masked."""
    assert q.shape[1] == k.shape[1] == v.shape[1] and compute_log_sumexp
    _check_bias(bias, q, k)
    out, lse = attention._CPU_FLASH(q, k, v, dropout_p, is_causal, attn_mask=bias)
    unseen = (bias == float("-inf")).all(-1)
    rows = q.shape[-2]
    padding = torch.full((*lse.shape[:-1], -rows % 32), float("inf"))
    lse = torch.cat([lse.masked_fill(unseen, float("nan")), padding], dim=-1)
    return out.masked_fill(unseen.unsqueeze(-1), float("nan")), lse, torch.empty(()), torch.empty(())


def _fake_efficient_backward(grad_out, q, k, v, bias, out, lse, seed, offset, dropout_p, computed, causal):
    """Its backward: the lse as the forward pads it, and the output in the forward's (batch, queries, heads,
    head_dim) layout, which the kernel assumes."""
    assert q.shape[1] == k.shape[1] == v.shape[1] and list(computed) == [True, True, True, False]
    _check_bias(bias, q, k)
    lse, padding = lse[..., : q.shape[-2]], lse[..., q.shape[-2] :]
    assert (lse.shape[-1] + padding.shape[-1]) % 32 == 0
    assert bool((padding == float("inf")).all()) and out.transpose(1, 2).is_contiguous()
    grads = attention._CPU_FLASH_BACKWARD(grad_out, q, k, v, out, lse, dropout_p, causal, attn_mask=bias)
    return (*grads, None)


def _run_as(kernel, monkeypatch):
    """Every block runs `kernel`; CUDA's kernels are the fakes above (which check what they are given)."""
    monkeypatch.setattr(attention, "_kernel_of", lambda q, masked: kernel)
    for name, fake in {
        "_FLASH": _fake_flash,
        "_FLASH_BACKWARD": _fake_flash_backward,
        "_EFFICIENT": _fake_efficient,
        "_EFFICIENT_BACKWARD": _fake_efficient_backward,
    }.items():
        monkeypatch.setattr(attention, name, fake)


def _block_documents(rows=12, cols=24):
    """Random documents of queries and keys (in 0-3), with one query (3) whose document (4) no key of the
    first 12 has; the second 12 keys include every document, so that every query sees some key."""
    generator = torch.Generator().manual_seed(1)
    query_documents = torch.randint(0, 4, (2, rows), generator=generator)
    key_documents = torch.randint(0, 4, (2, cols), generator=generator)
    query_documents[:, 3] = 4
    key_documents[:, 12:17] = torch.arange(5)
    return query_documents, key_documents


KINDS = ("causal", "full", "masked", "masked causal", "windowed causal", "masked windowed causal")
BLOCK_CASES = [
    *[("cpu flash", kind) for kind in KINDS],
    *[("written out", kind) for kind in KINDS],
    ("flash", "causal"),
    ("flash", "full"),
    ("efficient", "masked"),
    ("efficient", "masked causal"),
    ("efficient", "windowed causal"),
    ("efficient", "masked windowed causal"),
]
WINDOW = 5


@pytest.mark.parametrize("kernel, kind", BLOCK_CASES)
def test_two_blocks_merged_by_log_sum_exp_are_attention_over_all_keys(kernel, kind, monkeypatch):
    """Queries against keys in two blocks (GQA: 2 KV heads for 4 query heads), through each kernel
    (attention.block_kernel; CUDA's emulated on the CPU with their contracts checked): each block's output
    and log-sum-exp, merged, and each block's backward from the merged output and log-sum-exp, give the
    output and the q, k, v gradients of plain softmax attention over all the keys (autograd). The kernels
    with a per-row buffer take their 12 query rows in chunks (as at long sequences, to bound its memory):
    the written-out one a row at a time, the efficient one 5 at a time. Windowed: the queries and the first
    block's keys are at indices 12-23 of the sequence, the second block's at 0-11, and each query sees the
    WINDOW latest keys."""
    monkeypatch.setattr(attention, "SCORES_PER_CHUNK", 2 * 12 * 5)
    _run_as(kernel, monkeypatch)
    q, k, v = _qkv(cols=24)
    query_documents, key_documents = _block_documents()
    if "windowed" in kind:  # each query sees its own key at least: the window hides the second block's
        key_documents[:, :12] = query_documents
    allowed = torch.ones(2, 1, 12, 24, dtype=torch.bool)
    if kind == "causal":  # the first block is the queries' own (causal), the second is earlier keys
        allowed[..., :12] = torch.ones(12, 12, dtype=torch.bool).tril()
    if kind.startswith("masked"):
        allowed = (query_documents[:, :, None] == key_documents[:, None, :]).unsqueeze(1)
    blocks = [(slice(0, 12), kind.endswith("causal")), (slice(12, 24), False)]
    documents = [
        (query_documents, key_documents[:, cols]) if kind.startswith("masked") else None for cols, _ in blocks
    ]
    if kind.endswith("masked causal"):  # with the causal mask: the own block under document masking
        allowed[..., :12] &= torch.ones(12, 12, dtype=torch.bool).tril()
    windows = [None, None]
    if "windowed" in kind:
        query_index = torch.arange(12, 24)
        key_index = torch.cat([query_index, torch.arange(12)])
        distance = query_index[:, None] - key_index[None, :]
        allowed = allowed & (distance >= 0) & (distance < WINDOW)
        windows = [Window(query_index, key_index[cols], WINDOW) for cols, _ in blocks]
    results = [
        attention_with_lse(q, k[:, :, cols], v[:, :, cols], causal, block_documents, block_window)
        for (cols, causal), block_documents, block_window in zip(blocks, documents, windows, strict=True)
    ]
    lse = torch.logaddexp(results[0][1], results[1][1])
    out = sum(o * (block_lse - lse).exp().unsqueeze(-1) for o, block_lse in results)
    if kind in ("masked", "masked causal"):
        assert torch.isinf(results[0][1][..., 3]).all() and torch.isfinite(lse).all()

    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    scores = inputs[0] @ inputs[1].repeat_interleave(2, 1).transpose(-1, -2) / 8**0.5
    reference = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ inputs[2].repeat_interleave(2, 1)
    torch.testing.assert_close(out, reference.detach())
    grad_out = torch.randn_like(out)
    expected = torch.autograd.grad((grad_out * reference).sum(), inputs)
    grads = [
        attention_with_lse_backward(
            grad_out, q, k[:, :, cols], v[:, :, cols], out, lse, causal, block_documents, block_window
        )
        for (cols, causal), block_documents, block_window in zip(blocks, documents, windows, strict=True)
    ]
    torch.testing.assert_close(grads[0][0] + grads[1][0], expected[0])
    torch.testing.assert_close(torch.cat([grads[0][1], grads[1][1]], dim=2), expected[1])
    torch.testing.assert_close(torch.cat([grads[0][2], grads[1][2]], dim=2), expected[2])


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize(
    "device, dtype, capability, head_dim, masked, kernel",
    [
        ("cpu", BF16, None, 64, True, "cpu flash"),
        ("cpu", FP32, None, 64, False, "cpu flash"),
        ("cuda", BF16, (9, 0), 128, False, "flash"),
        ("cuda", BF16, (9, 0), 128, True, "efficient"),
        ("cuda", FP16, (8, 0), 64, False, "flash"),
        ("cuda", BF16, (10, 0), 256, True, "efficient"),
        ("cuda", BF16, (12, 1), 64, False, "flash"),
        ("cuda", FP32, (9, 0), 128, False, "written out"),  # no fused kernel for fp32 here
        ("cuda", FP32, (9, 0), 128, True, "written out"),
        ("cuda", BF16, (7, 5), 64, False, "written out"),  # before Ampere
        ("cuda", BF16, (13, 0), 64, False, "written out"),  # past torch 2.13's flash range
        ("cuda", BF16, (9, 0), 60, False, "written out"),  # not a multiple of 8
        ("cuda", BF16, (9, 0), 264, True, "written out"),  # over 256
        ("cuda", BF16, (9, 0), 200, False, "flash"),
        ("cuda", BF16, (8, 6), 200, False, "written out"),  # flash's backward lacks the shared memory there
        ("cuda", BF16, (12, 0), 224, True, "written out"),
        ("cuda", BF16, (8, 9), 232, False, "flash"),
        ("mps", BF16, None, 64, False, "written out"),
    ],
)
def test_the_kernel_of_a_block_follows_dtype_capability_head_dim_and_mask(
    device, dtype, capability, head_dim, masked, kernel
):
    assert block_kernel(device, dtype, capability, head_dim, masked) == kernel


@pytest.mark.parametrize("masked", [False, True], ids=["flash", "efficient"])
@pytest.mark.parametrize("causal", [True, False])
def test_the_cuda_kernels_are_called_as_torch_declares_them(causal, masked):
    """On the meta device (a GPU's memory estimate) the blocks take CUDA's kernels: torch's own shape
    functions of the same ops check the calls, forward and backward; a block's tensors keep their shapes,
    its lse and gradients with the KV heads come back as the ring merges them."""
    q, k, v = _qkv(torch.bfloat16, rows=40, cols=40, device="meta")
    documents = (torch.zeros(2, 40, dtype=torch.long, device="meta"),) * 2 if masked else None
    assert attention._kernel_of(q, masked) == ("efficient" if masked else "flash")
    out, lse = attention_with_lse(q, k, v, causal, documents)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == (q.shape, q.dtype, q.shape[:-1], torch.float32)
    grads = attention_with_lse_backward(torch.empty_like(out), q, k, v, out, lse, causal, documents)
    assert [(g.shape, g.dtype) for g in grads] == [(t.shape, t.dtype) for t in (q, k, v)]


def test_the_written_out_blocks_repeat_the_kv_heads_once_per_block(monkeypatch):
    """K and V are repeated to the query heads once per block, forward and backward, not per row chunk."""
    monkeypatch.setattr(attention, "SCORES_PER_CHUNK", 2 * 4 * 12)  # a row at a time: 12 chunks
    repeats = []
    grouped = attention._grouped
    monkeypatch.setattr(attention, "_grouped", lambda kv, q: repeats.append(kv.shape) or grouped(kv, q))
    q, k, v = _qkv()
    out, lse = math_attention_with_lse(q, k, v, True, None)
    math_attention_with_lse_backward(torch.randn_like(out), q, k, v, out, lse, True, None)
    assert len(repeats) == 4


def _documents_batch(length=32, rows=3, seed=0) -> MicroBatch:
    """Packed samples of documents of 1 to 12 tokens, each ended by EOS."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 251, size=(rows, length + 1))  # llama_config's vocabulary
    tokens[rng.random((rows, length + 1)) < 0.15] = EOS
    tokens[:, 5] = EOS
    return MicroBatch.from_tokens(torch.from_numpy(tokens))


@pytest.mark.parametrize(
    "dtype, native", [(torch.float32, None), (torch.bfloat16, True), (torch.bfloat16, False)]
)
def test_document_masking_equals_each_document_on_its_own(dtype, native):
    """Loss and every gradient of a packed batch with document masking equal the sums over its documents, each
    run alone from position 0 (bf16: within bf16 rounding of the same computation in fp32)."""
    cfg = llama_config(max_position_embeddings=64)
    batch = _documents_batch()

    def packed(dtype):
        model = build_llama(cfg, dtype)
        placed = place_tokens(batch, 1, 0, EOS)
        loss = model(placed.inputs, placed.targets, placed.placement)[0]
        loss.backward()
        return loss.item(), {n: p.grad.float() for n, p in model.named_parameters()}

    def alone(dtype):
        model = build_llama(cfg, dtype)
        total = 0.0
        for row in range(batch.inputs.shape[0]):
            ends = (batch.inputs[row] == EOS).nonzero().flatten().tolist()
            for start, end in zip(
                [0, *[e + 1 for e in ends]], [*[e + 1 for e in ends], batch.inputs.shape[1]], strict=True
            ):
                if start < end:
                    loss = model(
                        batch.inputs[row : row + 1, start:end], batch.targets[row : row + 1, start:end]
                    )[0]
                    loss.backward()
                    total += loss.item()
        return total, {n: p.grad.float() for n, p in model.named_parameters()}

    with precision_path(native):
        (loss, grads), (reference_loss, reference_grads) = packed(dtype), alone(dtype)
    exact_loss, exact_grads = alone(torch.float32) if dtype != torch.float32 else (None, {})
    assert_close_to_reference(loss, reference_loss, exact_loss, label="loss")
    for name, grad in reference_grads.items():
        assert_close_to_reference(grads[name], grad, exact_grads.get(name), label=name)
    plain = build_llama(cfg)(batch.inputs, batch.targets)[0].item()
    assert abs(plain - reference_loss) > 1e-3  # masking changed something: the test can fail


SLIDING_WINDOW = ("model.model_config.sliding_window=6", "model.model_config.full_attention_layers=[1]")
CP_CASES = {
    ("parallelism.cp=2",): [
        ("float32", None, ()),
        ("bfloat16", True, ()),
        ("bfloat16", False, ()),
        ("float32", None, ("optimizer.zero_stage=1", "parallelism.recompute_layer=true")),
    ],
    # Guards the ring's direction: at cp = 2 the following and the preceding rank are the same one. With a
    # sliding window of 6 over chunks of 4 tokens, some blocks are skipped, some masked, some whole.
    ("parallelism.cp=4",): [("float32", None, ()), ("float32", None, SLIDING_WINDOW)],
}


@pytest.mark.distributed
def test_context_parallel_equals_one_process(tiny_config):
    """cp = 2 (fp32, bf16 on both CPU paths, ZeRO-1 over the cp ranks with recomputation) and cp = 4 (also
    with a sliding window): loss and
    full-shape gradients of one step, then 3 steps' losses, grad norms and weight changes equal one process;
    every rank logs the same loss."""
    check_layouts(tiny_config, CP_CASES)


@pytest.mark.distributed
def test_context_parallel_with_dp_tp_and_pp_equals_one_process(tiny_config):
    """dp2 x cp2 x tp2 (sequence parallel, ZeRO-2 over dp x cp) and cp2 x tp2 x pp2 (1F1B, interleaved; and
    ZeRO-2 over the cp ranks with recomputation)."""
    check_layouts(
        tiny_config,
        {
            (
                "parallelism.dp=2",
                "parallelism.cp=2",
                "parallelism.tp=2",
                "parallelism.tp_mode=REDUCE_SCATTER",
            ): [("float32", None, ("optimizer.zero_stage=2",))],
            ("parallelism.cp=2", "parallelism.tp=2", "parallelism.pp=2"): [
                ("float32", None, ()),
                ("float32", None, ("optimizer.zero_stage=2", "parallelism.recompute_layer=true")),
            ],
            (
                "parallelism.cp=2",
                "parallelism.tp=2",
                "parallelism.pp=2",
                "parallelism.pp_engine=interleaved-1f1b",
                "parallelism.pp_virtual_stages=2",
            ): [("float32", None, ())],
        },
    )


@pytest.mark.distributed
def test_document_masking_with_context_parallel_equals_one_process(documents_config):
    """Document masking at cp = 2 and 4 (masked blocks; blocks no query sees skipped) equals it on one
    process, and at cp2 x tp2 x pp2 (AFAB: with the other tests, every pipeline engine runs with cp)."""
    check_layouts(
        documents_config,
        {
            ("parallelism.cp=2",): [("float32", None, ()), ("bfloat16", False, ())],
            ("parallelism.cp=4",): [("float32", None, ())],
            ("parallelism.cp=2", "parallelism.tp=2", "parallelism.pp=2", "parallelism.pp_engine=afab"): [
                ("float32", None, ())
            ],
        },
    )


def test_some_ring_blocks_are_skipped_under_document_masking():
    """With short documents a rank's queries see nothing of most other ranks' keys: those blocks are not
    computed. cp = 4 over 64 tokens: rank 3 holds tokens 24-31 and 32-39; documents of 4 tokens end at every
    multiple of 4, so only rank 2's block (tokens 16-23, 40-47) has keys (21-23) that a query here sees."""
    inputs = torch.full((1, 65), 7)
    inputs[0, ::4] = EOS
    placed = place_tokens(MicroBatch.from_tokens(inputs), 4, 3, EOS)
    assert placed.placement.visible == (False, False, True, True)
    assert place_tokens(MicroBatch.from_tokens(inputs), 4, 3, None).placement.visible == (True,) * 4


@pytest.mark.parametrize("cp", [2, 4])
def test_which_blocks_are_seen_and_their_masks_are_the_brute_force_ones(cp):
    """On random layouts (documents of one token to longer than the sequence, spanning chunks and ranks; a
    sliding window or none): `visible` (the first query against the last key) and the block's `in_window` say
    whether any query of the rank sees any key of the other causally within its document and window, and each
    block's rows, columns, documents and window mark exactly the pairs that do (none outside them)."""
    rng = np.random.default_rng(cp)
    seen = []
    for _ in range(100):
        chunk = int(rng.integers(1, 6))
        length = 2 * cp * chunk
        window = int(rng.integers(1, length + 2)) if rng.random() < 0.5 else None
        tokens = torch.from_numpy(rng.integers(1, 9, (3, length + 1)))
        tokens[torch.from_numpy(rng.random(tokens.shape) < rng.choice([0.0, 0.05, 0.2, 0.5, 0.9]))] = EOS
        batch = MicroBatch.from_tokens(tokens)
        documents, _ = documents_of(batch.inputs, EOS)
        for rank in range(cp):
            placement = place_tokens(batch, cp, rank, EOS).placement
            queries = zigzag_indices(length, cp, rank)
            for source in range(cp):
                keys = zigzag_indices(length, cp, source)
                same = documents[:, queries, None] == documents[:, None, keys]
                distance = queries[:, None] - keys[None, :]
                sees = same & (distance >= 0) & (distance < (window or length))
                of = _block_of(rank, source, 2 * chunk, placement.documents, window=window, cp_size=cp)
                assert (placement.visible[source] and of.in_window) == bool(sees.any())
                if source != rank:
                    seen.append(placement.visible[source] and of.in_window)
                block = torch.zeros_like(sees)
                shape = (len(range(2 * chunk)[of.rows]), len(range(2 * chunk)[of.cols]))
                if of.in_window:
                    visible = attention._visible(
                        of.documents, of.window, of.causal, slice(0, shape[0]), shape[1], "cpu"
                    )
                    block[:, of.rows, of.cols] = visible.squeeze(1)
                assert torch.equal(block, sees)
    assert any(seen) and not all(seen)  # some blocks are seen, some not: either answer can be wrong


def test_document_masking_without_a_tokenizer_says_which_key_to_set(tiny_config):
    with pytest.raises(ConfigError, match="tokenizer.tokenizer_name_or_path"):
        Trainer(tiny_config("model.document_masking=true"), ParallelContext(), log_to_console=False)


def _ring_bytes(rank, config):
    ctx = ParallelContext(cp=config.parallelism.cp, collective_timeout_seconds=60)
    trainer = Trainer(config, ctx, log_to_console=False)
    trainer.train_step()
    sent = dict(ctx.comm.bytes_sent)
    ctx.close()
    return sent


@pytest.mark.distributed
@pytest.mark.parametrize("cp, recompute", [(2, False), (4, True)])
def test_the_ring_sends_exactly_the_analytic_bytes(tiny_config, cp, recompute):
    """Per layer and micro-batch: cp - 1 blocks of keys and values forward (again when recomputed), cp - 1
    in backward with cp blocks of their fp32 gradients: what `femtotron doctor` counts."""
    config = tiny_config(
        f"parallelism.cp={cp}",
        f"parallelism.recompute_layer={str(recompute).lower()}",
        "tokens.batch_accumulation_per_replica=2",
    )
    mcfg, tokens = config.model.model_config_, config.tokens
    block = (
        2
        * tokens.micro_batch_size
        * tokens.sequence_length
        // cp
        * mcfg.num_key_value_heads
        * mcfg.head_dim
        * 4
    )
    forwards = 2 if recompute else 1
    expected = mcfg.num_hidden_layers * 2 * ((forwards + 1) * (cp - 1) * block + cp * block)
    assert ring_bytes(config) == expected
    for sent in run_ranks(_ring_bytes, cp, config, timeout=120):
        assert sent[("cp", "send")] == expected
        assert ("dp_cp", "all_reduce") in sent  # gradients over the cp ranks, on the dp x cp group


def test_a_ring_across_hosts_is_a_start_warning_that_says_what_to_watch():
    rings = Mesh(dp=1, tp=2, pp=1, cp=2).groups()["cp"]  # (0, 2) and (1, 3)
    assert cp_host_warnings(rings, ["a", "a", "a", "a"]) == []
    (warning,) = cp_host_warnings(rings, ["a", "a", "b", "b"])
    assert warning.startswith("2 context-parallel ring(s) span several hosts, e.g. ranks 0, 2 on a, b")
    assert "parallelism.tp * parallelism.cp within a node" in warning


@pytest.mark.parametrize("cp", [1, 2])
def test_a_windowed_block_is_planned_on_the_host_so_doctor_s_meta_device_can_place_it(cp):
    """doctor runs the model on the meta device, where a value cannot be read: the block's window checks read
    indices, and ended every doctor of a windowed config with document masking in a traceback."""
    meta = torch.device("meta")
    block = _block_of(0, 0, 16 // cp, None, window=3, cp_size=cp, device=meta)
    assert block.in_window and block.window is not None
    assert block.window.query_index.device == meta
    host = _block_of(0, 0, 16 // cp, None, window=3, cp_size=cp)
    assert torch.equal(host.window.query_index, zigzag_indices(16, cp, 0))


@pytest.mark.parametrize("eos_id", [None, EOS])
def test_ring_attention_with_a_window_reads_no_value_of_the_device(eos_id):
    """Every read of a device value is a host sync on a GPU (4 per ring step per layer before the window's
    bounds were host arithmetic). On the meta device any read raises: forward and backward of both ranks of a
    cp = 2 ring (one process: a rank's own keys stand in for its neighbour's) run there whole."""
    tokens = torch.randint(1, 9, (1, 17), generator=torch.Generator().manual_seed(0))
    tokens[0, ::3] = EOS
    for rank in range(2):
        ring = ContextParallel(Comm(), Group("cp", (0, 1)), rank)
        placement = place_tokens(MicroBatch.from_tokens(tokens), 2, rank, eos_id).placement.to("meta")
        q, k, v = (torch.empty(1, heads, 8, 8, device="meta", requires_grad=True) for heads in (4, 2, 2))
        ring_attention(q, k, v, placement, ring, window=3).sum().backward()
        assert q.grad.shape == q.shape and k.grad.shape == k.shape
