"""Schema, defaults, cross-field rules, world-size check (L1), warnings (N1, N2) and parameter_count."""

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from femtotron.config import (
    Config,
    check_world_size,
    load_config,
    load_config_dict,
)
from femtotron.diagnostics.advice import config_warnings
from femtotron.errors import ConfigError
from femtotron.optim.lr_schedule import lr_at

REPO = Path(__file__).resolve().parents[2]

TINY = {
    "model": {
        "model_config": {
            "vocab_size": 128,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 64,
        }
    },
    "tokens": {"sequence_length": 32, "micro_batch_size": 2, "train_steps": 10},
    "data": {"dataset_folder": "data/tiny"},
}


def tiny(**changes: object) -> dict:
    """TINY with dotted-path changes applied, e.g. tiny(**{"parallelism.tp": 4})."""
    data = copy.deepcopy(TINY)
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return data


def problems_of(data: dict) -> list:
    with pytest.raises(ConfigError) as info:
        load_config_dict(data)
    return info.value.problems


def only_problem(data: dict):
    problems = problems_of(data)
    assert len(problems) == 1, [str(p) for p in problems]
    return problems[0]


M = "model.model_config."


def test_defaults_and_fields_derived_later():
    cfg = load_config_dict({"tokens": {"train_steps": 100}, "data": {"dataset_folder": "d"}})
    m = cfg.model.model_config_
    assert m.num_key_value_heads == m.num_attention_heads == 32
    assert (cfg.parallelism.dp, cfg.parallelism.tp, cfg.parallelism.pp) == (1, 1, 1)
    assert cfg.model.dtype == "bfloat16" and cfg.model.init_method.std == 0.02
    assert cfg.optimizer.clip_grad == 1.0 and cfg.optimizer.accumulate_grad_in_fp32
    sched = cfg.optimizer.learning_rate_scheduler
    # Derived from train_steps by the schedule, not written into the config (a saved config.yaml reused
    # with another train_steps would keep the old run's decay).
    assert (sched.lr_decay_starting_step, sched.lr_decay_steps) == (None, None)
    assert cfg.to_dict()["optimizer"]["learning_rate_scheduler"]["lr_decay_steps"] is None


def test_a_saved_config_reused_with_more_steps_decays_over_the_new_run(tmp_path):
    """A run's config.yaml (Config.to_dict, as the trainer writes it) reused with tokens.train_steps=20:
    the decay runs to step 20, not to the end of the 10 steps of the run that wrote it."""
    first = load_config_dict(tiny(**{"optimizer.learning_rate_scheduler.lr_warmup_steps": 2}))
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump(first.to_dict(), sort_keys=False))
    again = load_config(saved, ["tokens.train_steps=20"])
    sched = again.optimizer.learning_rate_scheduler
    rates = [lr_at(step, sched, 20) for step in range(20)]
    assert rates[10] > rates[15] > rates[19] == sched.min_decay_lr
    written_for_20 = tiny(
        **{"optimizer.learning_rate_scheduler.lr_warmup_steps": 2, "tokens.train_steps": 20}
    )
    fresh = load_config_dict(written_for_20).optimizer.learning_rate_scheduler
    assert rates == [lr_at(step, fresh, 20) for step in range(20)]


def test_convenience_properties():
    cfg = load_config_dict(
        tiny(
            **{
                "tokens.batch_accumulation_per_replica": 3,
                "parallelism.dp": 2,
                "general.run": "r1",
                "logging.output_dir": "out",
            }
        )
    )
    assert cfg.global_batch_size == 2 * 3 * 2
    assert cfg.tokens_per_step == 12 * 32
    assert cfg.run_dir == Path("out") / "r1"
    assert cfg.model.model_config_.head_dim == 16


