"""What many tests share: tiny data and configs, a few training steps recorded, and the rule for comparing a
parallel run with one process in fp32 and in bf16 (on both of the CPU's bf16 paths)."""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from distributed import run_ranks

import femtotron.precision as precision_module
from femtotron.batch import IGNORE_INDEX, MicroBatch
from femtotron.config import LlamaConfig, load_config_dict
from femtotron.data.indexed import IndexedDatasetWriter
from femtotron.diagnostics.check_tp import full_gradients
from femtotron.models.llama import Llama
from femtotron.optim.zero import ZeroOptimizer
from femtotron.parallel.context import ParallelContext
from femtotron.parallel.tensor_parallel import TensorParallel, full_tensor
from femtotron.trainer import Trainer

TINY_VOCAB = 256
# The ~100k-parameter model of the config-level tests: 4 heads of 16 dims, 2 kv heads.
TINY_MODEL = {
    "vocab_size": TINY_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}

# bf16 keeps 8 significant bits: rounding to bf16 changes a value by at most 2^-8 of it.
BF16_ROUNDOFF = 2.0**-8
# In bf16 comparisons Adam's epsilon is raised above the smallest gradients: with the default 1e-8 Adam moves
# every element by about +-lr whatever its gradient's size, so a rounding that flips the sign of a near-zero
# gradient flips a whole update. With 1e-3 the update is a smooth function of the gradient, and rounding
# moves it by a rounding's worth.
SMOOTH_ADAM = "optimizer.optimizer_factory.adam_eps=1e-3"
# The CPU's two ways to compute bf16 (precision.py), forced either way so every machine runs both.
BF16_PATHS = pytest.mark.parametrize("native", [True, False], ids=["native-bf16", "upcast-bf16"])
# model.compile on a CPU needs a C++ compiler (TorchInductor's, as it looks for one): without, its tests skip.
NEEDS_CXX = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None,
    reason="model.compile: needs a C++ compiler ($CXX or g++) for TorchInductor on the CPU",
)


@contextmanager
def cpu_low_precision_path(native: bool) -> Iterator[None]:
    """Run low-precision matmuls on the CPU natively (as on a CPU with bf16 units) or upcast to fp32 (as
    without), whatever this CPU has. Processes forked inside the block inherit the choice."""
    before, precision_module.native_on_cpu = precision_module.native_on_cpu, native
    try:
        yield
    finally:
        precision_module.native_on_cpu = before


def precision_path(native: bool | None) -> AbstractContextManager:
    """Low-precision matmuls native (True) or upcast (False) on the CPU; None: as this CPU does them."""
    return nullcontext() if native is None else cpu_low_precision_path(native)


def llama_config(**overrides) -> LlamaConfig:
    """A tiny Llama for model-level tests: 8 query heads of 8 dims, 2 kv heads (GQA), and vocab 251, divisible
    by neither 2 nor 4, so every tp pads the vocabulary."""
    return LlamaConfig(
        **{
            "vocab_size": 251,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "max_position_embeddings": 32,
            "rms_norm_eps": 1e-5,
            **overrides,
        }
    )


def build_llama(cfg: LlamaConfig, dtype: torch.dtype = torch.float32, seed: int = 5, **kwargs) -> Llama:
    return Llama(cfg, std=0.02, seed=seed, dtype=dtype, device=torch.device("cpu"), **kwargs)


def random_batch(vocab: int, size: int = 3, length: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and next-token targets, the first 5 targets of sample 0 masked and the last target of the
    last sample the vocabulary's last row (next to any tp padding)."""
    ids = torch.randint(0, vocab, (size, length + 1), generator=torch.Generator().manual_seed(11))
    targets = ids[:, 1:].clone()
    targets[0, :5] = IGNORE_INDEX
    targets[-1, -1] = vocab - 1
    return ids[:, :-1], targets


def loss_and_grads(model: Llama, ids: torch.Tensor, targets: torch.Tensor, tp: TensorParallel | None = None):
    """The mean loss over valid targets, the full logits and every gradient at full shape (fp32)."""
    loss_sum, count = model(ids, targets)
    (loss_sum / count).backward()
    grads = {
        name: grad.float() for name, grad in full_gradients(model, tp or TensorParallel.single()).items()
    }
    return (loss_sum / count).item(), model.logits(ids).detach().float(), grads


def hf_llama(cfg: LlamaConfig, weights: dict[str, torch.Tensor], **hf_options):
    """Hugging Face's LlamaForCausalLM with femtotron's full-shape weights: the independent reference."""
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    from femtotron.models.hf_conversion import to_hf

    hf = LlamaForCausalLM(
        HFLlamaConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_hidden_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            max_position_embeddings=cfg.max_position_embeddings,
            rope_theta=cfg.rope_theta,
            rms_norm_eps=cfg.rms_norm_eps,
            tie_word_embeddings=cfg.tie_word_embeddings,
            attention_bias=False,
            mlp_bias=False,
            **hf_options,
        )
    ).float()
    state = to_hf(weights, cfg)
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    hf.load_state_dict(state, strict=True)
    return hf


