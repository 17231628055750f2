"""`femtotron check-tp`: does the tensor-parallel model compute what one device computes? (T1)

One micro-batch of the run's training data goes through two models built from the same seed: the
whole model (tp=1; every rank builds and runs its own copy, without communication) and this rank's
tensor-parallel part. Hooks record, for every module that declares how its output is laid out over
tp (`output_split_dim`), its input, its output and the gradients of both. After forward and backward
everything is gathered to full shape and compared with the reference, and the first place where the
two part ways is named, in the order the computation happens:

1. forward: the first module, in the order outputs are produced (a layer before the block holding
   it), whose output differs. If its input differed already, the code between the previous module
   and it is the suspect, else the module itself.
2. backward, when every output matched: the first module, in the order backward reaches them, that
   receives a different output gradient (the backward of whatever consumes its output is wrong) or
   hands back a different input gradient (its own backward is wrong: typically a missing all-reduce).
3. parameter gradients, when every activation gradient matched.

Exit code of the command: 0 when tp=N matches tp=1 within the tolerance, 1 (`DIVERGES_EXIT_CODE`)
when something diverges; a config, data or launch problem exits with its own code (2, 3, 4).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from femtotron.config import Config, load_config
from femtotron.config.rules import rule_problems, with_changes
from femtotron.data.nanoset import MicroBatchIterator
from femtotron.data.stages import open_source
from femtotron.data.text_cache import tokenize_text_data, tokenized_by_rank_0
from femtotron.errors import ConfigError, DataError, FemtotronError
from femtotron.launch import check_local_devices, launch_local, launched_by_torchrun
from femtotron.layout import tensor_parallel
from femtotron.models.llama import Llama
from femtotron.parallel.context import ParallelContext
from femtotron.parallel.sharding import split_dim
from femtotron.parallel.tensor_parallel import TensorParallel, full_tensor, gather_full

# Relative to the largest reference value. fp32 differs only by summation order (about 1e-6); bf16
# keeps 8 significant bits and tp moves where the roundings happen.
DEFAULT_TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}
DIVERGES_EXIT_CODE = 1  # like diff: 0 same, 1 different, 2 and up could not compare


def full_gradients(model: nn.Module, tp: TensorParallel) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient as one device would hold it, by name (None where there is none).

    Under sequence parallelism each rank saw only its part of the sequence, so the gradients of the
    weights every rank holds whole (the norms) are summed over tp first, as the trainer does.
    """
    grads: dict[str, torch.Tensor | None] = {}
    for name, p in model.named_parameters():
        grad = p.grad
        if grad is not None and tp.sequence_parallel and split_dim(p.shard) is None:
            grad = tp.comm.all_reduce(grad.clone(), tp.group)
        grads[name] = None if grad is None else full_tensor(grad, p.shard, tp)
    return grads


@dataclass(kw_only=True)
class ModuleDiff:
    """One module's differences from tp=1, each relative to the reference's largest magnitude.

    None: nothing to compare (no float input, no parameters of its own, no gradient in either model).
    """

    name: str
    kind: str  # the tensor-parallel module's class, e.g. RowParallelLinear
    output_abs: float
    output_rel: float
    input_rel: float | None = None
    grad_output_rel: float | None = None
    grad_input_rel: float | None = None
    weight_grad_rel: float | None = None

    def worst(self) -> float:
        values = (
            self.output_rel,
            self.input_rel,
            self.grad_output_rel,
            self.grad_input_rel,
            self.weight_grad_rel,
        )
        return max(v for v in values if v is not None)


@dataclass(frozen=True, kw_only=True)
class Divergence:
    module: str
    kind: str
    where: str  # "output", "input", "output gradient", "input gradient" or "weight gradient"
    relative: float
    explanation: str  # what differs and what that usually means


@dataclass(kw_only=True)
class TPReport:
    tp: int
    tp_mode: str
    dtype: str
    tolerance: float
    batch_shape: tuple[int, ...]
    reference_loss: float
    loss: float
    rows: list[ModuleDiff]  # in forward order; the loss last
    first: Divergence | None

    @property
    def ok(self) -> bool:
        return self.first is None