def test_parameter_count_matches_hand_count():
    m = load_config_dict(TINY).model.model_config_
    # vocab 128, hidden 64, intermediate 96, 2 layers, 4 heads of 16 dims, 2 kv heads
    embed = 128 * 64
    attn = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64  # q, k, v (2 heads x 16), o
    mlp = 3 * 64 * 96
    layer = attn + mlp + 2 * 64
    assert m.parameter_count == embed + 2 * layer + 64 + 128 * 64
    tied = m.model_copy(update={"tie_word_embeddings": True})
    assert tied.parameter_count == m.parameter_count - 128 * 64


def test_to_dict_round_trips_through_yaml(tmp_path):
    cfg = load_config_dict(tiny(**{"data.dataset_folder": {"a": 0.3, "b": 0.7}, "optimizer.clip_grad": None}))
    path = tmp_path / "dumped.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    again = load_config(path)
    assert again == cfg
    assert "model_config" in cfg.to_dict()["model"]


def test_python_construction_checks_rules_too():
    with pytest.raises(ValueError, match="parallelism.tp"):
        Config.model_validate(tiny(**{"parallelism.tp": 3}))


# --- cross-field rules: each names every field involved and a concrete fix ---


def test_hidden_size_divisible_by_heads():
    p = only_problem(tiny(**{M + "hidden_size": 250}))
    assert p.fields == (M + "hidden_size", M + "num_attention_heads")
    assert "hidden_size=250 must be divisible by num_attention_heads=4" in p.message
    assert "one of 1, 5, 25" in p.message and "hidden_size to 248 or 256" in p.message


def test_head_dim_must_be_even():
    p = only_problem(tiny(**{M + "hidden_size": 132, M + "num_attention_heads": 4}))
    assert "head_dim" in p.message and "33 is odd" in p.message and "RoPE" in p.message
    assert M + "num_attention_heads" in p.fields


def test_heads_divisible_by_kv_heads():
    p = only_problem(tiny(**{M + "num_key_value_heads": 3}))
    assert p.fields == (M + "num_attention_heads", M + "num_key_value_heads")
    assert "num_key_value_heads one of 1, 2, 4" in p.message


def test_T2_heads_divisible_by_tp_lists_working_tp():
    p = only_problem(
        tiny(**{M + "num_key_value_heads": 4, M + "intermediate_size": 128, "parallelism.tp": 8})
    )
    assert p.fields == (M + "num_attention_heads", M + "num_key_value_heads", "parallelism.tp")
    assert "num_attention_heads=4 and num_key_value_heads=4 must both be divisible by tp=8" in p.message
    assert "tp values that would work: 1, 2, 4" in p.message


def test_T2_kv_heads_limit_tp():
    p = only_problem(tiny(**{"parallelism.tp": 4}))  # 4 heads but only 2 kv heads
    assert "num_key_value_heads=2" in p.message and "tp values that would work: 1, 2." in p.message


def test_intermediate_size_divisible_by_tp():
    p = only_problem(tiny(**{M + "intermediate_size": 90, "parallelism.tp": 4, M + "num_key_value_heads": 4}))
    assert p.fields == (M + "intermediate_size", "parallelism.tp")
    assert "intermediate_size=88 or 92" in p.message


def test_vocab_size_need_not_divide_tp_it_is_padded():
    load_config_dict(tiny(**{M + "vocab_size": 129, "parallelism.tp": 2}), "tiny")  # raises on any problem


def test_layers_at_least_pp():
    p = only_problem(tiny(**{"parallelism.pp": 4}))
    assert p.fields == (M + "num_hidden_layers", "parallelism.pp")
    assert "num_hidden_layers=2 must be >= pp=4" in p.message and "pp=2 or less" in p.message


INTERLEAVED = {
    "parallelism.pp": 2,
    "parallelism.pp_engine": "interleaved-1f1b",
    "parallelism.pp_virtual_stages": 2,
    M + "num_hidden_layers": 4,
    "tokens.batch_accumulation_per_replica": 4,
}