def write_patterned_tokens(prefix: Path, documents: int = 12, length: int = 700, seed: int = 0) -> str:
    """Documents following t[i+1] = (5 t[i] + 3) mod V from a random start, with 10% noise: learnable fast."""
    rng = np.random.default_rng(seed)
    writer = IndexedDatasetWriter(str(prefix), np.uint16)
    for _ in range(documents):
        tokens = np.empty(length, dtype=np.int64)
        tokens[0] = rng.integers(1, TINY_VOCAB)
        for i in range(1, length):
            tokens[i] = (5 * tokens[i - 1] + 3) % TINY_VOCAB
        noise = rng.random(length) < 0.1
        tokens[noise] = rng.integers(1, TINY_VOCAB, noise.sum())
        writer.add_document(tokens.astype(np.uint16))
    writer.finalize()
    return str(prefix)


def tokenize_with_datatrove(folder, tokenizer_path, words: list[str], documents: int = 120, seed: int = 4):
    """A folder as datatrove's DocumentTokenizer writes it (the tokenizer nanotron users run): two shuffled
    files (ranks 0 and 1) with their .ds.index and .ds.metadata, of random sentences over `words`."""
    from datatrove.data import Document  # a dev dependency only the data tests need
    from datatrove.pipeline.tokens.tokenizer import DocumentTokenizer

    rng = np.random.default_rng(seed)
    texts = [" ".join(rng.choice(words, size=rng.integers(2, 40))) for _ in range(documents)]
    for rank in (0, 1):
        step = DocumentTokenizer(str(folder), str(tokenizer_path), eos_token="<|endoftext|>", seed=rank)
        step.run((Document(text=t, id=str(i)) for i, t in enumerate(texts[rank::2])), rank=rank)
    return folder


def tiny_config_maker(runs_dir: Path, dataset: str):
    """Configs for a ~100k-parameter fp32 model on the patterned data; overrides are dotted keys."""

    def make(*overrides: str, **sections):
        raw = {
            "general": {"run": "tiny", "seed": 3},
            "model": {"model_config": dict(TINY_MODEL), "dtype": "float32"},
            "tokens": {"sequence_length": 32, "micro_batch_size": 4, "train_steps": 10},
            "optimizer": {"learning_rate_scheduler": {"learning_rate": 3e-3, "lr_warmup_steps": 2}},
            "data": {"dataset_folder": dataset},
            "logging": {"output_dir": str(runs_dir)},
        }
        for section, values in sections.items():
            raw[section] = {**raw.get(section, {}), **values}
        return load_config_dict(raw, overrides=overrides)

    return make


def write_yaml(config, path: Path) -> str:
    """A loaded config written back as a YAML file, for the command line."""
    path.write_text(yaml.safe_dump(config.to_dict()))
    return str(path)