class _Recorder:
    """Every tp-aware module's first input, output and their gradients, in the order they happen."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = {name: m for name, m in model.named_modules() if hasattr(m, "output_split_dim")}
        self.forward_order: list[str] = []
        self.backward_order: list[str] = []
        self.inputs: dict[str, torch.Tensor | None] = {}
        self.outputs: dict[str, torch.Tensor] = {}
        self.grad_inputs: dict[str, torch.Tensor | None] = {}
        self.grad_outputs: dict[str, torch.Tensor | None] = {}
        self.running: list[str] = []  # modules whose forward has started and not finished, innermost last
        self.handles = []
        for name, module in self.modules.items():
            self.handles.append(module.register_forward_pre_hook(partial(self._start, name)))
            self.handles.append(module.register_forward_hook(partial(self._forward, name)))
            self.handles.append(module.register_full_backward_hook(partial(self._backward, name)))

    def _start(self, name: str, module: nn.Module, args: tuple) -> None:
        self.running.append(name)

    def _forward(self, name: str, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        self.running.pop()
        self.forward_order.append(name)
        first = args[0] if args else None
        floating = first is not None and first.is_floating_point()
        self.inputs[name] = _copy(first) if floating else None  # token ids: nothing to compare
        self.outputs[name] = _copy(output)

    def _backward(self, name: str, module: nn.Module, grad_input: tuple, grad_output: tuple) -> None:
        self.backward_order.append(name)
        self.grad_outputs[name] = _copy(grad_output[0])
        self.grad_inputs[name] = _copy(grad_input[0]) if grad_input else None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@dataclass(frozen=True)
class _Difference:
    absolute: float  # max |ours - ref|
    relative: float  # that over max |ref|


def _copy(tensor: torch.Tensor | None) -> torch.Tensor | None:
    # A copy: later in-place ops (the row-parallel all-reduce sums in place) must not change what we saw.
    return None if tensor is None else tensor.detach().clone()


@dataclass
class _Run:
    recorder: _Recorder
    loss: torch.Tensor
    param_grads: dict[str, torch.Tensor | None]  # full shape, in named_parameters order


class TPCheckFailed(FemtotronError):
    """The tensor-parallel model did not even run: the first module with a wrong local shape is named."""

    exit_code = DIVERGES_EXIT_CODE  # the strongest form of diverging


def _forward_backward(
    model: Llama, ids: torch.Tensor, targets: torch.Tensor, reference: _Run | None = None
) -> _Run:
    """Loss, recorded activations and full-shape parameter gradients; `reference` explains a crash."""
    tp = model.tp
    recorder = _Recorder(model)
    model.zero_grad(set_to_none=True)
    try:
        loss_sum, count = model(ids, targets)
        loss = loss_sum / count
        with warnings.catch_warnings():
            # The embedding's input is token ids: its hook sees only the output gradient, as intended.
            warnings.filterwarnings(
                "ignore",
                "Full backward hook is firing when gradients are computed with respect to module outputs",
            )
            loss.backward()
    except RuntimeError as e:
        if reference is None:
            raise
        raise TPCheckFailed(_crash_message(e, recorder, reference.recorder, tp)) from e
    finally:
        recorder.remove()
    return _Run(recorder=recorder, loss=loss.detach(), param_grads=full_gradients(model, tp))


def _gather(
    tensor: torch.Tensor | None,
    dim: int | None,
    like: torch.Tensor | None,
    tp: TensorParallel,
    parts: int = 1,
) -> torch.Tensor | None:
    """This rank's piece, split along `dim`, gathered to full shape; the padded vocabulary is cut to `like`'s.

    Every rank calls this in the same order with the same shapes, so the gathers pair up.
    """
    if tensor is None:
        return None
    full = gather_full(tensor, dim, tp, parts)
    if dim is None or like is None or full.dim() != like.dim():
        return full
    if full.shape[dim] <= like.shape[dim]:  # nothing padded
        return full
    return full.narrow(dim, 0, like.shape[dim])


def _inferred_split(local: torch.Tensor | None, like: torch.Tensor | None) -> int | None:
    """The dimension a module input is split along: inputs declare no layout, so read it off the shapes."""
    if local is None or like is None or local.dim() != like.dim():
        return None
    dims = [d for d in range(like.dim()) if local.shape[d] != like.shape[d]]
    return dims[0] if len(dims) == 1 else None


def _difference(ours: torch.Tensor | None, ref: torch.Tensor | None) -> _Difference:
    """Max |ours - ref| and that over max |ref|; inf if one side is missing, shapes differ or NaN appears."""
    if ours is None and ref is None:
        return _Difference(absolute=0.0, relative=0.0)
    if ours is None or ref is None or ours.shape != ref.shape:
        return _Difference(absolute=math.inf, relative=math.inf)
    if ref.numel() == 0:
        return _Difference(absolute=0.0, relative=0.0)
    ours = ours.float()
    ref = ref.float()
    delta = (ours - ref).abs().max().item()
    if math.isnan(delta):  # NaN compares false with any tolerance: count it as the worst difference
        delta = math.inf
    scale = ref.abs().max().item()
    if scale > 0:
        relative = delta / scale
    else:  # an all-zero reference: any difference at all is infinitely large
        relative = 0.0 if delta == 0 else math.inf
    return _Difference(absolute=delta, relative=relative)


def _dtype(config: Config) -> torch.dtype:
    if config.model.dtype not in DEFAULT_TOLERANCE:
        raise ConfigError(
            f"model.dtype={config.model.dtype}: check-tp compares float32 or bfloat16 models; "
            "set model.dtype=bfloat16 (or float32 for the tightest comparison)."
        )
    return torch.float32 if config.model.dtype == "float32" else torch.bfloat16


def _first_micro_batch(config: Config, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The run's first training micro-batch (dp rank 0's), read as the trainer reads it."""
    tokens = config.tokens
    first = config.data.stage_list()[0]
    data = open_source(first, config, first.seed)
    batches = MicroBatchIterator(
        data, micro_batch_size=tokens.micro_batch_size, batch_accumulation=1, dp_rank=0, dp_size=1
    )
    batch = batches.step_at(0)[0]
    vocab = config.model.model_config_.vocab_size
    largest = int(batch.inputs.max())
    if largest >= vocab:
        raise DataError(
            f"the training data holds token id {largest}, but model.model_config.vocab_size={vocab} allows "
            f"ids 0..{vocab - 1}. Set model.model_config.vocab_size >= {largest + 1}, or point "
            "data.dataset_folder at data made with this model's tokenizer."
        )
    batch = batch.to(device)
    return batch.inputs, batch.targets