def test_interleaved_pipeline_rules():
    load_config_dict(tiny(**INTERLEAVED))  # valid
    p = only_problem(tiny(**{**INTERLEAVED, M + "num_hidden_layers": 3}))
    assert "must be >= pp * pp_virtual_stages = 2 * 2 = 4" in p.message
    p = only_problem(tiny(**{**INTERLEAVED, "parallelism.pp_virtual_stages": 1}))
    assert "pp_virtual_stages must be >= 2" in p.message and "pp_virtual_stages=2" in p.message
    p = only_problem(tiny(**{**INTERLEAVED, "parallelism.pp_engine": "1f1b"}))
    assert p.fields == ("parallelism.pp_engine", "parallelism.pp_virtual_stages")
    p = only_problem(tiny(**{**INTERLEAVED, "tokens.batch_accumulation_per_replica": 3}))
    assert "batch_accumulation_per_replica=3 must be divisible by pp=2" in p.message
    p = only_problem(tiny(**{**INTERLEAVED, "parallelism.pp": 1}))
    assert "pp must be >= 2" in p.message


def test_the_fix_for_too_few_layers_to_interleave_is_one_the_rules_accept():
    """2 layers cannot give pp=2 ranks 2 chunks each: no pp_virtual_stages works, so the fix is no
    interleaving (or more layers), never `pp_virtual_stages=1` alone, which the interleaving rule rejects."""
    p = only_problem(tiny(**{**INTERLEAVED, M + "num_hidden_layers": 2}))
    assert (
        "Fix: pp_engine=1f1b with pp_virtual_stages=1 (no interleaving), or num_hidden_layers=4 or more."
        in p.message
    )
    load_config_dict(
        tiny(
            **{
                **INTERLEAVED,
                M + "num_hidden_layers": 2,
                "parallelism.pp_engine": "1f1b",
                "parallelism.pp_virtual_stages": 1,
            }
        )
    )
    p = only_problem(tiny(**{**INTERLEAVED, M + "num_hidden_layers": 6, "parallelism.pp_virtual_stages": 4}))
    assert "Fix: pp_virtual_stages=3, or num_hidden_layers=8 or more." in p.message


def test_P2_few_micro_batches_for_the_pipeline_warn_with_the_bubble():
    config = load_config_dict(tiny(**{"parallelism.pp": 2, "tokens.batch_accumulation_per_replica": 2}))
    (w,) = config_warnings(config)
    assert "idles for about 33% of each step (P2)" in w and "at least 4 * pp = 8 micro-batches" in w
    # 2 layers cannot interleave over pp=2: the engine that holds is offered, with what it would idle
    assert w.endswith("batch), or pp_engine=zb-h1 (idles 14%).")
    assert (
        config_warnings(load_config_dict(tiny(**{**INTERLEAVED, "tokens.batch_accumulation_per_replica": 8})))
        == []
    )
    zero_bubble = {
        "parallelism.pp": 2,
        "parallelism.pp_engine": "zb-h1",
        "tokens.batch_accumulation_per_replica": 2,
    }
    (w,) = config_warnings(load_config_dict(tiny(**zero_bubble)))
    assert "idles for about 14% of each step (P2)" in w and w.endswith(
        "(lower tokens.micro_batch_size to keep the batch)."
    )


def test_P2_only_an_engine_that_idles_less_is_suggested():
    """pp=4, 4 micro-batches, 16 layers: 1F1B idles 43%, interleaving (v = 2) 27%, zb-h1 20%; a zb-h1 run is
    told of no other engine, an interleaved one with v = 4 (16%) neither, one with v = 2 of zb-h1."""
    base = {M + "num_hidden_layers": 16, "parallelism.pp": 4, "tokens.batch_accumulation_per_replica": 4}
    (w,) = config_warnings(load_config_dict(tiny(**base)))
    assert w.endswith(", or pp_engine=interleaved-1f1b (idles 27%) or pp_engine=zb-h1 (idles 20%).")
    (w,) = config_warnings(load_config_dict(tiny(**{**base, "parallelism.pp_engine": "zb-h1"})))
    assert w.endswith("to keep the batch).")
    interleaved = {**base, "parallelism.pp_engine": "interleaved-1f1b", "parallelism.pp_virtual_stages": 2}
    (w,) = config_warnings(load_config_dict(tiny(**interleaved)))
    assert w.endswith(", or pp_engine=zb-h1 with pp_virtual_stages=1 (idles 20%).")
    (w,) = config_warnings(load_config_dict(tiny(**{**interleaved, "parallelism.pp_virtual_stages": 4})))
    assert w.endswith("to keep the batch).")


