"""Build everything from a config, then train: batch -> forward/backward -> reduce -> clip -> step -> log.

Read `Trainer.one_step` top to bottom to follow one optimizer step.
"""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file
from tokenizers import Tokenizer
from tqdm import tqdm

from femtotron.atomic import atomic_path
from femtotron.config import Config, config_warnings, parameter_count
from femtotron.config.config import pipeline_bubble
from femtotron.data.indexed import resolve_dataset_prefixes
from femtotron.data.nanoset import MicroBatchIterator, Nanoset
from femtotron.data.tokenizer import load_tokenizer
from femtotron.diagnostics.data_check import check_token_range, first_loss_warning
from femtotron.diagnostics.loss_spikes import LossSpikes
from femtotron.diagnostics.memory import human
from femtotron.diagnostics.nan_origin import NonFinite, earliest_over_ranks, watch
from femtotron.diagnostics.watchdog import Watchdog
from femtotron.errors import ConfigError, DataError, FemtotronError
from femtotron.layout import DTYPES, build_rank_model
from femtotron.metrics import RunLog, memory_gib, model_flops_per_token, peak_flops
from femtotron.models.llama import IGNORE_INDEX
from femtotron.optim.clip import clip_grads_
from femtotron.optim.loss_scale import DynamicLossScaler
from femtotron.optim.lr_schedule import lr_at
from femtotron.optim.zero import ZeroAdamW
from femtotron.parallel.comm import Group
from femtotron.parallel.context import ParallelContext
from femtotron.parallel.pipeline.p2p import PipelineP2P
from femtotron.parallel.pipeline.partition import stage_map
from femtotron.parallel.pipeline.schedules import Pipeline
from femtotron.parallel.tensor_parallel import TensorParallel, full_tensor
from femtotron.precision import emulated_low_precision
from femtotron.serialize import checkpoint

WEIGHTS_FILE = "model.safetensors"
PARTS_FILE = "model-parts.json"  # which safetensors files hold the final weights (one per pp stage)


class TrainingDiverged(FemtotronError):
    exit_code = 5
    same_on_every_rank = True


class OutOfMemory(FemtotronError):
    exit_code = 8


class TrainingInterrupted(FemtotronError):
    """SIGTERM or SIGUSR1 (what schedulers send before preemption): a checkpoint was saved, then the run stopped."""

    exit_code = 7
    same_on_every_rank = True


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    seconds: float
    comm_seconds: dict[str, float]  # group kind ("tp", "dp", ...) -> seconds in its collectives
    loss_scale: float | None = None  # fp16: the scale the next step uses (after this step's update)
    skipped: bool = False  # fp16: the gradients overflowed, so the optimizer step was skipped


def open_nanoset(folders: str | list[str] | dict[str, float], sequence_length: int, seed: int) -> Nanoset:
    """A Nanoset over `data.dataset_folder`: a prefix or directory, a list, or {prefix: weight}."""
    if isinstance(folders, dict):
        prefixes, weights = [], []
        for folder, weight in folders.items():
            found = resolve_dataset_prefixes(folder)
            prefixes += found
            weights += [weight / len(found)] * len(found)  # a directory's pairs share its weight
        return Nanoset(prefixes, weights, sequence_length, seed)
    folders = [folders] if isinstance(folders, str) else folders
    return Nanoset([p for f in folders for p in resolve_dataset_prefixes(f)], None, sequence_length, seed)


def check_supported(config: Config) -> None:
    if torch.cuda.is_available():
        refuse_on_gpus(config)


def refuse_on_gpus(config: Config) -> None:
    """What this version cannot run on GPUs (also checked by `femtotron doctor --device`)."""
    problems = []
    par = config.parallelism
    if par.pp > 1 and par.pp_engine == "interleaved-1f1b":
        # NCCL pairs transfers between two ranks in issue order on one stream; with the batched
        # send/receive pairs of parallel/pipeline/p2p.py the interleaved order deadlocks there from
        # 2 * pp micro-batches on (tests/parallel/pipeline/test_schedules.py models it). Gloo is fine.
        problems.append("parallelism.pp_engine=interleaved-1f1b on GPUs: its transfer order can deadlock on NCCL "
                        "in this version. Use parallelism.pp_engine=1f1b (or afab) on GPUs; interleaving runs on "
                        "CPU (gloo).")
    if problems:
        raise ConfigError("This configuration asks for features this version lacks:\n  - " + "\n  - ".join(problems))