def compare_tp(
    config: Config, ctx: ParallelContext, model: Llama | None = None, tolerance: float | None = None
) -> TPReport:
    """Run one micro-batch at tp=1 and at ctx.tp from the same weights; every tp rank calls this.

    `model`: the tensor-parallel model to check (default: built from the config like the trainer's).
    Every rank returns the same report.
    """
    dtype = _dtype(config)
    tolerance = DEFAULT_TOLERANCE[config.model.dtype] if tolerance is None else tolerance
    mcfg = config.model.model_config_
    ids, targets = _first_micro_batch(config, ctx.device)
    build = partial(
        Llama,
        mcfg,
        std=config.model.init_method.std,
        seed=config.general.seed,
        dtype=dtype,
        device=ctx.device,
    )
    if model is None:
        model = build(tp=tensor_parallel(config, ctx.comm, ctx.tp_group, ctx.tp_rank))
    tp = model.tp
    ref = _forward_backward(build(), ids, targets)
    ours = _forward_backward(model, ids, targets, reference=ref)
    mine = ours.recorder
    theirs = ref.recorder

    # Every rank walks the same names in the same order, so the gathers inside pair up.
    rows = {name: _module_diff(name, mine, theirs, tp) for name in mine.forward_order}
    param_rel = {}
    for pname, grad in ours.param_grads.items():
        param_rel[pname] = _difference(grad, ref.param_grads.get(pname)).relative
        owner = rows.get(pname.rpartition(".")[0])
        if owner is not None:
            owner.weight_grad_rel = max(owner.weight_grad_rel or 0.0, param_rel[pname])
    loss_diff = _difference(ours.loss, ref.loss)
    rows["loss"] = ModuleDiff(
        name="loss", kind="loss", output_abs=loss_diff.absolute, output_rel=loss_diff.relative
    )

    mode = "REDUCE_SCATTER" if tp.sequence_parallel else "ALL_REDUCE"
    rounding = DEFAULT_TOLERANCE[config.model.dtype]
    first = _first_divergence(
        list(rows.values()), mine, param_rel, tol=tolerance, rounding=rounding, mode=mode
    )
    return TPReport(
        tp=tp.size,
        tp_mode=mode,
        dtype=config.model.dtype,
        tolerance=tolerance,
        batch_shape=tuple(ids.shape),
        reference_loss=ref.loss.item(),
        loss=ours.loss.item(),
        rows=list(rows.values()),
        first=first,
    )


