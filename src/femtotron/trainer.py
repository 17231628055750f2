"""Build everything from a config, then train: batch -> forward/backward -> reduce -> clip -> step -> log.

Read `Trainer.one_step` top to bottom to follow one optimizer step.
"""

from __future__ import annotations

import math
import time

import torch
from tqdm import tqdm

from femtotron.batch import IGNORE_INDEX, MicroBatch
from femtotron.config import Config
from femtotron.dashboards import Dashboards
from femtotron.data.nanoset import MicroBatchIterator
from femtotron.data.run_data import check_batch_token_ids, document_end_id, open_run_data
from femtotron.data.stages import StageStart
from femtotron.diagnostics import failures, start_report
from femtotron.diagnostics.compile_check import compile_report
from femtotron.diagnostics.data_check import first_loss_warning
from femtotron.diagnostics.expert_load import RouterCollapse, step_metrics
from femtotron.diagnostics.loss_spikes import LossSpikes
from femtotron.diagnostics.nan_origin import locate
from femtotron.diagnostics.profiling import StepProfiler
from femtotron.diagnostics.watchdog import Watchdog
from femtotron.errors import DataError, is_out_of_memory
from femtotron.layout import DTYPES, build_pipeline, build_rank_model
from femtotron.models.compile import compile_layers
from femtotron.optim.clip import clip_grads_
from femtotron.optim.loss_scale import DynamicLossScaler
from femtotron.optim.zero import ZeroOptimizer
from femtotron.parallel.context import ParallelContext
from femtotron.parallel.context_parallel import place_tokens
from femtotron.precision import CPU_MULTIPLIES_BF16, emulated_low_precision, tf32_for_fp32
from femtotron.run_log import RunLog, StepLogger, StepResult
from femtotron.serialize.init import init_weights
from femtotron.serialize.manager import CheckpointManager
from femtotron.serialize.weights import write_config
from femtotron.stop_signals import StopSignals
from femtotron.train_state import TrainingParts, TrainState