def test_sequence_length_within_max_positions():
    p = only_problem(tiny(**{"tokens.sequence_length": 128}))
    assert p.fields == ("tokens.sequence_length", M + "max_position_embeddings")
    assert "sequence_length=64" in p.message and "max_position_embeddings=128" in p.message


def test_reduce_scatter_needs_sequence_divisible_by_tp():
    p = only_problem(
        tiny(**{"parallelism.tp_mode": "REDUCE_SCATTER", "parallelism.tp": 2, "tokens.sequence_length": 31})
    )
    assert p.fields == ("tokens.sequence_length", "parallelism.tp_mode", "parallelism.tp")
    assert "sequence_length=30 or 32" in p.message and "tp_mode=ALL_REDUCE" in p.message


def test_context_parallel_needs_sequence_divisible_by_twice_cp_and_by_tp_under_sequence_parallelism():
    p = only_problem(tiny(**{"parallelism.cp": 2, "tokens.sequence_length": 30}))
    assert p.fields == ("tokens.sequence_length", "parallelism.cp")
    assert "2 * cp = 4 chunks" in p.message and "sequence_length=28 or 32" in p.message
    both = {"parallelism.cp": 2, "parallelism.tp": 2, "parallelism.tp_mode": "REDUCE_SCATTER"}
    p = only_problem(tiny(**both, **{"tokens.sequence_length": 36}))
    assert p.fields == ("tokens.sequence_length", "parallelism.cp", "parallelism.tp_mode", "parallelism.tp")
    assert "divisible by 8" in p.message and "sequence_length=32 or 40" in p.message
    load_config_dict(tiny(**both, **{"tokens.sequence_length": 32}))


def test_experts_must_split_over_tp_and_ep_and_ep_over_dp_times_cp():
    moe = {M + "moe": {"num_experts": 6, "num_experts_per_tok": 2, "intermediate_size": 48}}
    p = only_problem(tiny(**moe, **{"parallelism.ep": 4, "parallelism.dp": 4}))
    assert p.fields == (M + "moe.num_experts", "parallelism.ep") and "ep one of 1, 2, 3, 6" in p.message
    odd = {M + "moe": {**moe[M + "moe"], "intermediate_size": 45}}
    p = only_problem(tiny(**odd, **{"parallelism.tp": 2}))
    assert p.fields[0] == M + "moe.intermediate_size" and "intermediate_size=44 or 46" in p.message
    p = only_problem(tiny(**moe, **{"parallelism.ep": 2, "parallelism.dp": 3}))
    assert (
        p.fields == ("parallelism.ep", "parallelism.dp", "parallelism.cp") and "ep one of 1, 3" in p.message
    )
    load_config_dict(tiny(**moe, **{"parallelism.ep": 2, "parallelism.cp": 2}))  # ep over the cp ranks
    p = only_problem(tiny(**{"parallelism.ep": 2, "parallelism.dp": 2}))
    assert "the model is dense" in p.message and "Fix: ep=1" in p.message
    p = only_problem(tiny(**{M + "moe": {"num_experts": 2, "num_experts_per_tok": 3}}))
    assert "num_experts_per_tok <= 2" in p.message


def test_a_warm_up_longer_than_a_short_try_is_cut_to_the_run_with_a_warning():
    """examples/debug.yaml warms up for 20 steps: `tokens.train_steps=10` must still run."""
    cfg = load_config_dict(
        tiny(**{"optimizer.learning_rate_scheduler.lr_warmup_steps": 20})
    )  # train_steps=10
    (warning,) = [w for w in config_warnings(cfg) if "lr_warmup_steps" in w]
    assert "lr_warmup_steps=20 is longer than tokens.train_steps=10" in warning
    assert "set lr_warmup_steps below 10 (e.g. 1)" in warning
    sched = cfg.optimizer.learning_rate_scheduler
    assert [lr_at(step, sched, 10) for step in (0, 9)] == pytest.approx(
        [sched.learning_rate / 10, sched.learning_rate]
    )