def _module_diff(name: str, mine: _Recorder, theirs: _Recorder, tp: TensorParallel) -> ModuleDiff:
    """One module's output, input and gradient differences; outputs are gathered along output_split_dim."""
    module = mine.modules[name]
    dim = module.output_split_dim
    parts = getattr(module, "output_parts", 1)
    ref_out = theirs.outputs.get(name)
    tp_out = _gather(mine.outputs[name], dim, ref_out, tp, parts)
    output = _difference(tp_out, ref_out)
    row = ModuleDiff(
        name=name, kind=type(module).__name__, output_abs=output.absolute, output_rel=output.relative
    )
    ref_in = theirs.inputs.get(name)
    tp_in = mine.inputs[name]
    if ref_in is not None or tp_in is not None:
        tp_in = _gather(tp_in, _inferred_split(tp_in, ref_in), ref_in, tp)
        row.input_rel = _difference(tp_in, ref_in).relative
    if name not in mine.grad_outputs and name not in theirs.grad_outputs:
        return row  # no gradient reached it in either model
    ref_grad_out = theirs.grad_outputs.get(name)
    tp_grad_out = _gather(mine.grad_outputs.get(name), dim, ref_grad_out, tp, parts)
    row.grad_output_rel = _difference(tp_grad_out, ref_grad_out).relative
    ref_grad_in = theirs.grad_inputs.get(name)
    tp_grad_in = mine.grad_inputs.get(name)
    if ref_grad_in is not None or tp_grad_in is not None:
        tp_grad_in = _gather(tp_grad_in, _inferred_split(tp_grad_in, ref_grad_in), ref_grad_in, tp)
        row.grad_input_rel = _difference(tp_grad_in, ref_grad_in).relative
    return row


def _first_divergence(
    rows: list[ModuleDiff],
    recorder: _Recorder,
    param_rel: dict[str, float],
    tol: float,
    rounding: float,
    mode: str,
) -> Divergence | None:
    by_name = {row.name: row for row in rows}

    def found(name: str, where: str, rel: float, parameter: str | None = None) -> Divergence:
        kind = by_name[name].kind if name in by_name else "parameter"
        explanation = _explain(
            name, kind, where, rel=rel, tol=tol, recorder=recorder, mode=mode, parameter=parameter
        )
        if rel <= rounding:  # a tolerance tighter than the dtype's rounding flags summation order
            explanation += (
                f"\nA difference of {rel:.1e} is within this dtype's usual rounding "
                f"({rounding:.0e}): tp sums in a different order, so this alone is not a bug; "
                "the default --tolerance allows for it."
            )
        return Divergence(module=name, kind=kind, where=where, relative=rel, explanation=explanation)

    for row in rows:
        if row.output_rel > tol:
            input_differs = row.input_rel is not None and row.input_rel > tol
            where = "input" if input_differs else "output"
            return found(row.name, where, row.output_rel)
    for name in recorder.backward_order:
        row = by_name[name]
        if row.grad_output_rel is not None and row.grad_output_rel > tol:
            return found(name, "output gradient", row.grad_output_rel)
        if row.grad_input_rel is not None and row.grad_input_rel > tol:
            return found(name, "input gradient", row.grad_input_rel)
    for pname in reversed(list(param_rel)):  # roughly the order backward produces them
        if param_rel[pname] > tol:
            return found(pname.rpartition(".")[0], "weight gradient", param_rel[pname], pname)
    return None