class Trainer:
    def __init__(self, config: Config, ctx: ParallelContext, log_to_console: bool = True) -> None:
        self.config, self.ctx = config, ctx
        check_supported(config)
        tokens = config.tokens
        mcfg = config.model.model_config_
        self.run_dir = config.run_dir
        self.log = RunLog(ctx.log_prefix, self.run_dir, is_main=ctx.rank == 0, console=log_to_console,
                          level=config.logging.log_level)
        # Data first: a wrong dataset path must fail before minutes go into building the model.
        self.train_data = open_nanoset(config.data.dataset_folder, tokens.sequence_length, config.data.seed)
        self.val_data = (open_nanoset(config.data.validation_folder, tokens.sequence_length, config.data.seed)
                         if config.data.validation_folder is not None else None)
        self.tokenizer = self.check_tokenizer()
        check_token_range(self.train_data, mcfg.vocab_size)
        if self.val_data is not None:
            check_token_range(self.val_data, mcfg.vocab_size, key="data.validation_folder")
        self.batches = MicroBatchIterator(self.train_data, tokens.micro_batch_size,
                                          tokens.batch_accumulation_per_replica, ctx.dp_rank, ctx.dp)
        self.dtype = DTYPES[config.model.dtype]
        self.tp = TensorParallel(ctx.comm, ctx.tp_group, ctx.tp_rank,
                                 sequence_parallel=config.parallelism.tp_mode == "REDUCE_SCATTER")
        par = config.parallelism
        model = build_rank_model(config, self.tp, ctx.pp, ctx.pp_rank, ctx.comm, ctx.dp_group, ctx.dp_rank, ctx.device)
        self.rank_model = model
        self.stages, self.chunks, self.data_parallel = model.stages, model.chunks, model.data_parallel
        self.tied_embedding = model.tied_embedding
        params = [p for _, p in model.named_parameters()]
        # fp16 only (N1): the loss is multiplied by a dynamic scale; bf16 and fp32 get a disabled one.
        self.scaler = DynamicLossScaler.from_config(config.optimizer.loss_scale, enabled=self.dtype == torch.float16)
        self.optimizer = ZeroAdamW(list(params), self.data_parallel, config.optimizer)
        # The grad norm sums the pieces this rank owns over the model-parallel group, and under ZeRO-1,
        # where each dp rank owns different pieces, over dp too.
        self.counted_pieces = [model.counted[piece.param] for piece in self.data_parallel.pieces]
        self.norm_groups = [ctx.mp_group] + ([ctx.dp_group] if self.data_parallel.sharded else [])
        # Under sequence parallelism each rank saw only its part of the sequence: the gradients of the
        # weights every tp rank holds whole (the norms) are summed over tp.
        self.summed_over_tp = {i for i, r in enumerate(model.replicated) if r} \
            if self.tp.sequence_parallel and ctx.tp > 1 else set()
        local_sequence = tokens.sequence_length // (ctx.tp if self.tp.sequence_parallel else 1)
        p2p = PipelineP2P(ctx.comm, ctx.pp_group, ctx.pp_rank, ctx.device,
                          (tokens.micro_batch_size, local_sequence, mcfg.hidden_size), self.dtype)
        self.pipeline = Pipeline(self.chunks, par.pp_engine, ctx.pp, ctx.pp_rank, p2p)
        ctx.comm.take_seconds()  # the pipeline's start-up handshake is not part of any step's communication
        self.step = 0
        self.consumed_tokens = 0
        self.last_saved_step: int | None = None
        self.last_checkpoint: Path | None = None
        self.stop_signal: int | None = None
        self.non_finite_skips = 0
        self.spikes = LossSpikes()
        self.flops_per_token = model_flops_per_token(mcfg, tokens.sequence_length)
        largest = max(mcfg.intermediate_size, mcfg.vocab_size)
        # Measure the matmul the model really runs: fp32 where low precision is upcast (models/llama.py).
        self.upcasts = emulated_low_precision(torch.empty(0, dtype=self.dtype, device=ctx.device))
        gemm_dtype = torch.float32 if self.upcasts else self.dtype
        self.peak_flops, self.peak_source = peak_flops(
            ctx.device, gemm_dtype, (tokens.micro_batch_size * tokens.sequence_length, largest, mcfg.hidden_size))
        self.history: deque[tuple[int, float, float]] = deque(maxlen=10)

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters over all its model chunks, by their names in the whole model."""
        return [item for chunk in self.chunks for item in chunk.named_parameters()]

    def summary(self) -> str:
        cfg, mcfg, tokens = self.config, self.config.model.model_config_, self.config.tokens
        total_samples = cfg.global_batch_size * tokens.train_steps
        data = self.train_data
        lines = [
            f"run: {cfg.general.project}/{cfg.general.run}, directory {self.run_dir}",
            f"model: Llama {mcfg.num_hidden_layers} layers, hidden {mcfg.hidden_size}, "
            f"{mcfg.num_attention_heads} heads ({mcfg.num_key_value_heads} kv), vocab {mcfg.vocab_size}: "
            f"{parameter_count(mcfg) / 1e6:.2f}M parameters, {cfg.model.dtype} with fp32 master weights"
            + (f", dynamic loss scale from {self.scaler.scale:g}" if self.scaler.enabled else ""),
            f"layout: dp={self.ctx.dp} tp={self.ctx.tp} pp={self.ctx.pp} on {self.ctx.world_size} "
            f"process(es) on {len(set(self.ctx.hosts))} host(s), device {self.ctx.device}",
            f"batch: {tokens.micro_batch_size} x {tokens.sequence_length} tokens x "
            f"{tokens.batch_accumulation_per_replica} micro-batches x dp {self.ctx.dp} = "
            f"{cfg.tokens_per_step:,} tokens per step, {tokens.train_steps} steps",
            f"data: {data.num_documents:,} documents, {data.num_tokens:,} tokens, "
            f"{data.samples_per_epoch:,} samples per epoch; this run sees {data.epochs_for(total_samples):.2f} epochs",
            f"MFU is measured against {self.peak_flops / 1e12:.2f} TFLOP/s ({self.peak_source})",
        ]
        par = cfg.parallelism
        lines.append(self.memory_summary())
        if self.ctx.tp > 1:
            lines.append(f"tensor parallel: tp={self.ctx.tp}, tp_mode={par.tp_mode}")
        padded = self.chunks[0].padded_vocab_size
        if padded != mcfg.vocab_size:
            lines.append(f"vocabulary padded from {mcfg.vocab_size} to {padded} rows to split "
                         f"evenly over tp={self.ctx.tp}; the padded logits are masked out of the loss")
        if self.ctx.pp > 1:
            accumulation = tokens.batch_accumulation_per_replica
            bubble = pipeline_bubble(self.ctx.pp, accumulation, par.pp_virtual_stages)
            lines.append(f"pipeline parallel: pp={self.ctx.pp}, pp_engine={par.pp_engine}"
                         f"{f' with {par.pp_virtual_stages} virtual stages per rank' if par.pp_virtual_stages > 1 else ''}"
                         f", {accumulation} micro-batches: each stage idles {bubble:.0%} of a step in theory (bubble)")
            lines.append(stage_map(self.stages, self.ctx.pp)[0])
        return "\n".join(lines)

    def memory_summary(self) -> str:
        """Where this rank's bytes for the model state go, and how dp reduces gradients."""
        data_parallel, plan = self.data_parallel, self.optimizer.memory_plan()
        elements = data_parallel.flat_params.numel() - data_parallel.padding
        total = sum(plan.values())
        parts = " + ".join(f"{key.replace('_', ' ')} {value / 2**20:.1f}" for key, value in plan.items())
        sharing = (f"ZeRO-1 shards master weights and Adam moments over dp={self.ctx.dp}"
                   if self.config.optimizer.zero_stage == 1 else "optimizer state on every dp rank (zero_stage 0)")
        own_masters = " (fp32 parameters are their own master weights)" if not plan["master_weights"] else ""
        reduction = (f"gradients reduced over dp in {len(data_parallel.buckets)} bucket(s) during backward"
                     if self.ctx.dp > 1 else "no dp reduction (dp=1)")
        return (f"model state on this rank: {elements / 1e6:.2f}M parameters in {total / 2**20:.1f} MiB = {parts} MiB"
                f"{own_masters}, {total / elements:.1f} bytes per parameter; {sharing}; {reduction}; buffers padded "
                f"by {data_parallel.padding:,} elements")

    def start_warnings(self) -> list[str]:
        warnings = config_warnings(self.config)
        if self.config.tokens.val_check_interval and self.val_data is None:
            warnings.append(f"tokens.val_check_interval={self.config.tokens.val_check_interval} but "
                            "data.validation_folder is not set: no validation will run. Set it, or set "
                            "tokens.val_check_interval=0.")
        warnings += self.tp_host_warnings()
        imbalance = stage_map(self.stages, self.ctx.pp)[1]
        if imbalance and self.ctx.pp > 1:
            warnings.append(imbalance)
        if self.upcasts:
            warnings.append(
                f"model.dtype={self.config.model.dtype} on a CPU without bf16 matrix units (no avx512_bf16 or "
                "amx_bf16): matmuls and attention run in fp32 on upcast copies, since emulated bf16 is far "
                "slower; model.dtype=float32 avoids the casts and is faster still on this CPU.")
        return warnings

    def tp_host_warnings(self) -> list[str]:
        """T3: a tp group must sit on one host; every layer all-reduces activations within it."""
        tp, hosts = self.ctx.tp, self.ctx.hosts
        spanning = [list(range(first, first + tp)) for first in range(0, len(hosts), tp)
                    if len({hosts[r] for r in range(first, first + tp)}) > 1]  # tp groups are consecutive ranks
        if not spanning:
            return []
        ranks = spanning[0]
        return [f"{len(spanning)} tensor-parallel group(s) span several hosts, e.g. ranks {ranks[0]}-{ranks[-1]} on "
                f"{', '.join(sorted({hosts[r] for r in ranks}))}: every layer all-reduces activations over the (slow) "
                "network between them. Set parallelism.tp to at most the number of GPUs per node (and launch the "
                "same number of processes on every node); use dp or pp across nodes."]

    def train(self) -> list[StepResult]:
        watchdog = Watchdog(self.ctx.comm, self.ctx.rank, self.ctx.world_size,
                            self.config.parallelism.hang_timeout_seconds, self.whereabouts).start()
        try:
            results = self.train_until_done()
            # Every rank is done before any stops watching: the first to exit may take the store with it.
            self.ctx.comm.barrier(self.ctx.world_group)
        except BaseException:
            watchdog.stop(failed=True)
            raise
        watchdog.stop()
        return results

    def whereabouts(self) -> str:
        """Where this rank is in training, for hang reports (read from the watchdog thread)."""
        action = self.pipeline.current
        return (f"step {self.step + 1}, pipeline {'forward' if action.kind == 'F' else 'backward'} of micro-batch "
                f"{action.micro_batch} on stage {self.pipeline.stage_of(action.chunk)}")

    def train_until_done(self) -> list[StepResult]:
        ckpt = self.config.checkpoints
        if ckpt.resume_checkpoint_path is not None:
            summary, self.last_checkpoint = checkpoint.load(self, Path(ckpt.resume_checkpoint_path))
            self.log.info(summary)
            self.last_saved_step = self.step  # that state is on disk already
        self.log.info(self.summary())
        for warning in self.start_warnings():
            self.log.warn(warning)
        if self.ctx.rank == 0:
            with atomic_path(self.run_dir / "config.yaml") as tmp:
                Path(tmp).write_text(yaml.safe_dump(self.config.to_dict(), sort_keys=False))
        if ckpt.save_initial_state and self.step == 0:
            self.save_checkpoint()
        results = []
        train_steps = self.config.tokens.train_steps
        bar = tqdm(total=train_steps, initial=self.step, unit="step", disable=None if self.ctx.rank == 0 else True,
                   dynamic_ncols=True, leave=False)
        with self.stop_on_signals():
            while self.step < train_steps:
                result = self.train_step()
                results.append(result)
                self.step += 1
                self.consumed_tokens += result.tokens
                bar.update(1)
                bar.set_postfix(loss=f"{result.loss:.3f}")
                self.log_step(result)
                self.warn_on_loss(result.loss)
                interval = self.config.tokens.val_check_interval
                if self.val_data is not None and interval and self.step % interval == 0:
                    self.log_validation()
                if ckpt.checkpoint_interval and self.step % ckpt.checkpoint_interval == 0:
                    self.save_checkpoint()
                self.stop_if_signalled()
        bar.close()
        if ckpt.checkpoint_interval and self.last_saved_step != self.step:
            self.save_checkpoint()
        if ckpt.save_final_state:
            self.save_weights()
            if self.tokenizer is not None and self.ctx.rank == 0:
                with atomic_path(self.run_dir / "tokenizer.json") as tmp:
                    self.tokenizer.save(tmp)
        return results

    def warn_on_loss(self, loss: float) -> None:
        """N3: a first loss far from ln(vocab); N4: spikes against the running median."""
        warnings = [first_loss_warning(loss, self.config.model.model_config_.vocab_size) if self.step == 1 else None,
                    self.spikes.observe(self.step, loss) if math.isfinite(loss) else None]
        for warning in filter(None, warnings):
            self.log.warn(warning)

    def save_checkpoint(self) -> Path:
        start = time.perf_counter()
        path = checkpoint.save(self)
        self.last_saved_step, self.last_checkpoint = self.step, path
        size = sum(f.stat().st_size for f in path.iterdir()) if self.ctx.rank == 0 else 0
        self.log.info(f"saved checkpoint {path} ({size / 2**20:,.1f} MiB in {time.perf_counter() - start:.1f} s)")
        self.ctx.comm.take_seconds()  # the save's store and barrier time is not part of any training step
        return path

    @contextmanager
    def stop_on_signals(self) -> Iterator[None]:
        """While training, SIGTERM and SIGUSR1 only set a flag; the step in progress finishes first."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def note(signum: int, _frame: object) -> None:
            self.stop_signal = signum

        previous = {sig: signal.signal(sig, note) for sig in (signal.SIGTERM, signal.SIGUSR1)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def stop_if_signalled(self) -> None:
        """After a step: if any rank got SIGTERM/SIGUSR1, all save a checkpoint and stop together (after the
        last step the run ends normally anyway)."""
        if self.step >= self.config.tokens.train_steps:
            return
        flag = torch.tensor(float(self.stop_signal or 0), device=self.ctx.device)
        signum = int(self.ctx.comm.all_reduce(flag, self.ctx.world_group, op="max").item())
        if not signum:
            return
        path = self.save_checkpoint() if self.last_saved_step != self.step else self.last_checkpoint
        raise TrainingInterrupted(
            f"{signal.Signals(signum).name} received: stopped after step {self.step} and saved checkpoint {path}. "
            f"Resume with checkpoints.resume_checkpoint_path={path.parent} (its latest checkpoint).")

    def train_step(self) -> StepResult:
        """One optimizer step; running out of memory anywhere in it is reported with where and what to change."""
        try:
            return self.one_step()
        except torch.OutOfMemoryError as e:
            raise self.out_of_memory(e) from None

    def one_step(self) -> StepResult:
        start = time.perf_counter()
        loss, tokens, grads = self.compute_gradients()
        lr = lr_at(self.step, self.config.optimizer.learning_rate_scheduler, self.config.tokens.train_steps)
        # fp16: back to true units before clipping; an overflow (agreed by every rank) with a finite loss
        # skips the step. A non-finite loss is a real divergence and stops below.
        if self.scaler.unscale_(grads, self.ctx) and math.isfinite(loss):
            return self.skip_step(loss, tokens, lr, start)
        grad_norm = clip_grads_(grads, self.config.optimizer.clip_grad, self.ctx, self.counted_pieces,
                                self.norm_groups).item()
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return self.non_finite_step(loss, grad_norm, tokens, lr, start)
        self.optimizer.step(lr)
        self.optimizer.zero_grad()
        self.scaler.update(overflow=False)
        self.history.append((self.step + 1, lr, grad_norm))
        return StepResult(loss, grad_norm, lr, tokens, time.perf_counter() - start, self.ctx.comm.take_seconds(),
                          loss_scale=self.scaler.scale if self.scaler.enabled else None)

    def non_finite_step(self, loss: float, grad_norm: float, tokens: int, lr: float, start: float) -> StepResult:
        """The loss or gradient norm is inf/NaN: find the module it came from, then stop (or, with
        optimizer.on_non_finite=skip, drop the step and go on). The weights are left as they were."""
        origin = self.locate_non_finite()
        where = origin.describe() if origin else "no module produced it when the step was run again"
        if self.config.optimizer.on_non_finite == "stop":
            raise self.diverged(loss, grad_norm, where)
        self.non_finite_skips += 1
        self.log.warn(f"step {self.step + 1}: loss {loss} / grad norm {grad_norm} is not finite: {where}; step "
                      f"skipped (optimizer.on_non_finite=skip; {self.non_finite_skips} skipped so far)")
        return StepResult(loss, math.inf, lr, tokens, time.perf_counter() - start, self.ctx.comm.take_seconds(),
                          skipped=True)

    def locate_non_finite(self) -> NonFinite | None:
        """Run the step's micro-batches again, from the same weights, with a hook on every module (every rank
        does, as it is a whole pipeline step); the earliest module over all ranks that went non-finite."""
        micro_batches, global_tokens = self.last_inputs
        self.optimizer.zero_grad()

        def where() -> tuple[int, int]:
            action = self.pipeline.current
            return action.micro_batch, self.pipeline.stage_of(action.chunk)

        with watch(self.chunks, where, self.ctx.rank) as found:
            self.pipeline.train_step(micro_batches, global_tokens)
        self.data_parallel.finish_reduction()
        self.optimizer.zero_grad()
        return earliest_over_ranks(self.ctx.comm, self.ctx.rank, self.ctx.world_size, found[0] if found else None,
                                   self.config.parallelism.collective_timeout_seconds)

    def skip_step(self, loss: float, tokens: int, lr: float, start: float) -> StepResult:
        """fp16 gradients overflowed: drop them, lower the loss scale, leave the weights as they are."""
        scale = self.scaler.scale
        if self.scaler.at_minimum:
            raise TrainingDiverged(
                f"step {self.step + 1}: fp16 gradients overflowed at loss scale {scale:g}, "
                f"which is optimizer.loss_scale.min_scale={self.scaler.min_scale:g} ({self.scaler.skipped_steps} "
                f"steps skipped so far): the loss ({loss:.4f}) is finite, but the gradients do not fit fp16 even at "
                "the smallest allowed scale, so training stopped.\nFixes: use model.dtype=bfloat16 (fp32's range), or float32; "
                "lower optimizer.learning_rate_scheduler.learning_rate; keep optimizer.clip_grad at 1.0."
            )
        self.optimizer.zero_grad()
        self.scaler.update(overflow=True)
        self.log.warn(f"step {self.step + 1}: fp16 gradients overflowed at loss scale {scale:g}; step skipped, "
                      f"scale lowered to {self.scaler.scale:g} ({self.scaler.skipped_steps} skipped so far)")
        return StepResult(loss, math.inf, lr, tokens, time.perf_counter() - start, self.ctx.comm.take_seconds(),
                          loss_scale=self.scaler.scale, skipped=True)

    def compute_gradients(self) -> tuple[float, int, list[torch.Tensor]]:
        """Forward and backward over this step's micro-batches; returns loss, tokens and fp32 grads
        (with fp16, still multiplied by the loss scale: `train_step` unscales them).

        Every rank of a dp replica reads the same micro-batches: the first pipeline stage needs the
        inputs, the last the targets, and all of them the token count.
        """
        micro_batches = [mb.to(self.ctx.device, non_blocking=True) for mb in self.batches.next_step()]
        self.check_token_ids(micro_batches)
        # Token-weighted loss: divide by the valid-token count of the whole global batch, so any
        # split into micro-batches and dp ranks gives the same loss and gradients.
        local_tokens = sum(int((mb[:, 1:] != IGNORE_INDEX).sum()) for mb in micro_batches)
        global_tokens = torch.tensor(float(local_tokens), device=self.ctx.device)
        self.ctx.comm.all_reduce(global_tokens, self.ctx.dp_group)
        if global_tokens.item() == 0:
            raise DataError(f"step {self.step + 1}: no target token of the whole batch counts in the loss (every "
                            f"position is {IGNORE_INDEX}): the loss mask is empty, so there is nothing to learn. "
                            "Check the data with `femtotron inspect-data CONFIG`.")
        # fp16: dividing by global_tokens / scale multiplies the loss, so every gradient, by the loss scale.
        self.last_inputs = (micro_batches, global_tokens / self.scaler.scale)  # to run the step again (NaN origin)
        loss_sum = self.pipeline.train_step(*self.last_inputs)
        grads = self.reduce_gradients()
        # Only the last stage computed the loss: summed over pp, every rank logs the same number (P3).
        self.ctx.comm.all_reduce(loss_sum, self.ctx.pp_group)
        loss = self.ctx.comm.all_reduce(loss_sum, self.ctx.dp_group).item() / global_tokens.item()
        return loss, int(global_tokens.item()), grads

    def check_tokenizer(self) -> Tokenizer | None:
        """The tokenizer the run names must fit the model's vocabulary (checked before the model is built)."""
        path = self.config.tokenizer.tokenizer_name_or_path
        if path is None:
            return None
        tokenizer = load_tokenizer(path)
        size = tokenizer.get_vocab_size()
        vocab = self.config.model.model_config_.vocab_size
        if size > vocab:
            raise ConfigError(
                f"tokenizer.tokenizer_name_or_path={path} has {size} tokens but model.model_config.vocab_size="
                f"{vocab}: ids {vocab}..{size - 1} would have no embedding. Set model.model_config.vocab_size "
                f">= {size}, or use the tokenizer the data was preprocessed with."
            )
        return tokenizer

    def check_token_ids(self, micro_batches: list[torch.Tensor]) -> None:
        """An id >= vocab_size would crash the embedding (on GPU as an opaque device assert)."""
        vocab = self.config.model.model_config_.vocab_size
        # Agreed over dp, so every rank stops here together instead of one leaving the others waiting.
        largest_id = torch.tensor(float(max(int(mb.max()) for mb in micro_batches)), device=self.ctx.device)
        largest = int(self.ctx.comm.all_reduce(largest_id, self.ctx.dp_group, op="max").item())
        if largest >= vocab:
            raise DataError(
                f"step {self.step + 1}: the training data holds token id {largest}, but "
                f"model.model_config.vocab_size={vocab} allows ids 0..{vocab - 1}. The data was tokenized "
                f"with a larger vocabulary than the model's: set model.model_config.vocab_size >= {largest + 1} "
                "(a multiple of 64 or 128 is fastest), or re-run `femtotron preprocess` with the tokenizer this "
                "model is meant for."
            )

    def reduce_gradients(self) -> list[torch.Tensor]:
        """The fp32 gradients of the elements this rank steps, summed over everything that computed a part.

        Over dp: the bucket reductions started during backward (the loss is already divided by the global
        token count, so a sum is right). Then, on the pieces this rank owns, which sit at the same places on
        every rank of these groups: under sequence parallelism the tp-replicated parameters over tp (each tp
        rank saw part of the sequence), and a tied embedding over the first and last pipeline stage.
        """
        self.data_parallel.finish_reduction()
        grads = self.optimizer.grads()
        pieces = self.data_parallel.pieces
        if self.summed_over_tp:
            self.all_reduce_flat([g for piece, g in zip(pieces, grads, strict=True)
                                  if piece.param in self.summed_over_tp], self.ctx.tp_group)
        for piece, grad in zip(pieces, grads, strict=True):
            if piece.param == self.tied_embedding:
                self.ctx.comm.all_reduce(grad, self.ctx.embedding_group)
        return grads

    def all_reduce_flat(self, grads: list[torch.Tensor], group: Group) -> None:
        if not grads:
            return
        flat = self.ctx.comm.all_reduce(torch.cat([g.flatten() for g in grads]), group)
        torch._foreach_copy_(grads, [c.view_as(g) for c, g in zip(flat.split([g.numel() for g in grads]), grads,
                                                                   strict=True)])

    def out_of_memory(self, error: Exception) -> OutOfMemory:
        """M1/M2: where it ran out, what the model state takes, the allocator's view, and the knobs."""
        action = self.pipeline.current
        plan = self.optimizer.memory_plan()
        state = ", ".join(f"{key.replace('_', ' ')} {human(value)}" for key, value in plan.items())
        memory = ", ".join(f"{k.removeprefix('mem_').removesuffix('_gib')} {v:.2f} GiB"
                           for k, v in memory_gib(self.ctx.device).items())
        tokens, par = self.config.tokens, self.config.parallelism
        fixes = [f"tokens.micro_batch_size={max(tokens.micro_batch_size // 2, 1)} (activations scale with it; raise "
                 "batch_accumulation_per_replica to keep the batch)" if tokens.micro_batch_size > 1 else
                 f"tokens.sequence_length={tokens.sequence_length // 2} (activations scale with it)"]
        if not par.recompute_layer:
            fixes.append("parallelism.recompute_layer=true (76-90% fewer saved activations, ~25% more compute)")
        if self.config.optimizer.zero_stage == 0 and self.ctx.dp > 1:
            fixes.append(f"optimizer.zero_stage=1 (master weights and Adam moments / dp={self.ctx.dp})")
        fixes.append(f"parallelism.tp={par.tp * 2} or parallelism.pp={par.pp * 2} (fewer parameters per rank)")
        gap = "" if self.ctx.device.type != "cuda" else (
            " A large gap between reserved and allocated is fragmentation: keep general.cuda_expandable_segments "
            "on (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True).")
        return OutOfMemory(
            f"step {self.step + 1}: out of memory on rank {self.ctx.rank} in the {'forward' if action.kind == 'F' else 'backward'} "
            f"of micro-batch {action.micro_batch}, pipeline stage {self.pipeline.stage_of(action.chunk)} "
            f"({str(error).splitlines()[0][:200]}).\nThis rank's model state: {state}; memory now: {memory}.{gap}\n"
            "Fixes, in the usual order: " + "; ".join(fixes) + ".")

    def diverged(self, loss: float, grad_norm: float, where: str) -> TrainingDiverged:
        recent = ", ".join(f"step {s}: lr {lr:.2e} grad_norm {g:.3g}" for s, lr, g in self.history) or "none"
        return TrainingDiverged(
            f"step {self.step + 1}: loss {loss} / grad norm {grad_norm} is not finite; the optimizer step was "
            f"skipped and training stopped.\nWhere: {where}.\nRecent steps: {recent}\n"
            "Fixes: lower optimizer.learning_rate_scheduler.learning_rate (e.g. by 3x), keep "
            "optimizer.clip_grad at 1.0, keep model.dtype=bfloat16, model.init_method.std=0.02; if it starts at "
            "the embedding or the first layer, look at the data (`femtotron inspect-data CONFIG`). "
            "optimizer.on_non_finite=skip drops such steps instead of stopping."
        )

    def log_step(self, result: StepResult) -> None:
        # The first step too: its loss should be near ln(vocab_size), a quick check the data is sane.
        edge = self.step in (1, self.config.tokens.train_steps)
        if self.step % self.config.logging.iteration_step_info_interval and not edge:
            return
        tokens_per_sec = result.tokens / result.seconds
        achieved = tokens_per_sec * self.flops_per_token / self.ctx.world_size
        record = {
            "step": self.step, "loss": result.loss, "lr": result.lr,
            "grad_norm": result.grad_norm if math.isfinite(result.grad_norm) else None,  # None: a skipped step
            "tokens_per_sec": tokens_per_sec, "tokens_per_sec_per_device": tokens_per_sec / self.ctx.world_size,
            "model_tflops_per_device": achieved / 1e12, "mfu": achieved / self.peak_flops,
            "step_seconds": result.seconds, **memory_gib(self.ctx.device),
            **{f"{kind}_comm_share": seconds / result.seconds for kind, seconds in result.comm_seconds.items()},
        }
        if self.scaler.enabled:
            record.update(loss_scale=result.loss_scale, skipped_steps=self.scaler.skipped_steps)
        self.log.record(record)
        memory = " ".join(f"{k.removeprefix('mem_').removesuffix('_gib')} {v:.2f}GiB" for k, v in record.items()
                          if k.startswith("mem_"))
        comm = "".join(f" | {k.removesuffix('_comm_share')} comm {v:.0%}" for k, v in record.items()
                       if k.endswith("_comm_share") and k[:2] in ("tp", "dp", "pp"))
        self.log.info(f"step {self.step}/{self.config.tokens.train_steps} | loss {result.loss:.4f} | "
                      f"lr {result.lr:.3e} | grad_norm {result.grad_norm:.3f} | {tokens_per_sec:,.0f} tok/s | "
                      f"{achieved / 1e12:.2f} TFLOP/s | MFU {record['mfu']:.1%} | mem {memory}{comm}"
                      + (f" | loss scale {result.loss_scale:g}" if self.scaler.enabled else "")
                      + (" | step skipped (fp16 overflow)" if result.skipped else ""))

    @torch.no_grad()
    def evaluate(self) -> float:
        tokens = self.config.tokens
        batches = MicroBatchIterator(self.val_data, tokens.micro_batch_size, tokens.limit_val_batches,
                                     self.ctx.dp_rank, self.ctx.dp)
        micro_batches = [batch.to(self.ctx.device) for batch in batches.next_step()]
        loss_sum = self.ctx.comm.all_reduce(self.pipeline.evaluate(micro_batches), self.ctx.pp_group)
        count = sum((batch[:, 1:] != IGNORE_INDEX).sum() for batch in micro_batches).float()
        totals = self.ctx.comm.all_reduce(torch.stack([loss_sum, count]), self.ctx.dp_group)
        return (totals[0] / totals[1]).item()

    def log_validation(self) -> None:
        val_loss = self.evaluate()
        self.log.record({"step": self.step, "val_loss": val_loss})
        self.log.info(f"step {self.step} | validation loss {val_loss:.4f}")
        self.ctx.comm.take_seconds()  # validation's collectives are not part of any training step

    def save_weights(self) -> Path:
        """Full-shape weights as safetensors, gathered over tp. With pp > 1 each stage writes its own
        part (no stage holds all the weights) and rank 0 lists them in model-parts.json."""
        ctx = self.ctx
        weights = {n: full_tensor(p, p.shard, self.tp).cpu().contiguous() for n, p in self.named_parameters()}
        parts = [WEIGHTS_FILE] if ctx.pp == 1 else [f"model-pp{p:02d}-of-{ctx.pp:02d}.safetensors" for p in range(ctx.pp)]
        if ctx.dp_rank == 0 and ctx.tp_rank == 0:
            with atomic_path(self.run_dir / parts[ctx.pp_rank if ctx.pp > 1 else 0]) as tmp:
                save_file(weights, tmp)
        ctx.comm.barrier(ctx.mp_group)  # rank 0's model-parallel group holds every writer
        if ctx.rank == 0:
            with atomic_path(self.run_dir / PARTS_FILE) as tmp:
                Path(tmp).write_text(json.dumps({"parts": parts}))
            self.log.info(f"saved weights to {self.run_dir / parts[0]}" + (f" and {len(parts) - 1} more parts"
                                                                           if len(parts) > 1 else ""))
        return self.run_dir / parts[0]