def test_min_decay_lr_at_most_learning_rate():
    p = only_problem(tiny(**{"optimizer.learning_rate_scheduler.min_decay_lr": 1e-2}))
    assert set(p.fields) == {
        "optimizer.learning_rate_scheduler.min_decay_lr",
        "optimizer.learning_rate_scheduler.learning_rate",
    }
    assert "min_decay_lr=3e-05" in p.message


def test_val_check_interval_not_negative():
    p = only_problem(tiny(**{"tokens.val_check_interval": -1}))
    assert p.path == "tokens.val_check_interval" and "greater than or equal to 0" in p.message


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf")])
def test_blend_weights_must_be_finite_and_positive(bad):
    p = only_problem(tiny(**{"data.dataset_folder": {"a": 1.0, "b": bad}}))
    assert p.path == "data.dataset_folder" and "weight must be a finite number > 0" in p.message


def test_all_rule_violations_reported_together():
    problems = problems_of(
        tiny(
            **{
                "parallelism.pp": 4,
                "tokens.sequence_length": 128,
                M + "intermediate_size": 95,
                "parallelism.tp": 2,
            }
        )
    )
    assert len(problems) == 3


# --- L1: world size ---


def test_L1_world_size_mismatch_lists_valid_layouts():
    cfg = load_config_dict(tiny(**{"parallelism.tp": 2}))  # 4 heads, 2 kv heads, 2 layers
    with pytest.raises(ConfigError) as info:
        check_world_size(cfg, 4)
    message = str(info.value)
    for name in ("dp=1", "tp=2", "pp=1", "= 2", "WORLD_SIZE=4"):
        assert name in message
    layouts = message.split("choose a layout for 4: ")[1].split(".")[0]
    assert layouts == (  # not tp=4, not pp=4; cp last resort
        "dp=4 tp=1 pp=1; dp=2 tp=1 pp=2; dp=2 tp=2 pp=1; dp=2 cp=2 tp=1 pp=1; dp=1 tp=2 pp=2; "
        "dp=1 cp=2 tp=1 pp=2; dp=1 cp=2 tp=2 pp=1; dp=1 cp=4 tp=1 pp=1"
    )
    # Keeps the user's cp, tp and pp.
    assert "parallelism.dp=2 parallelism.cp=1 parallelism.tp=2 parallelism.pp=1" in message
    fields = info.value.problems[0].fields
    assert fields == ("parallelism.dp", "parallelism.cp", "parallelism.tp", "parallelism.pp")


def test_world_size_match_passes():
    check_world_size(load_config_dict(tiny(**{"parallelism.dp": 2, "parallelism.tp": 2})), 4)


# --- N1, N2 warnings ---


def test_default_config_has_no_warnings():
    assert config_warnings(load_config_dict(TINY)) == []


def test_N2_warns_when_clipping_off():
    (w,) = config_warnings(load_config_dict(tiny(**{"optimizer.clip_grad": None})))
    assert "optimizer.clip_grad" in w and "clip_grad: 1.0" in w


def test_N2_warns_on_huge_and_tiny_learning_rate():
    (w,) = config_warnings(load_config_dict(tiny(**{"optimizer.learning_rate_scheduler.learning_rate": 0.5})))
    assert "learning_rate=0.5" in w and "0.003" in w
    (w,) = config_warnings(
        load_config_dict(tiny(**{"optimizer.learning_rate_scheduler.learning_rate": 1e-8}))
    )
    assert "barely" in w


def test_N1_warns_on_fp16_and_large_init():
    warnings = config_warnings(
        load_config_dict(tiny(**{"model.dtype": "float16", "model.init_method.std": 0.5}))
    )
    assert any("float16" in w and "bfloat16" in w for w in warnings)
    assert any("init_method.std=0.5" in w and "0.02" in w for w in warnings)