class Trainer:
    def __init__(self, config: Config, ctx: ParallelContext, log_to_console: bool = True) -> None:
        self.config = config
        self.ctx = ctx
        self.run_dir = config.run_dir
        self.log = RunLog(
            ctx.log_prefix,
            self.run_dir,
            is_main=ctx.rank == 0,
            console=log_to_console,
            level=config.logging.log_level,
        )
        self.log.dashboards = Dashboards(config)  # a missing extra fails here, before any work
        self.profiler = StepProfiler(config, ctx, self.log)
        # Data first: a wrong dataset path must fail before minutes go into building the model.
        self.train_data, self.val_data, self.tokenizer = open_run_data(config)
        self.eos_id = document_end_id(config, self.tokenizer) if config.model.document_masking else None
        # Reads the first data stage until `enter_stage` (before each step) points it at the step's stage.
        self.batches = MicroBatchIterator(
            self.train_data.nanosets[0],
            micro_batch_size=config.tokens.micro_batch_size,
            batch_accumulation=config.tokens.batch_accumulation_per_replica,
            dp_rank=ctx.dp_rank,
            dp_size=ctx.dp,
        )
        self.stage_index: int | None = None  # the data stage `batches` reads: none before the first step
        self.model = build_rank_model(config, ctx)
        if config.model.compile:
            compile_layers(self.model.chunks, ctx.device)
        if config.model.init_from:  # before the optimizer copies the weights into its master weights
            self.log.info(init_weights(self.model, config))
        self.tp = self.model.tp
        self.data_parallel = self.model.data_parallel
        self.pipeline = build_pipeline(config, ctx, self.model)
        dtype = DTYPES[config.model.dtype]
        tf32_for_fp32(ctx.device, dtype)  # before the MFU yardstick: it reads whether fp32 runs as TF32
        # fp16 only (N1): the loss is multiplied by a dynamic scale; bf16 and fp32 get a disabled one.
        self.scaler = DynamicLossScaler(
            **config.optimizer.loss_scale.model_dump(), enabled=dtype == torch.float16
        )
        self.state = TrainState(scaler=self.scaler)
        params = [p for _, p in self.model.named_parameters()]
        self.optimizer = ZeroOptimizer(params, self.data_parallel, config.optimizer, self.tp)
        # Under expert parallelism the ep ranks hold different experts: each piece counts in the grad norm
        # on one of its replicas only.
        layout = self.data_parallel.layout
        once = layout.counted_once() if ctx.ep > 1 else [True] * len(layout.pieces)
        counted = [self.model.counted[piece.param] for piece in layout.pieces]
        self.counted_pieces = [c and o for c, o in zip(counted, once, strict=True)]
        self.norm_groups = ctx.norm_groups(replicas_differ=layout.sharded or ctx.ep > 1)
        # Under sequence parallelism each rank saw only its part of the sequence: the gradients of the
        # weights every tp rank holds whole (the norms) are summed over tp.
        sequence_parallel = self.tp.sequence_parallel and ctx.tp > 1
        self.summed_over_tp = {i for i, r in enumerate(self.model.replicated) if r and sequence_parallel}
        self.parts = TrainingParts(
            config=config,
            ctx=ctx,
            model=self.model,
            optimizer=self.optimizer,
            state=self.state,
            data=self.train_data,
            log=self.log,
            tokenizer=self.tokenizer,
        )
        self.checkpointer = CheckpointManager(self.parts)
        self.spikes = LossSpikes()
        mcfg = config.model.model_config_
        self.router_collapse = RouterCollapse(mcfg) if mcfg.moe else None
        self.upcasts = emulated_low_precision(torch.empty(0, dtype=dtype, device=ctx.device))
        # MFU against the matmul the hardware runs: fp32 on a CPU without bf16 units (precision.py).
        fp32 = ctx.device.type == "cpu" and not CPU_MULTIPLIES_BF16
        self.step_logger = StepLogger.for_run(config, ctx, self.log, torch.float32 if fp32 else dtype)

    def train(self) -> list[StepResult]:
        par = self.config.parallelism
        watchdog = Watchdog(
            self.ctx, par.hang_timeout_seconds, self.whereabouts, start_timeout=par.init_timeout_seconds
        ).start()
        try:
            results = self.train_until_done()
            # Every rank is done before any stops watching: the first to exit may take the store with it.
            self.ctx.comm.barrier(self.ctx.world_group)
        except BaseException:
            watchdog.stop(failed=True)
            self.checkpointer.abandon()
            raise
        finally:
            self.log.close()
        watchdog.stop()
        return results

    def whereabouts(self) -> str:
        """Where this rank is in training, for hang reports (read from the watchdog thread)."""
        action = self.pipeline.current
        step = self.state.step + 1
        return f"step {step}, pipeline {action.describe()} on stage {self.pipeline.stage_of(action.chunk)}"

    def train_until_done(self) -> list[StepResult]:
        train_steps = self.config.tokens.train_steps
        resumed = self.checkpointer.resume()
        self.log.start_at(self.state.step)  # the run starts: metrics.jsonl keeps the steps before it
        self.log.info(start_report.summary(self.parts, self.step_logger.yardstick))
        if resumed is not None:  # after the report, which begins with the run's name
            self.log.info(resumed)
        for warning in start_report.start_warnings(self.parts, self.val_data is not None, self.upcasts):
            self.log.warn(warning)
        if self.ctx.rank == 0:
            write_config(self.run_dir, self.config.to_dict())
        self.checkpointer.save_initial_state()
        results = []
        # disable None: tqdm shows the bar only on a terminal
        style = dict(unit="step", dynamic_ncols=True, leave=False, disable=True if self.ctx.rank else None)
        bar = tqdm(total=train_steps, initial=self.state.step, **style)
        with StopSignals(announce=self.ctx.rank == 0) as signals:
            while self.state.step < train_steps:
                with self.profiler.step(self.state.step + 1):
                    results.append(self.train_step())
                if self.config.model.compile and len(results) == 1:
                    self.log.info(compile_report())
                bar.update(1)
                bar.set_postfix(loss=f"{results[-1].loss:.3f}")
                self.log_step(results[-1])
                self.warn_on_loss(results[-1].loss)
                interval = self.config.tokens.val_check_interval
                if self.val_data is not None and interval and self.state.step % interval == 0:
                    self.validate()
                self.checkpointer.after_step()
                if self.state.step < train_steps and (signum := signals.agreed(self.ctx)):
                    self.checkpointer.on_stop(signum)
        bar.close()
        self.checkpointer.at_end()
        return results

    def log_step(self, result: StepResult) -> None:
        self.step_logger(
            self.state.step,
            result,
            consumed_tokens=self.state.consumed_tokens,
            skipped_steps=self.scaler.skipped_steps if self.scaler.enabled else None,
        )

    def warn_on_loss(self, loss: float) -> None:
        """N3: a first loss far from ln(vocab) (only a freshly initialised model starts there, not one of
        `model.init_from`); N4: spikes against the running median."""
        vocab = self.config.model.model_config_.vocab_size
        fresh = self.state.step == 1 and not self.config.model.init_from
        first = first_loss_warning(loss, vocab) if fresh else None
        spike = self.spikes.observe(self.state.step, loss) if math.isfinite(loss) else None
        for warning in filter(None, [first, spike]):
            self.log.warn(warning)

    def train_step(self) -> StepResult:
        """One optimizer step; an out-of-memory anywhere in it is reported with where and what to change."""
        try:
            return self.one_step()
        except (RuntimeError, MemoryError) as e:
            if not is_out_of_memory(e):
                raise
            action = self.pipeline.current
            plan = self.data_parallel.state.model_state_bytes()
            where = f"the {action.describe()}, pipeline stage {self.pipeline.stage_of(action.chunk)}"
            raise failures.out_of_memory(e, self.config, self.ctx, self.state.step + 1, where, plan) from None

    def one_step(self) -> StepResult:
        start = time.perf_counter()
        state = self.state
        comm = self.ctx.comm
        comm.new_step(state.step + 1)
        loss, tokens, grads = self.compute_gradients()
        moe = self.router_metrics()
        lr = state.lr(self.config)
        # fp16: back to true units before clipping; an overflow (agreed by every rank) with a finite loss
        # skips the step. A non-finite loss is a real divergence and is handled below.
        overflow = self.scaler.unscale_(grads, self.ctx) and math.isfinite(loss)
        clip = self.config.optimizer.clip_grad
        norm = None if overflow else clip_grads_(grads, clip, self.ctx, self.counted_pieces, self.norm_groups)
        grad_norm = math.inf if norm is None else comm.read(norm, "grad norm")
        if overflow:
            self.skip_fp16_step(loss)
        elif not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.skip_non_finite_step(loss, grad_norm)
            grad_norm = math.inf
        else:
            self.optimizer.step(lr)
            self.scaler.update(overflow=False)
            state.recent.append((state.step + 1, lr, grad_norm))
        self.optimizer.zero_grad()
        state.step += 1
        state.consumed_tokens += tokens
        comm.synchronize(self.ctx.device)  # the optimizer and ZeRO's all-gather are part of the step's time
        return StepResult(
            loss=loss,
            grad_norm=grad_norm,
            lr=lr,
            tokens=tokens,
            seconds=time.perf_counter() - start,
            comm_seconds=comm.take_seconds(),
            loss_scale=self.scaler.scale if self.scaler.enabled else None,
            skipped=math.isinf(grad_norm),
            moe=moe,
        )

    def router_metrics(self) -> dict[str, float]:
        """A mixture of experts' step: its loads and router losses over every rank (metrics.jsonl), and a
        warning for a layer whose router collapsed."""
        stats = self.model.router_stats
        if stats is None:
            return {}
        metrics, loads = step_metrics(
            stats,
            self.ctx.comm,
            groups=self.ctx.routing_groups(),
            sp_group=self.ctx.tp_group if self.tp.sequence_parallel else None,
            micro_batches=self.config.tokens.batch_accumulation_per_replica * self.ctx.dp,
        )
        for warning in self.router_collapse.observe(loads):
            self.log.warn(f"step {self.state.step + 1}: {warning}")
        return metrics

    def skip_non_finite_step(self, loss: float, grad_norm: float) -> None:
        """The loss or gradient norm is inf/NaN: find the module it came from, then stop (or, with
        optimizer.on_non_finite=skip, drop the step and go on). The weights are left as they were."""
        self.optimizer.zero_grad()
        origin = locate(self.pipeline, self.last_inputs, self.ctx)
        self.model.finish_reduction()  # the re-run's buckets, dropped with zero_grad after the step
        where = origin.describe() if origin else "no module produced it when the step was run again"
        step = self.state.step + 1
        state = self.state
        if self.config.optimizer.on_non_finite == "stop":
            raise failures.diverged(self.config, step, loss, grad_norm, where, state.recent)
        state.non_finite_skips += 1
        self.log.warn(failures.non_finite_skipped(step, loss, grad_norm, where, state.non_finite_skips))

    def skip_fp16_step(self, loss: float) -> None:
        """fp16 gradients overflowed: drop them, lower the loss scale, leave the weights as they are."""
        step = self.state.step + 1
        scale = self.scaler.scale
        if self.scaler.at_minimum:
            raise failures.fp16_overflow_at_minimum(step, self.scaler, loss)
        self.scaler.update(overflow=True)
        self.log.warn(
            f"step {step}: fp16 gradients overflowed at loss scale {scale:g}; step skipped, scale "
            f"lowered to {self.scaler.scale:g} ({self.scaler.skipped_steps} skipped so far)"
        )

    def enter_stage(self, step: int) -> None:
        """Read step `step`'s data stage: the one already read, or the next (logged as it starts), or after a
        resume the one the checkpoint was in."""
        index = self.train_data.index_at(step)
        if index == self.stage_index:
            return
        stage = self.train_data.stages[index]
        history = self.state.stages
        starts = not history or history[-1].name != stage.name
        if starts:
            history.append(StageStart(name=stage.name, step=step, samples=self.state.consumed_samples))
        nanoset = self.train_data.continued(index, history)
        self.stage_index = index
        self.batches.nanoset = nanoset
        if len(self.train_data.stages) == 1:  # the start report describes the data
            return
        described = self.train_data.describe(index, nanoset)
        if starts:
            self.log.info(f"step {step}: {described}")
        else:
            read = self.state.consumed_samples - history[-1].samples
            self.log.info(f"step {step}: continuing {described}; {read:,} of its samples read before")

    def compute_gradients(self) -> tuple[float, int, list[torch.Tensor]]:
        """Forward and backward over this step's micro-batches; returns loss, tokens and fp32 grads (with fp16
        still multiplied by the loss scale: `one_step` unscales them). Every rank of a dp replica reads the
        same micro-batches: the first pipeline stage needs the inputs, the last the targets, all the count."""
        ctx = self.ctx
        step = self.state.step + 1
        self.enter_stage(step)
        whole = self.batches.step_at(self.state.consumed_samples - self.state.stages[-1].samples)
        self.state.consumed_samples += self.config.global_batch_size
        check_batch_token_ids(whole, self.config.model.model_config_.vocab_size, ctx, step)
        on_host = [place_tokens(mb, ctx.cp, ctx.cp_rank, self.eos_id) for mb in whole]
        # Token-weighted loss: divide by the valid-token count of the whole global batch, so any
        # split into micro-batches, dp and cp ranks gives the same loss and gradients.
        count = torch.tensor(float(sum(mb.counted_targets for mb in on_host)), device=ctx.device)
        micro_batches = [mb.to(ctx.device) for mb in on_host]
        global_tokens = ctx.comm.read(ctx.comm.all_reduce(count, ctx.dp_cp_group), "token count")
        if global_tokens == 0:
            raise DataError(
                f"step {step}: no target token of the whole batch counts in the loss (every position "
                f"is {IGNORE_INDEX}): the loss mask is empty, so there is nothing to learn. Check the "
                "data with `femtotron inspect-data CONFIG`."
            )
        # fp16: dividing by global_tokens / scale multiplies the loss, so every gradient, by the loss scale.
        if self.model.router_stats is not None:  # router losses: a mean over the global batch's micro-batches
            self.model.router_stats.reset(self.scaler.scale / (len(micro_batches) * ctx.dp))
        self.last_inputs = (micro_batches, count / self.scaler.scale)  # to run the step again (NaN origin)
        loss_sum = self.pipeline.train_step(*self.last_inputs)
        grads = self.reduce_gradients()
        # Only the last stage computed the loss: summed over pp, every rank logs the same number (P3).
        ctx.comm.all_reduce(loss_sum, ctx.pp_group)
        loss = ctx.comm.read(ctx.comm.all_reduce(loss_sum, ctx.dp_cp_group), "loss")
        return loss / global_tokens, int(global_tokens), grads

    def reduce_gradients(self) -> list[torch.Tensor]:
        """The fp32 gradients of the elements this rank steps, summed over everything that computed a part:
        over dp and cp (the buckets), then over tp for `summed_over_tp` and over the embedding group for a
        tied embedding (the loss is divided by the global token count already, so sums are right)."""
        self.model.finish_reduction()
        grads = self.optimizer.grads()
        comm = self.ctx.comm
        by_param = [
            (piece.param, g) for piece, g in zip(self.data_parallel.layout.pieces, grads, strict=True)
        ]
        comm.all_reduce_many([g for param, g in by_param if param in self.summed_over_tp], self.ctx.tp_group)
        tied = self.model.tied_embedding
        comm.all_reduce_many([g for param, g in by_param if param == tied], self.ctx.embedding_group)
        return grads

    @torch.no_grad()
    def validate(self) -> float:
        """The loss over the first `limit_val_batches` micro-batches of the validation data, logged."""
        ctx = self.ctx
        batches = MicroBatchIterator(
            self.val_data,
            micro_batch_size=self.config.tokens.micro_batch_size,
            batch_accumulation=self.config.tokens.limit_val_batches,
            dp_rank=ctx.dp_rank,
            dp_size=ctx.dp,
        ).step_at(0)
        on_host = [place_tokens(batch, ctx.cp, ctx.cp_rank, self.eos_id) for batch in batches]
        # Counted on the host, as in training: on the device each count would be a host sync.
        count = torch.tensor(float(sum(mb.counted_targets for mb in on_host)), device=ctx.device)
        micro_batches: list[MicroBatch] = [mb.to(ctx.device) for mb in on_host]
        loss_sum = ctx.comm.all_reduce(self.pipeline.evaluate(micro_batches), ctx.pp_group)
        totals = ctx.comm.all_reduce(torch.stack([loss_sum, count]), ctx.dp_cp_group)
        ctx.comm.take_seconds()  # validation's collectives are not part of any training step
        val_loss = ctx.comm.read(totals[0] / totals[1], "validation loss")
        self.log.record({"step": self.state.step, "val_loss": val_loss})
        self.log.info(f"step {self.state.step} | validation loss {val_loss:.4f}")
        return val_loss