# What a difference first seen at a module of this kind usually means.
_OUTPUT_ADVICE = {
    "ColumnParallelLinear": "this rank's weight rows are not the rows the reference computes with (a "
    "wrong shard of a fused qkv / gate-up weight), or under REDUCE_SCATTER the "
    "all-gather of the sequence before the layer",
    "RowParallelLinear": "the partial sums are not combined over tp: the all-reduce (ALL_REDUCE) or "
    "reduce-scatter (REDUCE_SCATTER) after the layer is missing, or its weight columns "
    "do not line up with the preceding column-parallel layer's rows",
    "VocabParallelEmbedding": "this rank's vocabulary range or out-of-range mask, or the all-reduce "
    "(ALL_REDUCE) / reduce-scatter (REDUCE_SCATTER) of the partial lookups",
    "RMSNorm": "a replicated layer: its weight must be identical on every tp rank, and under REDUCE_SCATTER "
    "it normalises this rank's sequence shard",
    "HeadNorm": "the q/k norm of this rank's heads: its weight must be identical on every tp rank, and the "
    "heads it normalises those of this rank's rows of qkv_proj",
    "HeadsNorm": "the q/k norm over all heads (OLMo2): this rank's slice of its weight must be that of its "
    "own heads, and each rank's sum of squares must be summed over tp (forward and backward)",
    "loss": "the vocab-parallel cross-entropy: its max / sum-of-exponentials / target-logit all-reduces over "
    "tp, or the padded vocabulary columns not masked out",
}
_BETWEEN_ADVICE = {
    "Attention": "the attention core between qkv_proj and o_proj: how each rank's rows of the fused qkv are "
    "viewed as query/key/value heads (every rank must hold whole GQA groups: "
    "num_attention_heads and num_key_value_heads divisible by tp, T2), or the rotary embedding",
    "MLP": "the gate/up split between gate_up_proj and down_proj (each rank's gate_up_proj output is [its "
    "gate features | its up features], matching the columns of down_proj it holds)",
}
_INPUT_GRADIENT_ADVICE = {
    "ColumnParallelLinear": "the gradient of its input is not summed over tp in backward: the all-reduce of "
    "copy_to_tp (ALL_REDUCE) or the reduce-scatter that undoes the sequence "
    "all-gather (REDUCE_SCATTER) is missing before this layer",
    "RowParallelLinear": "the backward of the reduction after it: identity under ALL_REDUCE (another "
    "all-reduce there counts the gradient tp times), an all-gather of the sequence under REDUCE_SCATTER",
}