def test_D1_debug_example_loads_without_warnings():
    cfg = load_config(REPO / "examples" / "debug.yaml")
    assert cfg.general.run == "debug" and cfg.model.model_config_.num_hidden_layers == 2
    assert config_warnings(cfg) == []


@pytest.mark.distributed
def test_loading_a_config_does_not_import_torch():
    code = (
        "import sys; from femtotron.config import load_config, check_world_size; from femtotron.diagnostics."
        "advice import config_warnings; c = "
        f"load_config({str(REPO / 'examples' / 'debug.yaml')!r}); config_warnings(c); check_world_size(c, "
        "1); assert 'torch' not in sys.modules, 'torch was imported'"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("example", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_config_is_valid_for_its_own_layout(example):
    config = load_config(example)
    par = config.parallelism
    check_world_size(config, par.world_size)


def test_E5_a_billion_layers_are_refused_naming_the_field():
    """A config from elsewhere with 1e9 layers: `doctor` built O(layers) tables and died of MemoryError."""
    p = only_problem(tiny(**{M + "num_hidden_layers": 10**9}))
    assert p.fields == (M + "num_hidden_layers",)
    assert "num_hidden_layers=1000000000 is more than 1024" in p.message
    assert (
        load_config_dict(tiny(**{M + "num_hidden_layers": 1024})).model.model_config_.num_hidden_layers
        == 1024
    )


def test_nanotron_s_run_name_templates_are_expanded(monkeypatch):
    """`general.run: tiny_llama_%date_%jobid`, as nanotron's configs write it: the start's date (the same in
    every process `femtotron train` starts: FEMTOTRON_RUN_DATE) and Slurm's job id, or `local`."""
    monkeypatch.setenv("FEMTOTRON_RUN_DATE", "20261203_101010")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    cfg = load_config_dict(tiny(**{"general.run": "tiny_llama_%date_%jobid"}))
    assert cfg.general.run == "tiny_llama_20261203_101010_4242"
    assert cfg.run_dir.name == "tiny_llama_20261203_101010_4242"
    monkeypatch.delenv("FEMTOTRON_RUN_DATE")
    monkeypatch.delenv("SLURM_JOB_ID")
    cfg = load_config_dict(tiny(**{"general.run": "tiny_llama_%date_%jobid"}))
    assert re.fullmatch(r"tiny_llama_\d{8}_\d{6}_local", cfg.general.run)


@pytest.mark.parametrize("spelling", ["adamw", "AdamW", "ADAMW", "adamW"])
def test_the_optimizer_name_is_read_in_any_case(spelling):
    """PyTorch and torchtitan write adamw: refused before, though no other name differs only in case."""
    cfg = load_config_dict(tiny(**{"optimizer.optimizer_factory.name": spelling}))
    assert cfg.optimizer.optimizer_factory.name == "adamW"
    muon = load_config_dict(tiny(**{"optimizer.optimizer_factory.name": "Muon"}))
    assert muon.optimizer.optimizer_factory.name == "muon"
    p = only_problem(tiny(**{"optimizer.optimizer_factory.name": "adam"}))
    assert "must be 'adamW' or 'muon'" in p.message


def test_L1_the_world_size_message_multiplies_every_dimension_cp_included():
    """It said `dp=1 * tp=1 * pp=1 = 1` while asking for dp * cp * tp * pp."""
    with pytest.raises(ConfigError, match=re.escape("dp=1 * cp=1 * tp=2 * pp=1 = 2, but WORLD_SIZE=4")):
        check_world_size(load_config_dict(tiny(**{"parallelism.tp": 2})), 4)
    moe = {
        M + "moe.num_experts": 4,
        M + "moe.intermediate_size": 32,
        "parallelism.dp": 2,
        "parallelism.ep": 2,
    }
    message = "dp=2 * cp=1 * tp=1 * pp=1 = 2 (ep=2 is carved out of dp * cp: no processes of its own)"
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_world_size(load_config_dict(tiny(**moe)), 4)


class CountedInt(int):
    """An int that counts the remainders taken of it, refusing more than 2^20 (what `_divisors` may try)."""

    taken = 0

    def __mod__(self, other):
        CountedInt.taken += 1
        assert CountedInt.taken <= 2**20, "more than 2^20 trial divisions"
        return int(self) % other


def test_divisors_of_a_huge_size_take_at_most_2_to_the_20_trial_divisions():
    """`_divisors` tried every number up to n: a hidden_size of 2^40 + 1 hung the loading of every command."""
    from femtotron.config.rules import _divisors

    assert _divisors(CountedInt(2**40 + 1)) == [1, 257, 4278255361, 2**40 + 1]  # 2^40 + 1 = 257 * 4278255361
    assert _divisors(360) == [d for d in range(1, 361) if 360 % d == 0]


def test_a_huge_hidden_size_not_divisible_by_the_heads_gets_the_usual_message():
    problems = problems_of(tiny(**{M + "hidden_size": 2**40 + 1, M + "num_attention_heads": 7}))
    heads = next(p for p in problems if M + "num_attention_heads" in p.fields)
    assert "hidden_size=1099511627777 must be divisible by num_attention_heads=7" in heads.message
    assert "Fix: set hidden_size to 1099511627774 or 1099511627788" in heads.message


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 0.0, -1e-6])
def test_a_non_finite_or_non_positive_norm_epsilon_or_rope_theta_is_refused(bad):
    """rms_norm_eps=inf trained (exit 0) a model that normalises everything to zero."""
    p = only_problem(tiny(**{M + "rms_norm_eps": bad}))
    assert p.fields == (M + "rms_norm_eps",)
    assert "finite number" in p.message or "greater than 0" in p.message
    p = only_problem(tiny(**{M + "rope_theta": bad}))
    assert p.fields == (M + "rope_theta",)


