"""What the bench scripts share: random token data, a femtotron Trainer for a model shape, and ranks
started as separate processes."""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from femtotron.config import load_config_dict
from femtotron.data.indexed import IndexedDatasetWriter
from femtotron.parallel.context import ParallelContext
from femtotron.trainer import Trainer

MODEL_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "vocab_size")


def write_random_tokens(prefix: Path, vocab: int, tokens: int) -> None:
    writer = IndexedDatasetWriter(str(prefix), np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(8):
        writer.add_document(rng.integers(1, vocab, tokens // 8, dtype=np.uint16))
    writer.finalize()


def shape_trainer(shape: dict, dtype: str, data_prefix: Path, run_dir: Path, run: str = "bench",
                  parallelism: dict | None = None) -> Trainer:
    """A one-process Trainer for `shape` (the MODEL_KEYS plus sequence_length and micro_batch_size)."""
    config = load_config_dict({
        "general": {"run": run},
        "model": {"model_config": {**{k: shape[k] for k in MODEL_KEYS},
                                   "max_position_embeddings": shape["sequence_length"]},
                  "dtype": dtype},
        "parallelism": parallelism or {},
        "tokens": {"sequence_length": shape["sequence_length"], "micro_batch_size": shape["micro_batch_size"],
                   "train_steps": 10**6},
        "data": {"dataset_folder": str(data_prefix)},
        "logging": {"output_dir": str(run_dir)},
        "checkpoints": {"save_final_state": False},
    })
    return Trainer(config, ParallelContext(), log_to_console=False)


def _rank_main(rank: int, port: int, layout: dict[str, int], rank_fn: Callable, cases: list, args: Any,
               results: Any) -> None:
    world_size = math.prod(layout.values())
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        ctx = ParallelContext(**layout, init_timeout_seconds=60, collective_timeout_seconds=300)
        try:
            rank_fn(ctx, cases, args, lambda index, value: results.put((rank, "ok", index, value)))
        finally:
            ctx.close()
    except BaseException as e:  # noqa: BLE001 - the parent must hear of every failure
        results.put((rank, "error", None, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def spawn_ranks(layout: dict[str, int], rank_fn: Callable, cases: list, args: Any,
                on_case: Callable[[Any, list], None]) -> None:
    """Start one process per rank of `layout` (ParallelContext's dp/tp/pp), each calling
    `rank_fn(ctx, cases, args, report)`, where `report(case index, value)` sends a case's result home;
    call `on_case(case, values by rank)` as each case completes on every rank. `rank_fn` must be a
    module-level function (the processes are spawned); `args.timeout` bounds the wait for any report."""
    world_size = math.prod(layout.values())
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank_main, args=(r, port, layout, rank_fn, cases, args, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    got: dict[int, dict[int, Any]] = {}
    done = 0
    try:
        while done < len(cases):
            try:
                rank, status, index, value = results.get(timeout=args.timeout)
            except queue.Empty:
                raise SystemExit(f"{layout}: no rank reported for {args.timeout:g} s; giving up") from None
            if status == "error":
                raise SystemExit(f"{layout}: rank {rank} failed:\n{value}")
            got.setdefault(index, {})[rank] = value
            if len(got[index]) == world_size:
                by_rank = got.pop(index)
                on_case(cases[index], [by_rank[r] for r in range(world_size)])
                done += 1
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