def femtotron(
    *args: str, env: dict | None = None, timeout: int = 240, launcher=()
) -> subprocess.CompletedProcess:
    """`femtotron ARGS` in a process of its own, as a user runs it; `launcher`: e.g. `torchrun(2, port)`."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    command = [sys.executable, "-m", *launcher, *(["-m"] if launcher else []), "femtotron.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, env=full_env, timeout=timeout)


def torchrun(nprocs: int, port: int) -> tuple[str, ...]:
    """The launcher arguments of `torchrun --nproc-per-node N --master-port PORT`, for `femtotron`."""
    return ("torch.distributed.run", "--nproc-per-node", str(nprocs), "--master-port", str(port))


def write_cli_config(path: Path, dataset: str, tokenizer: str | None, output_dir: Path, **tokens) -> Path:
    """A YAML config for command-line tests: the tiny fp32 model (vocab 320) on `dataset`, run `cli`."""
    config = {
        "general": {"run": "cli"},
        "model": {"model_config": {**TINY_MODEL, "vocab_size": 320}, "dtype": "float32"},
        "tokenizer": {"tokenizer_name_or_path": tokenizer},
        "tokens": {"sequence_length": 32, "micro_batch_size": 4, "train_steps": 6, **tokens},
        "optimizer": {"learning_rate_scheduler": {"learning_rate": 3e-3}},
        "data": {"dataset_folder": dataset},
        "logging": {"output_dir": str(output_dir), "iteration_step_info_interval": 2},
    }
    path.write_text(yaml.safe_dump(config))
    return path


@dataclass
class Steps:
    """A few optimizer steps of one run, everything by parameter name at full shape (from this rank's
    stages): the first step's loss and gradients, then each step's loss and grad norm, and how much the fp32
    master weights moved over the steps."""

    loss: float
    grads: dict[str, torch.Tensor]
    losses: list[float]
    norms: list[float]
    updates: dict[str, torch.Tensor]

    def merge(self, other: Steps) -> Steps:
        """The same run seen from another pipeline stage: its parameters added."""
        grads, updates = {**self.grads, **other.grads}, {**self.updates, **other.updates}
        return Steps(self.loss, grads, self.losses, self.norms, updates)


def record_steps(config, ctx, steps: int = 3, prepare=None) -> Steps:
    """Gradients of one step (then dropped), then `steps` optimizer steps; `prepare(trainer)` runs first."""
    trainer = Trainer(config, ctx, log_to_console=False)
    if prepare is not None:
        prepare(trainer)
    named = trainer.model.named_parameters()

    def full(tensors):
        return {
            n: full_tensor(t, p.shard, trainer.tp, trainer.model.ep.group).float().clone()
            for (n, p), t in zip(named, tensors, strict=True)
        }

    loss, _, pieces = trainer.compute_gradients()
    grads = full(
        trainer.data_parallel.state.full(pieces)
    )  # per parameter, whole (assembled over dp under ZeRO-1)
    trainer.optimizer.zero_grad()
    initial = full(full_masters(trainer.optimizer))
    results = [trainer.train_step() for _ in range(steps)]
    updates = {n: w - initial[n] for n, w in full(full_masters(trainer.optimizer)).items()}
    return Steps(loss, grads, [r.loss for r in results], [r.grad_norm for r in results], updates)


def record_cases(rank, cases) -> list[Steps]:
    """On every rank of one layout (the first config's parallelism), `record_steps` of each (config, bf16
    path) in turn."""
    par = cases[0][0].parallelism
    # 8 ranks share 2 cores here: a collective can wait on a descheduled rank for a while
    ctx = ParallelContext(par.dp, par.tp, par.pp, par.cp, par.ep, collective_timeout_seconds=120)
    out = []
    for config, native in cases:
        with precision_path(native):
            out.append(record_steps(config, ctx))
    ctx.close()
    return out


# The layout-equivalence tests' model: 4 layers, small dp buckets (several per rank), clipping active.
BASE = (
    "model.model_config.num_hidden_layers=4",
    "parallelism.dp_bucket_size_mb=0.02",
    "optimizer.clip_grad=0.5",
)


# Every feature the model families turn on, together: head_dim apart from hidden / heads (4 x 24 = 96 wide
# attention in a 64 wide model), q/k/v biases, per-head q/k norms, a layer without RoPE, Granite's scalings.
FEATURES = (
    "model.model_config.head_dim=24",
    "model.model_config.qkv_bias=true",
    "model.model_config.qk_norm=true",
    "model.model_config.no_rope_layers=[1]",
    "model.model_config.embedding_multiplier=2.0",
    "model.model_config.residual_multiplier=0.7",
    "model.model_config.attention_multiplier=0.2",
    "model.model_config.logits_scaling=1.5",
    "model.model_config.sliding_window=5",
    "model.model_config.full_attention_layers=[0]",
)
# OLMo2's: norms after each block, q/k norms over all the heads together (a weight split with the heads).
OLMO2_FEATURES = (
    "model.model_config.qk_norm=true",
    "model.model_config.qk_norm_span=all_heads",
    "model.model_config.norm_placement=after",
)


def layout_case(make, dtype, native, *overrides, accumulation=2, dp=1):
    """Global batch 8 samples of 32 tokens for every dp."""
    return make(
        *BASE,
        f"model.dtype={dtype}",
        "tokens.micro_batch_size=2",
        f"tokens.batch_accumulation_per_replica={accumulation * 2 // dp}",
        *([SMOOTH_ADAM] if native is not None else []),
        *overrides,
    )


def check_layouts(make, per_layout):
    """`per_layout`: {layout overrides: [(dtype, native, extra overrides)]}; each case against one process."""
    for layout, cases in per_layout.items():
        dp = next((int(o.split("=")[1]) for o in layout if o.startswith("parallelism.dp=")), 1)
        configs = [
            (layout_case(make, dtype, native, *layout, *extra, dp=dp), native)
            for dtype, native, extra in cases
        ]
        world = configs[0][0].parallelism.world_size
        per_rank = run_ranks(record_cases, world, configs, timeout=300)
        for index, ((_, native), (dtype, _, extra)) in enumerate(zip(configs, cases, strict=True)):
            with precision_path(native):
                reference = record_steps(layout_case(make, dtype, native, *extra), ParallelContext())
            exact = None
            if native is not None:
                exact = record_steps(layout_case(make, "float32", native, *extra), ParallelContext())
            got = functools.reduce(Steps.merge, [rank[index] for rank in per_rank])
            assert_steps_match(got, reference, exact, label=f"{layout} {dtype} {native} {extra}")
            assert len({(rank[index].loss, tuple(rank[index].losses)) for rank in per_rank}) == 1


def mask_unevenly(trainer) -> None:
    """From now on the trainer's micro-batches mask the first (7 g) % 23 targets of global sample g, so every
    micro-batch and every dp rank counts a different number of targets in the loss (as documents and padding
    make it); any layout masks the same samples alike."""
    batches = trainer.batches
    step_at, per_rank = batches.step_at, batches.micro_batch_size * batches.batch_accumulation

    def masked(consumed_samples: int) -> list[MicroBatch]:
        micro_batches = step_at(consumed_samples)
        first = consumed_samples + batches.dp_rank * per_rank
        for index, micro_batch in enumerate(micro_batches):
            targets = micro_batch.targets.clone()
            for row in range(targets.shape[0]):
                targets[row, : (7 * (first + index * batches.micro_batch_size + row)) % 23] = IGNORE_INDEX
            micro_batches[index] = MicroBatch(micro_batch.inputs, targets)
        return micro_batches

    batches.step_at = masked


def _distance(a, b) -> float:
    return float((torch.as_tensor(a) - torch.as_tensor(b)).norm())


def _size(a) -> float:
    return float(torch.as_tensor(a).norm())


def assert_close_to_reference(got, reference, exact=None, *, fp32_rel: float = 1e-5, label: str = "") -> None:
    """`got` (a number, list or tensor from a parallel run) equals `reference` (one process).

    fp32 (`exact` None): up to summation order, `fp32_rel` of the reference's size. bf16: `exact` is the same
    single-process computation in fp32, and `reference - exact` is what bf16 rounding does to this very
    computation on this CPU path. A correct layout rounds in other places but by as much, so it lies within
    that distance of the exact result too: |got - reference| <= |got - exact| + |exact - reference|, with
    room for twice the reference's rounding (a layout rounds partial sums separately), plus two roundings of
    the value itself for a reference that happens to be nearly exact. A wrong layout is off by the size of
    the value.
    """
    if exact is None:
        bound = fp32_rel * _size(reference)
    else:
        bound = 3 * _distance(reference, exact) + 2 * BF16_ROUNDOFF * _size(reference)
    assert _distance(got, reference) <= bound, (label, _distance(got, reference), bound)


def assert_steps_match(got: Steps, reference: Steps, exact: Steps | None = None, label: str = "") -> None:
    """A parallel run's `Steps` equal one process's (`exact`: the same single process in fp32 when the runs
    are bf16). fp32 bounds: the loss 1e-5 relative, grad norms and weight changes 1e-4 (Adam's division by
    sqrt(v) amplifies summation-order differences in small gradients), gradients 1e-5."""
    assert got.grads.keys() == reference.grads.keys(), label  # every parameter lives on some stage
    pairs = [
        ("loss", got.loss, reference.loss, exact and exact.loss, 1e-5),
        *[
            (f"loss of step {i + 1}", g, r, exact and exact.losses[i], 1e-5)
            for i, (g, r) in enumerate(zip(got.losses, reference.losses, strict=True))
        ],
        *[
            (f"grad norm of step {i + 1}", g, r, exact and exact.norms[i], 1e-4)
            for i, (g, r) in enumerate(zip(got.norms, reference.norms, strict=True))
        ],
        *[
            (f"gradient of {n}", got.grads[n], r, exact and exact.grads[n], 1e-5)
            for n, r in reference.grads.items()
        ],
        *[
            (f"update of {n}", got.updates[n], r, exact and exact.updates[n], 1e-4)
            for n, r in reference.updates.items()
        ],
    ]
    for what, ours, ref, fp32, rel in pairs:
        assert_close_to_reference(ours, ref, fp32, fp32_rel=rel, label=f"{label}: {what}")


def full_masters(optimizer: ZeroOptimizer) -> list[torch.Tensor]:
    """Per parameter, its whole fp32 master weight (gathered over dp under ZeRO-1)."""
    return optimizer.data_parallel.state.full([m.detach().float() for m in optimizer.masters])


LIBC = ctypes.CDLL(None, use_errno=True)  # this process's own C library, for mount(2)
MS_REMOUNT_READ_ONLY = 32 | 1  # MS_REMOUNT | MS_RDONLY


@contextmanager
def small_disk(mount_point: Path, size: str = "64k") -> Iterator[Path]:
    """A real tmpfs of `size` at `mount_point`, for real ENOSPC (root only: mount(2) needs CAP_SYS_ADMIN;
    otherwise the test is skipped). mount(2) through ctypes: no process started."""
    mount_point.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or LIBC.mount(b"tmpfs", bytes(mount_point), b"tmpfs", 0, f"size={size}".encode()):
        pytest.skip("needs root to mount a small tmpfs")
    try:
        yield mount_point
    finally:
        LIBC.umount2(bytes(mount_point), 2)  # MNT_DETACH


def make_read_only(mount_point: Path) -> None:
    """Remount a `small_disk` read-only: real EROFS."""
    if LIBC.mount(b"tmpfs", bytes(mount_point), b"tmpfs", MS_REMOUNT_READ_ONLY, None) != 0:
        raise OSError(ctypes.get_errno(), f"cannot remount {mount_point} read-only")


def preprocess_command(source: Path, tokenizer: Path, prefix: Path, *options: str) -> list[str]:
    """`femtotron preprocess` as a user types it, for a process of its own."""
    command = [sys.executable, "-m", "femtotron", "preprocess", "--input", str(source)]
    return [*command, "--tokenizer", str(tokenizer), "--output-prefix", str(prefix), *options]


def held_bytes(trainer):
    """Bytes of the storages this rank really holds for parameters, gradients, master weights and Adam
    moments (each storage counted once, however many views point into it)."""

    def total(tensors):
        sizes = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(sizes.values())

    params = [p for _, p in trainer.model.named_parameters()]
    optimizer = trainer.optimizer
    assert all(p.grad is None for p in params)  # no low-precision gradient is left behind
    state = trainer.data_parallel.state
    if state.zero.shards_parameters:  # between steps only the owned shards: every bucket's whole ones freed
        assert all(whole.untyped_storage().nbytes() == 0 for whole in state.bucket_params)
        params = state.param_shards
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    masters = [m for m in optimizer.masters if m.untyped_storage().data_ptr() not in param_storages]
    moments = [s[key] for s in optimizer.adam.state.values() for key in ("exp_avg", "exp_avg_sq")]
    if state.zero.shards_gradients:  # between steps only the owned shards: every bucket's whole ones freed
        assert state.bucket_grads == [None] * len(state.layout.buckets)
        grads = state.shard_grads
    else:
        grads = [state.flat_grads]
    return {
        "params": total(params),
        "grads": total(grads),
        "masters": total(masters),
        "moments": total(moments),
    }