@pytest.mark.parametrize(
    "changes, fields, what",
    [
        ({M + "hidden_size": 2**40}, (M + "vocab_size", M + "hidden_size"), "the embedding"),
        (
            {"tokens.micro_batch_size": 10**12},
            ("tokens.micro_batch_size", "tokens.sequence_length", M + "hidden_size"),
            "a micro-batch's activations",
        ),
        (
            {M + "vocab_size": 4 * 10**9, "tokens.micro_batch_size": 512},
            ("tokens.micro_batch_size", "tokens.sequence_length", M + "vocab_size"),
            "a micro-batch's logits",
        ),
        (
            {M + "max_position_embeddings": 10**30, "tokens.sequence_length": 32},
            (M + "max_position_embeddings", M + "head_dim"),
            "each of RoPE's tables",
        ),
        (
            {M + "moe.num_experts": 2**30, M + "moe.intermediate_size": 2**10},
            (M + "moe.num_experts", M + "moe.intermediate_size", M + "hidden_size"),
            "each of a layer's expert weights",
        ),
    ],
)
def test_sizes_beyond_any_machine_are_refused_naming_the_fields(changes, fields, what):
    """Such sizes reached doctor, whose meta tensors overflowed or whose real ones could not be allocated (a
    traceback), and every command built on them."""
    p = only_problem(tiny(**changes))
    assert p.fields == fields
    assert f"elements in {what}, more than 1,099,511,627,776 (rule: at most 2^40 elements" in p.message


def test_a_billion_micro_batches_per_step_is_refused_naming_the_field():
    """doctor walks a pipeline's schedule action by action: 10^9 micro-batches at pp = 2 ran for minutes."""
    p = only_problem(tiny(**{"tokens.batch_accumulation_per_replica": 10**9}))
    assert p.fields == ("tokens.batch_accumulation_per_replica",)
    assert "1,000,000,000 micro-batches per step is more than 65,536" in p.message
    assert load_config_dict(tiny(**{"tokens.batch_accumulation_per_replica": 2**16})).tokens is not None