def _local_shape(full: torch.Size, dim: int | None, tp: int) -> tuple[int, ...]:
    """What one rank holds of a tensor of shape `full` split along `dim` (rounded up, like the vocabulary)."""
    shape = list(full)
    if dim is not None:
        shape[dim] = -(-shape[dim] // tp)
    return tuple(shape)


def _crash_message(error: RuntimeError, mine: _Recorder, theirs: _Recorder, tp: TensorParallel) -> str:
    """Where the tp model failed, and the first module whose output breaks the layout it declares."""
    mode = "REDUCE_SCATTER" if tp.sequence_parallel else "ALL_REDUCE"
    if mine.running:
        stage = f"in forward, inside {mine.running[-1]}"
    elif mine.backward_order:
        stage = f"in backward, after the backward of {mine.backward_order[-1]}"
    else:
        stage = "after its last module's forward (in the loss or the start of backward)"
    message = f"the tp={tp.size} model (tp_mode={mode}) failed {stage}: {error}"
    for name in mine.forward_order:
        module = mine.modules[name]
        ref_out = theirs.outputs.get(name)
        if ref_out is None:
            continue
        expected = _local_shape(ref_out.shape, module.output_split_dim, tp.size)
        got = tuple(mine.outputs[name].shape)
        if got != expected:
            kind = type(module).__name__
            usual = _OUTPUT_ADVICE.get(kind, f"the code of {name} after its last submodule")
            return (
                f"{message}\nFirst wrong shape: {name} ({kind}) returned {got}, but with "
                f"output_split_dim={module.output_split_dim} at tp={tp.size} it must return {expected} "
                f"(tp=1: {tuple(ref_out.shape)}).\nUsually: {usual}."
            )
    return f"{message}\nEvery module that finished returned the shape its output_split_dim promises."


def _parent(name: str, recorder: _Recorder) -> tuple[str, str]:
    """The innermost recorded module holding `name`, and its class; the model itself when none does."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in recorder.modules:
            return candidate, type(recorder.modules[candidate]).__name__
    return "the model", "Llama"


def _explain(
    name: str,
    kind: str,
    where: str,
    rel: float,
    tol: float,
    recorder: _Recorder,
    mode: str,
    parameter: str | None,
) -> str:
    size = f"{rel:.1e} relative (tolerance {tol:.0e})"
    parent, parent_kind = _parent(name, recorder)
    if where == "output":
        what = f"its output differs from tp=1 by {size}, while its input and every module before it matched"
        usual = _OUTPUT_ADVICE.get(kind, f"the code of {name} after its last submodule")
    elif where == "input":
        what = (
            f"its output differs by {size}, and so does its input, although every module before it "
            f"matched: the code in {parent} that computes this input is wrong"
        )
        usual = _BETWEEN_ADVICE.get(
            parent_kind,
            f"the code of {parent} before {name} (a residual add, or a "
            "sequence layout that does not match the tp_mode)",
        )
    elif where == "output gradient":
        what = (
            f"every output matched, but the gradient arriving at its output differs by {size} while "
            "every module after it matched: the backward of the code that consumes its output is wrong"
        )
        if parent == "the model":
            usual = (
                "the model's own code after it (Llama.head_logits / run_stage): the tied output head, or the "
                "backward of the vocab-parallel cross-entropy"
            )
        else:
            usual = f"the code of {parent} after {name}"
    elif where == "input gradient":
        what = (
            f"every output matched and the gradient arriving at its output too, but the gradient it "
            f"hands back for its input differs by {size}: its own backward is wrong"
        )
        usual = _INPUT_GRADIENT_ADVICE.get(
            kind, "a collective in its backward that does not mirror its forward"
        )
    else:
        what = (
            f"every output and activation gradient matched, but the gradient of {parameter} differs by {size}"
        )
        usual = (
            "its backward's weight gradient, or a hook or scaling applied to this parameter's gradient; "
            "for a replicated weight under REDUCE_SCATTER the sum over tp"
        )
    other = "REDUCE_SCATTER" if mode == "ALL_REDUCE" else "ALL_REDUCE"
    return (
        f"{what}.\nUsually: {usual}.\nThis ran with parallelism.tp_mode={mode} (the two modes lay "
        f"activations out differently); add parallelism.tp_mode={other} to see whether the other mode is "
        "affected too."
    )


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def format_report(report: TPReport) -> str:
    """A table of per-module differences and a verdict naming the first divergence and its usual cause."""
    batch, sequence = report.batch_shape
    header = (
        f"check-tp: tp={report.tp} (tp_mode={report.tp_mode}) against tp=1, {report.dtype}, one "
        f"micro-batch of {batch} x {sequence} tokens\ndifferences are max |tp - ref| (abs) and that over "
        f"max |ref| (rel); tolerance {report.tolerance:.0e} rel"
    )
    columns = ("output abs", "output rel", "grad out rel", "grad in rel", "weight grad rel")
    width = max(len(row.name) for row in report.rows)

    def line(name: str, cells: Sequence[str], status: str) -> str:
        aligned = [cell.rjust(len(heading)) for cell, heading in zip(cells, columns, strict=True)]
        return "  ".join([name.ljust(width), *aligned, status])

    lines = [header, "", line("module", columns, "status")]
    for row in report.rows:
        values = (
            row.output_abs,
            row.output_rel,
            row.grad_output_rel,
            row.grad_input_rel,
            row.weight_grad_rel,
        )
        if row.output_rel > report.tolerance:
            status = "DIVERGES (output)"
        else:  # before the first divergence too: a wrong forward later sends wrong gradients back
            status = "ok" if row.worst() <= report.tolerance else "DIVERGES (gradient)"
        if report.first is not None and row.name == report.first.module:
            status += "  <- first"
        lines.append(line(row.name, [_number(v) for v in values], status))
    lines.append("")
    lines.append(f"loss: tp=1 {report.reference_loss:.6f}, tp={report.tp} {report.loss:.6f}")
    first = report.first
    if first is None:
        lines.append(
            f"tp={report.tp} matches tp=1 within tolerance {report.tolerance:.0e} "
            f"(tp_mode={report.tp_mode}, {report.dtype})."
        )
    else:
        lines.append(f"FIRST DIVERGENCE: {first.module} ({first.kind}), {first.where}: {first.explanation}")
    return "\n".join(lines)


def _working_tps(config: Config) -> list[int]:
    working = []
    for tp in (2, 4, 8):
        layout = {
            "parallelism.tp": tp,
            "parallelism.dp": 1,
            "parallelism.pp": 1,
            "parallelism.cp": 1,
            "parallelism.ep": 1,
        }
        if not rule_problems(with_changes(config, layout)):
            working.append(tp)
    return working


def run_check_tp(
    config_path: str, overrides: Sequence[str] = (), tp: int | None = None, tolerance: float | None = None
) -> int:
    """`femtotron check-tp CONFIG [--tp N] [overrides]`; returns the exit code.

    Without a launcher it starts tp local processes running the same command; in a rank it compares
    (dp, pp and cp pinned to 1: one model replica) and rank 0 prints the report. Returns 0 when tp=N
    matches tp=1, DIVERGES_EXIT_CODE when it does not; config, data and launch problems raise.
    """
    overrides = list(overrides)
    if tp is None:
        tp = load_config(config_path, overrides).parallelism.tp
    if tp < 2:
        config = load_config(config_path, overrides)
        fits = ", ".join(map(str, _working_tps(config))) or "none up to 8 for this model"
        raise ConfigError(
            f"check-tp compares a tensor-parallel run against tp=1, but parallelism.tp={tp} "
            f"and no --tp greater than 1 was given. Fix: pass --tp N, e.g. one of: {fits}."
        )
    if tolerance is not None and not tolerance > 0:
        raise ConfigError(
            f"--tolerance {tolerance}: must be a positive relative difference, e.g. 1e-4 for "
            "float32 or 3e-2 for bfloat16 (the defaults)."
        )
    # Later overrides win, so these pin the layout whatever the config or the user's overrides say.
    layout = [
        f"parallelism.tp={tp}",
        "parallelism.dp=1",
        "parallelism.pp=1",
        "parallelism.cp=1",
        "parallelism.ep=1",
    ]
    config = load_config(
        config_path,
        [*overrides, *layout],
        sources={
            layout[0]: f"--tp {tp}",
            layout[1]: "check-tp's one model replica (dp=1)",
            layout[2]: "check-tp's one model replica (pp=1)",
            layout[3]: "check-tp's one model replica (cp=1)",
        },
    )
    _dtype(config)
    if not launched_by_torchrun():
        # Data problems too are reported once, here, rather than by every rank.
        tokenize_text_data(config)
        _first_micro_batch(config, torch.device("cpu"))
        check_local_devices(1, tp, 1)
        argv = ["check-tp", str(config_path), *overrides, "--tp", str(tp)]
        if tolerance is not None:
            argv += ["--tolerance", repr(tolerance)]
        return launch_local(tp, argv, what=f"check-tp at tp={tp}")
    world = int(os.environ["WORLD_SIZE"])
    if world != tp:
        raise ConfigError(
            f"check-tp --tp {tp} runs as {tp} processes (dp=pp=1), but WORLD_SIZE={world} were "
            f"launched. Fix: launch {tp} processes (torchrun --nproc-per-node {tp}), run it "
            f"without a launcher (it starts them itself), or pass --tp {world}."
        )
    with ParallelContext.from_config(config) as ctx:
        tokenized_by_rank_0(config, ctx.store, ctx.rank)
        report = compare_tp(config, ctx, tolerance=tolerance)
    if ctx.rank == 0:
        print(format_report(report), flush=True)
    return 0 if report.ok else DIVERGES_EXIT_CODE
