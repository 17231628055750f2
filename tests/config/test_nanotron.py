"""nanotron configs (the schema of huggingface/nanotron at 2411b02, src/nanotron/config/) in femtotron."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from helpers import TINY_MODEL, build_llama, femtotron, llama_config, write_patterned_tokens

from femtotron.cli import main
from femtotron.config import load_config
from femtotron.config.load import is_nanotron
from femtotron.config.nanotron import KEYS, NO_EFFECT, PARAMETER_NAMES, render_table, translate
from femtotron.data.text_cache import tokenize_text_data
from femtotron.errors import ConfigError, DataError
from femtotron.optim.zero import decays

DOCS = Path(__file__).resolve().parents[2] / "docs" / "nanotron.md"


def tiny(tmp_path: Path, **changes: dict) -> dict:
    """A nanotron config of the shape of nanotron's examples (config_tiny_llama.yaml), written from its
    classes: one data stage, lighteval off, nanotron's defaults spelled out."""
    config = {
        "checkpoints": {
            "checkpoint_interval": 10,
            "checkpoints_path": str(tmp_path / "checkpoints"),
            "checkpoints_path_is_shared_file_system": False,
            "resume_checkpoint_path": None,
            "save_initial_state": False,
        },
        "data_stages": [
            {
                "name": "Stable Training Stage",
                "start_training_step": 1,
                "data": {
                    "dataset": {"dataset_folder": str(tmp_path / "data"), "return_positions": True},
                    "num_loading_workers": 1,
                    "seed": 42,
                },
            }
        ],
        "general": {
            "benchmark_csv_path": None,
            "consumed_train_samples": None,
            "ignore_sanity_checks": True,
            "project": "debug",
            "run": "tiny_llama",
            "seed": 42,
            "step": None,
        },
        "lighteval": None,
        "logging": {"iteration_step_info_interval": 1, "log_level": "info", "log_level_replica": "info"},
        "model": {
            "ddp_bucket_cap_mb": 25,
            "dtype": "bfloat16",
            "init_method": {"std": 0.025},
            "make_vocab_size_divisible_by": 1,
            "model_config": {
                "bos_token_id": 1,
                "eos_token_id": 2,
                "hidden_act": "silu",
                "hidden_size": 16,
                "initializer_range": 0.02,
                "intermediate_size": 64,
                "is_llama_config": True,
                "max_position_embeddings": 256,
                "num_attention_heads": 4,
                "num_hidden_layers": 2,
                "num_key_value_heads": 4,
                "pad_token_id": None,
                "pretraining_tp": 1,
                "rms_norm_eps": 1e-5,
                "rope_scaling": None,
                "tie_word_embeddings": True,
                "use_cache": True,
                "vocab_size": 256,
            },
        },
        "optimizer": {
            "accumulate_grad_in_fp32": True,
            "clip_grad": 1.0,
            "learning_rate_scheduler": {
                "learning_rate": 3e-4,
                "lr_decay_starting_step": None,
                "lr_decay_steps": 13,
                "lr_decay_style": "cosine",
                "lr_warmup_steps": 2,
                "lr_warmup_style": "linear",
                "min_decay_lr": 1e-5,
            },
            "optimizer_factory": {
                "adam_beta1": 0.9,
                "adam_beta2": 0.95,
                "adam_eps": 1e-8,
                "name": "adamW",
                "torch_adam_is_fused": True,
            },
            "weight_decay": 0.01,
            "zero_stage": 0,
        },
        "parallelism": {
            "dp": 2,
            "expert_parallel_size": 1,
            "pp": 2,
            "pp_engine": "1f1b",
            "tp": 2,
            "tp_linear_async_communication": True,
            "tp_mode": "REDUCE_SCATTER",
        },
        "profiler": None,
        "tokenizer": {
            "tokenizer_max_length": None,
            "tokenizer_name_or_path": "gpt2",
            "tokenizer_revision": None,
        },
        "tokens": {
            "batch_accumulation_per_replica": 1,
            "limit_test_batches": 0,
            "limit_val_batches": 0,
            "micro_batch_size": 2,
            "sequence_length": 256,
            "train_steps": 15,
            "val_check_interval": -1,
        },
    }
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = config
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        node[leaf] = value
    return config


def write(tmp_path: Path, config: dict, name: str = "nanotron.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def test_a_nanotron_config_loads_as_the_femtotron_config_of_the_same_run(tmp_path, capsys):
    config = load_config(write(tmp_path, tiny(tmp_path)))
    par = config.parallelism
    assert (par.dp, par.tp, par.pp, par.ep, par.tp_mode) == (2, 2, 2, 1, "REDUCE_SCATTER")
    assert config.data.dataset_folder == str(tmp_path / "data")
    assert config.data.seed == 42
    assert config.tokens.val_check_interval == 0  # nanotron's -1: no validation
    assert config.model.init_method.std == 0.025
    assert config.model.model_config_.tie_word_embeddings
    report = capsys.readouterr().err
    assert "nanotron tokens.val_check_interval -> tokens.val_check_interval = 0" in report
    assert "nanotron data_stages.0.data.dataset.dataset_folder -> data.dataset_folder" in report
    no_effect = [line for line in report.splitlines() if "no effect in femtotron" in line]
    assert len(no_effect) == 1 and "model.model_config.use_cache" in no_effect[0]
    # The same run written in femtotron's own keys gives the same Config.
    own = tiny(tmp_path)
    femtotron = {
        "general": {"project": "debug", "run": "tiny_llama", "seed": 42},
        "model": {
            "model_config": {
                k: v
                for k, v in own["model"]["model_config"].items()
                if k in ("hidden_size", "intermediate_size", "max_position_embeddings", "num_attention_heads")
                or k in ("num_hidden_layers", "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings")
                or k == "vocab_size"
            },
            "init_method": {"std": 0.025},
        },
        "tokenizer": {"tokenizer_name_or_path": "gpt2"},
        "parallelism": {"dp": 2, "tp": 2, "pp": 2, "tp_mode": "REDUCE_SCATTER"},
        "tokens": {"sequence_length": 256, "train_steps": 15, "micro_batch_size": 2},
        "optimizer": {
            "learning_rate_scheduler": {
                **own["optimizer"]["learning_rate_scheduler"],
                "lr_decay_style": "cosine",
            }
        },
        "data": {"dataset_folder": str(tmp_path / "data"), "seed": 42},
        "checkpoints": {"checkpoint_interval": 10, "checkpoints_path": str(tmp_path / "checkpoints")},
    }
    assert load_config(write(tmp_path, femtotron, "femtotron.yaml")) == config


@pytest.mark.parametrize(
    ("changes", "path", "expected"),
    [
        ({"parallelism__context_parallel_size": 2}, "parallelism.cp", 2),
        ({"parallelism__expert_parallel_size": 1}, "parallelism.ep", 1),
        ({"parallelism__pp_engine": None}, "parallelism.pp_engine", "afab"),  # nanotron's default
        ({"parallelism__tp_mode": "all_reduce"}, "parallelism.tp_mode", "ALL_REDUCE"),
        ({"model__ddp_bucket_cap_mb": 50}, "parallelism.dp_bucket_size_mb", 50),
        ({"model__make_vocab_size_divisible_by": 100}, "model.model_config.vocab_size", 300),
        ({"model__dtype": "torch.float32"}, "model.dtype", "float32"),
        ({"model__init_method": {"path": "hf/llama"}}, "model.init_from", "hf/llama"),
        (
            {"model__model_config__is_llama_config": True, "model__model_config___use_doc_masking": True},
            "model.document_masking",
            True,
        ),
        ({"general__run": None}, "general.run", "%date_%jobid"),
        ({"tokens__val_check_interval": 5, "tokens__limit_val_batches": 3}, "tokens.limit_val_batches", 3),
        (
            {"optimizer__learning_rate_scheduler__min_decay_lr": None},
            "optimizer.learning_rate_scheduler.min_decay_lr",
            3e-4,
        ),
        (
            {"optimizer__learning_rate_scheduler__lr_decay_style": None},
            "optimizer.learning_rate_scheduler.lr_decay_style",
            "linear",
        ),
        (
            {
                "profiler": {
                    "profiler_export_path": "tb",
                    "skip_first": 3,
                    "wait": 1,
                    "warmup": 1,
                    "active": 2,
                }
            },
            "profiling.profile_steps",
            [6, 7],
        ),
        (
            {"data_stages__0__data__dataset": {"dataset_folder": ["a", "b"], "dataset_weights": [0.7, 0.3]}},
            "data.dataset_folder",
            {"a": 0.7, "b": 0.3},
        ),
        (
            {"data_stages__0__data__dataset": {"dataset_folder": ["a"], "dataset_read_path": ["/local/a"]}},
            "data.dataset_folder",
            ["/local/a"],
        ),
    ],
)
def test_each_translated_key(tmp_path, changes, path, expected):
    result = translate(tiny(tmp_path, **changes), {})
    assert result.problems == []
    node = result.config
    for part in path.split("."):
        node = node[part]
    assert node == expected


def test_nanotron_moe_config_becomes_femtotron_moe(tmp_path):
    moe = {
        "num_experts": 4,
        "top_k": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "router_aux_loss_coef": 0.02,
        "layers": [-1],
        "enable_shared_expert": True,
        "token_dispatcher_type": "alltoall",
    }
    changes = {"model__model_config__moe_config": moe, "model__model_config__is_qwen2_config": True}
    config = load_config(write(tmp_path, tiny(tmp_path, **changes)))
    got = config.model.model_config_.moe
    assert (got.num_experts, got.num_experts_per_tok, got.intermediate_size) == (4, 2, 32)
    assert (got.num_shared_experts, got.shared_expert_gate) == (2, True)
    assert got.aux_loss_coef == 0.0  # nanotron reads router_aux_loss_coef but adds no such loss


def test_a_moe_config_s_missing_keys_are_nanotron_s_defaults_and_its_layer_is_femtotron_s(tmp_path):
    """nanotron's MoEConfig defaults (models_config.py at 2411b02), not femtotron's, for the keys left out;
    and its Qwen2 MoE layer (nn/moe.py): the top k of a softmax over all experts, a shared expert scaled by
    sigmoid(x . w), no load-balancing loss."""
    moe = {"num_experts": 8, "top_k": 1, "enable_shared_expert": True}
    changes = {"model__model_config__moe_config": moe, "model__model_config__is_qwen2_config": True}
    got = load_config(write(tmp_path, tiny(tmp_path, **changes))).model.model_config_.moe
    assert (got.num_experts, got.num_experts_per_tok, got.intermediate_size) == (8, 1, 1408)
    assert (got.num_shared_experts, got.shared_expert_gate) == (4, True)  # 5632 = 4 experts of 1408
    assert (got.router_norm, got.aux_loss_coef) == ("softmax_then_topk", 0.0)
    changes["model__model_config__moe_config"] = {}
    got = load_config(write(tmp_path, tiny(tmp_path, **changes))).model.model_config_.moe
    assert (got.num_experts, got.num_experts_per_tok, got.intermediate_size) == (8, 2, 1408)
    assert (got.num_shared_experts, got.shared_expert_gate) == (0, False)


def test_what_femtotron_cannot_run_is_refused_all_at_once_with_lines(tmp_path):
    config = tiny(
        tmp_path,
        lighteval={"batch_size": 16, "tasks": {"tasks": "hellaswag"}},
        s3_upload={"upload_s3_path": "s3://bucket/x", "remove_after_upload": True},
        model__init_method={"use_mup": True},
        optimizer__weight_decay_exclude_named_params=[".*norm.*", "attention"],
        model__model_config__rope_interleaved=True,
        data_stages__0__sequence_length=512,
    )
    config["data_stages"].append(
        {"name": "b", "start_training_step": 10, "data": {"dataset": None, "seed": 1}}
    )
    path = write(tmp_path, config)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    fields = [p.path for p in caught.value.problems]
    expected = [
        "lighteval",
        "s3_upload",
        "model.init_method.use_mup",
        "optimizer.weight_decay_exclude_named_params",
        "model.model_config.rope_interleaved",
        "data_stages.0.sequence_length",
    ]
    assert sorted(fields) == sorted(expected)
    text = path.read_text().splitlines()
    for problem in caught.value.problems:
        line = int(problem.locations[0].removeprefix("line "))
        assert (
            text[line - 1]
            .strip()
            .startswith(problem.path.rsplit(".", 1)[-1] if problem.path[-1] != "0" else "-")
        )
    message = str(caught.value)
    assert "lm_eval --model hf" in message and "femtotron export-hf" in message
    assert "SpectralMupInit" in message


def test_hf_datasets_become_text_tokenized_at_start_and_a_hub_name_is_refused_with_the_commands(tmp_path):
    dataset = {"hf_dataset_or_datasets": "stas/openwebtext-10k", "hf_dataset_splits": "train"}
    dataset["text_column_name"] = "content"
    config = load_config(write(tmp_path, tiny(tmp_path, data_stages__0__data__dataset=dataset)))
    assert (config.data.text_dataset, config.data.text_column) == ("stas/openwebtext-10k", "content")
    config.tokenizer.tokenizer_name_or_path = str(tmp_path / "tokenizer.json")
    with pytest.raises(DataError) as caught:
        tokenize_text_data(config)
    assert "load_dataset('stas/openwebtext-10k', split='train').save_to_disk" in str(caught.value)
    assert "femtotron preprocess --input data/openwebtext-10k" in str(caught.value)
    split = {"hf_dataset_or_datasets": "local", "hf_dataset_splits": "validation"}
    with pytest.raises(ConfigError, match=r"split's own directory \(DATASET_DIR/SPLIT\)"):
        load_config(write(tmp_path, tiny(tmp_path, data_stages__0__data__dataset=split)))


def test_several_stages_are_sorted_by_their_start_and_null_is_random_tokens(tmp_path, capsys):
    """nanotron sorts its stages: the YAML's order does not matter, and a problem names the YAML's line."""
    config = tiny(tmp_path)
    config["data_stages"] = [
        {"name": "decay", "start_training_step": 10, "data": {"dataset": {"dataset_folder": "b"}, "seed": 7}},
        {"name": "warm", "start_training_step": 1, "data": {"dataset": None, "seed": None}},
        {
            "name": "stable",
            "start_training_step": 3,
            "data": {"dataset": {"dataset_folder": ["a", "b"], "dataset_weights": [0.2, 0.8]}},
        },
    ]
    path = write(tmp_path, config)
    loaded = load_config(path)
    stages = [
        (s.name, s.start_training_step, s.dataset_folder, s.synthetic, s.seed) for s in loaded.data.stages
    ]
    assert stages == [
        ("warm", 1, None, True, None),
        ("stable", 3, {"a": 0.2, "b": 0.8}, False, None),
        ("decay", 10, "b", False, 7),
    ]
    assert (
        "nanotron data_stages -> data.stages (3 stages, in the order they start)" in capsys.readouterr().err
    )
    config["data_stages"][0]["start_training_step"] = 3  # two stages starting at step 3
    path = write(tmp_path, config)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    problem = caught.value.problems[0]
    assert problem.fields == ("data.stages.2.start_training_step", "data.stages.1.start_training_step")
    lines = path.read_text().splitlines()
    assert all(
        lines[int(at.removeprefix("line ")) - 1].strip() == "start_training_step: 3"
        for at in problem.locations
    )


def test_starcoder2_is_refused_by_name_in_one_problem(tmp_path):
    model = {"is_starcoder2_config": True, "n_layer": 2, "multi_query": True, "activation_function": "gelu"}
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, tiny(tmp_path, model__model_config=model)))
    assert [p.path for p in caught.value.problems] == ["model.model_config.is_starcoder2_config"]
    assert "Starcoder2" in str(caught.value) and "Llama or Qwen2" in str(caught.value)


def test_weight_decay_exclusions_are_rewritten_over_femtotron_names(tmp_path):
    """nanotron's regexes over its names become regexes over femtotron's for the same tensors; the optimizer
    then leaves exactly those undecayed, and a pattern matching nothing is refused."""
    patterns = [
        ".*layernorm.*",
        ".*final_layer_norm.*",
        "model.token_position_embeddings.*",
        "model.decoder.1.*attn.*",
    ]
    config = load_config(
        write(tmp_path, tiny(tmp_path, optimizer__weight_decay_exclude_named_params=patterns))
    )
    ours = config.optimizer.weight_decay_exclude_named_params
    model = build_llama(config.model.model_config_.model_copy(update={"num_hidden_layers": 2}))
    excluded = {name for name, p in model.named_parameters() if not decays(name, p, ours)}
    assert excluded == {
        "embed_tokens.weight",
        "norm.weight",
        "layers.0.input_layernorm.weight",
        "layers.0.post_attention_layernorm.weight",
        "layers.1.input_layernorm.weight",
        "layers.1.post_attention_layernorm.weight",
        "layers.1.self_attn.qkv_proj.weight",
        "layers.1.self_attn.o_proj.weight",
    }
    with pytest.raises(ConfigError, match="'.*bias' matches none of this model's parameters"):
        load_config(write(tmp_path, tiny(tmp_path, optimizer__weight_decay_exclude_named_params=[".*bias"])))


def test_lm_head_exclusions_of_a_tied_model_exclude_its_one_embedding_tensor(tmp_path):
    """In a tied model nanotron's model.lm_head.pp_block.weight is the embedding, excluded when a pattern
    matches either of its names; a translation that knew only the embedding's own name refused the pattern
    as matching nothing, so nanotron's config would not load. Untied, the same pattern is the head alone."""
    patterns = ["model.lm_head.*"]
    for tied, excluded in ((True, "embed_tokens.weight"), (False, "lm_head.weight")):
        changes = {
            "optimizer__weight_decay_exclude_named_params": patterns,
            "model__model_config__tie_word_embeddings": tied,
        }
        config = load_config(write(tmp_path, tiny(tmp_path, **changes)))
        ours = config.optimizer.weight_decay_exclude_named_params
        assert ours == [re.escape(excluded) + "$"]
        model = build_llama(config.model.model_config_)
        assert {name for name, p in model.named_parameters() if not decays(name, p, ours)} == {excluded}


def test_z_loss_enabled_without_a_coefficient_takes_nanotron_s_default_coefficient(tmp_path):
    """nanotron's z_loss_coefficient defaults to 1e-4 (config/models_config.py: "Default from the paper");
    a translation defaulting to another value trained with another loss and said nothing."""

    def coefficient(**model_config) -> float:
        changes = {f"model__model_config__{key}": value for key, value in model_config.items()}
        return load_config(write(tmp_path, tiny(tmp_path, **changes))).model.model_config_.logits_z_loss_coef

    assert coefficient(z_loss_enabled=True) == 1e-4
    assert coefficient(z_loss_enabled=True, z_loss_coefficient=3e-4) == 3e-4
    assert coefficient(z_loss_enabled=False, z_loss_coefficient=3e-4) == 0.0


def test_the_parameter_name_table_covers_every_femtotron_parameter():
    """Fails when a model parameter is renamed without the table that maps nanotron's names onto ours."""
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32, "num_shared_experts": 1}
    for cfg in (llama_config(), llama_config(tie_word_embeddings=True), llama_config(moe=moe)):
        for name, _ in build_llama(cfg).named_parameters():
            generic = re.sub(r"^layers\.\d+\.", "layers.{i}.", name)
            assert generic in PARAMETER_NAMES, name


def test_a_key_missing_from_the_table_is_refused_as_unknown_naming_it(tmp_path):
    config = tiny(tmp_path, parallelism__cp=2, model__model_config__not_a_key=1, tokens__adam_eps=1e-8)
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, config))
    paths = sorted(p.path for p in caught.value.problems)
    assert paths == ["model.model_config.not_a_key", "parallelism.cp", "tokens.adam_eps"]
    assert "has it at optimizer.optimizer_factory.adam_eps; move it there" in str(caught.value)
    assert "unknown key in a nanotron config" in str(caught.value)
    assert "context_parallel_size" in str(caught.value)  # nanotron's keys of that section


def every_key_config() -> dict:
    """A value for every key of the table: a runnable one, or for refused keys one that is refused."""
    values = {
        "lighteval": {"batch_size": 16},
        "s3_upload": {"upload_s3_path": "s3://bucket/run"},
        "model.init_method.use_mup": True,
        "model.init_method.path": "hf/llama",
        "model.init_method.scaling_method": "NUM_LAYERS",
        "data_stages.*.start_training_step": 1,
        "model.make_vocab_size_divisible_by": 64,
        "model.model_config.moe_config.layers": [-1],
        "model.model_config.moe_config.enable_shared_expert": True,
        "model.model_config.moe_config.shared_expert_intermediate_size": 64,
        "model.model_config.moe_config.moe_intermediate_size": 32,
        "data_stages.*.data.dataset.dataset_folder": ["a"],
        "data_stages.*.data.dataset.dataset_weights": [1.0],
        "data_stages.*.data.dataset.hf_dataset_or_datasets": "stas/openwebtext-10k",
        "optimizer.weight_decay_exclude_named_params": [".*layernorm.*"],
        "model.model_config.is_starcoder2_config": False,
        "profiler.profiler_export_path": "tb",
        "profiler.repeat": 1,
    }
    config: dict = {}
    for key, entry in KEYS.items():
        if any(other.startswith(key + ".") for other in KEYS):
            continue  # a section: its keys are set
        value = values.get(key, 2 if entry.action != NO_EFFECT else None)
        *parents, leaf = key.replace("data_stages.*", "data_stages").split(".")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    config["data_stages"] = [config.pop("data_stages")]
    return config


def test_every_key_of_the_table_is_handled_by_the_translation_in_exactly_one_way():
    """Fails when the table and the translation disagree: every key is read, and lands in one place."""
    config = every_key_config()
    result = translate(config, {})
    generic = [p.path.replace("data_stages.0", "data_stages.*") for p in result.problems]
    translated = [
        line.split(" -> ")[0].replace("data_stages.0", "data_stages.*") for line in result.translated
    ]
    honored = []
    for key, entry in KEYS.items():
        node = result.config
        for part in key.split("."):
            node = node.get(part, {}) if isinstance(node, dict) else {}
        unchanged = entry.target == key and key not in translated  # translated to itself, value kept
        if (entry.action == "honored" or unchanged) and node != {}:
            honored.append(key)
    sections = {k for k in KEYS if any(other.startswith(k + ".") for other in KEYS)} - {
        "lighteval",
        "s3_upload",
    }
    places = [*honored, *translated, *result.no_effect, *generic]
    # the profiler's keys all translate to profiling.profile_steps; each key appears once
    assert sorted(places) == sorted(set(places))
    assert set(places) | sections == set(KEYS), set(KEYS) - set(places) - sections
    assert set(generic) == {"lighteval", "s3_upload", "model.init_method.use_mup"}


def test_the_docs_table_is_rendered_from_the_translation_table():
    text = DOCS.read_text(encoding="utf-8")
    start = text.index("<!-- nanotron-table -->") + len("<!-- nanotron-table -->\n")
    end = text.index("<!-- /nanotron-table -->")
    assert text[start:end].strip() == render_table(), (
        "regenerate with femtotron.config.nanotron.render_table()"
    )


def test_recognition_needs_a_nanotron_only_section_or_flag(tmp_path):
    assert is_nanotron(tiny(tmp_path))
    assert is_nanotron({"model": {"model_config": {"is_llama_config": True}}})
    assert not is_nanotron({"tokens": {"train_steps": 1}, "data": {"dataset_folder": "x"}})


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """The command line, in this process: (exit code, stdout, stderr)."""
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_doctor_and_convert_config_round_trip(tmp_path, capsys):
    path = write(tmp_path, tiny(tmp_path))
    code, out, err = cli(capsys, "doctor", str(path), "--device", "H100")
    assert code == 0, err
    assert err.count("is a nanotron config") == 1 and "fits:" in out
    converted = tmp_path / "femtotron.yaml"
    path = write(tmp_path, tiny(tmp_path), "other.yaml")  # a process prints a file's translation once
    code, out, err = cli(capsys, "convert-config", str(path), "-o", str(converted))
    assert code == 0, err
    assert "nanotron tokens.val_check_interval -> tokens.val_check_interval = 0" in err
    assert not is_nanotron(yaml.safe_load(converted.read_text()))
    assert load_config(converted) == load_config(path)
    code, out, err = cli(capsys, "convert-config", str(path))
    assert yaml.safe_load(out) == yaml.safe_load(converted.read_text())
    code, out, err = cli(capsys, "convert-config", str(converted))
    assert code == 2 and "a femtotron config already" in err


def test_a_qwen_moe_example_s_expert_layers_translate_and_a_layer_it_lacks_is_refused(tmp_path, capsys):
    """nanotron's moe_config.layers (the layers with experts) becomes moe.dense_layers (the others)."""
    changes = {
        "model__model_config__is_qwen2_config": True,
        "model__model_config__attention_bias": True,
        "model__model_config__z_loss_enabled": True,
        "model__model_config__num_hidden_layers": 4,
        "model__model_config__moe_config": {"num_experts": 4, "top_k": 2, "layers": [0, 2]},
    }
    config = load_config(write(tmp_path, tiny(tmp_path, **changes)))
    assert config.model.model_config_.moe.dense_layers == [1, 3]
    changes["model__model_config__moe_config"]["layers"] = [0, 4]
    code, out, err = cli(capsys, "doctor", str(write(tmp_path, tiny(tmp_path, **changes))))
    assert code == 2
    assert "1 problem" in err and "moe_config.layers" in err and "from 0 to 3" in err
    assert "attention_bias -> model.model_config.qkv_bias" in err  # translated, not a problem


EXAMPLES = Path(__file__).parent / "nanotron_examples"
_ADAM = [
    "optimizer.adam_beta1",
    "optimizer.adam_beta2",
    "optimizer.adam_eps",
    "optimizer.torch_adam_is_fused",
]


@pytest.mark.parametrize(
    ("name", "refused"),
    [
        ("config_tiny_llama.yaml", []),
        ("config_qwen.yaml", []),
        ("config_qwen_with_moe.yaml", []),  # its moe_config twice: nanotron keeps the last
        ("config_nanoset.yaml", ["data_stages.2.data.dataset.dataset_folder"]),  # a {folder: weight} mapping
        (
            "config_llamoe.yaml",
            [
                "model.model_config.is_llamoe_config",
                "model.model_config.moe_capacity_factor",
                "model.model_config.moe_num_experts",
                "model.model_config.num_experts_per_tok",
            ],
        ),
        (
            "config_resume_training.yaml",
            ["model.model_config.interleaved_rotary", "parallelism.moe_layer_recompute"],
        ),
        ("debug_config_tiny_llama.yaml", _ADAM),
    ],
)
def test_nanotron_s_example_configs_load_or_are_refused_as_nanotron_s_loader_does(name, refused):
    """nanotron's own examples at 2411b02, each as its loader (get_config_from_file) treats it: what it
    accepts loads and holds femtotron's rules; what it refuses is refused on the same keys, saying so."""
    if not refused:
        load_config(EXAMPLES / name)
        return
    with pytest.raises(ConfigError) as caught:
        load_config(EXAMPLES / name)
    assert sorted(p.path for p in caught.value.problems) == refused
    assert all("nanotron's loader at 2411b02 refuses" in p.message for p in caught.value.problems)


def test_a_duplicated_key_is_kept_last_with_a_warning_in_a_nanotron_config_and_refused_in_femtotron_s(
    tmp_path, capsys
):
    """nanotron reads its YAML with yaml.load, which keeps a duplicated key's last value: so does femtotron
    for a nanotron config, saying which lines; its own configs still refuse a duplicate."""
    path = tmp_path / "qwen_moe.yaml"
    path.write_text((EXAMPLES / "config_qwen_with_moe.yaml").read_text())  # moe_config at lines 66 and 83
    moe = load_config(path).model.model_config_.moe
    assert (moe.num_experts, moe.num_experts_per_tok, moe.num_shared_experts) == (8, 1, 4)
    assert "model.model_config.moe_config (line 83): duplicate key (also set at line 66)" in (
        capsys.readouterr().err
    )
    own = tmp_path / "own.yaml"
    own.write_text("tokens:\n  train_steps: 10\n  train_steps: 20\ndata:\n  dataset_folder: data\n")
    with pytest.raises(ConfigError) as caught:
        load_config(own)
    assert [p.path for p in caught.value.problems] == ["tokens.train_steps"]
    assert "duplicate key (also set at line 2)" in str(caught.value)


def test_llamoe_s_keys_are_refused_as_nanotron_refuses_them_naming_qwen2_s_moe_keys(tmp_path):
    """nanotron's examples/moe has its own LlaMoEConfig, but its loader builds model_config as a Qwen2Config
    first (ModelArgs.__post_init__), in examples/moe/train_moe.py too: the LlaMoE keys are refused."""
    model = {**tiny(tmp_path)["model"]["model_config"], "is_llamoe_config": True}
    del model["is_llama_config"]
    model |= {"moe_num_experts": 4, "num_experts_per_tok": 1, "moe_capacity_factor": 1}
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, tiny(tmp_path, model__model_config=model)))
    messages = {p.path.rsplit(".", 1)[-1]: p.message for p in caught.value.problems}
    assert "is_qwen2_config: true" in messages["is_llamoe_config"]
    assert "moe_config.num_experts" in messages["moe_num_experts"]
    assert "moe_config.top_k" in messages["num_experts_per_tok"]
    assert "delete it" in messages["moe_capacity_factor"]
    # the fix named: LlaMoE's experts are of intermediate_size
    for key in ("is_llamoe_config", "moe_num_experts", "num_experts_per_tok", "moe_capacity_factor"):
        del model[key]
    model |= {
        "is_qwen2_config": True,
        "moe_config": {"num_experts": 4, "top_k": 1, "moe_intermediate_size": 64},
    }
    moe = load_config(write(tmp_path, tiny(tmp_path, model__model_config=model))).model.model_config_.moe
    assert (moe.num_experts, moe.num_experts_per_tok, moe.intermediate_size) == (4, 1, 64)


def test_keys_nanotron_renamed_or_removed_are_refused_as_its_loader_refuses_them_with_the_fix(tmp_path):
    config = tiny(
        tmp_path, model__model_config__interleaved_rotary=False, parallelism__moe_layer_recompute=False
    )
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, config))
    messages = {p.path: p.message for p in caught.value.problems}
    assert "rename it rope_interleaved" in messages["model.model_config.interleaved_rotary"]
    assert "delete it" in messages["parallelism.moe_layer_recompute"]
    renamed = tiny(tmp_path, model__model_config__rope_interleaved=False)
    load_config(write(tmp_path, renamed))  # the fix named loads


def test_adam_settings_above_optimizer_factory_are_refused_as_nanotron_refuses_them(tmp_path):
    """Where nanotron read them before its optimizer_factory; at 2411b02 its loader refuses them there."""
    config = tiny(tmp_path)
    factory = config["optimizer"].pop("optimizer_factory")
    config["optimizer"] |= {key: factory[key] for key in ("adam_beta1", "adam_beta2", "adam_eps")}
    config["optimizer"]["torch_adam_is_fused"] = factory["torch_adam_is_fused"]
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, config))
    assert sorted(p.path for p in caught.value.problems) == _ADAM
    assert all("move it under optimizer.optimizer_factory" in p.message for p in caught.value.problems)


def test_a_folder_weight_mapping_and_unmatched_weights_are_refused_as_nanotron_refuses_them(tmp_path):
    """nanotron's dataset_folder is a folder or a list (the mapping form went in 7323ce1c): the fix is the
    list with dataset_weights, which must have one weight per folder."""
    mapping = {"dataset_folder": {"a": 0.6, "b": 0.4}}
    with pytest.raises(ConfigError, match=r"dataset_folder: \['a', 'b'\] with dataset_weights: \[0.6, 0.4\]"):
        load_config(write(tmp_path, tiny(tmp_path, data_stages__0__data__dataset=mapping)))
    unmatched = {"dataset_folder": ["a", "b"], "dataset_weights": [1.0]}
    with pytest.raises(ConfigError, match="2 folders but dataset_weights has 1"):
        load_config(write(tmp_path, tiny(tmp_path, data_stages__0__data__dataset=unmatched)))


def test_weight_decay_patterns_over_nanotron_s_grouped_experts_are_rewritten_over_femtotron_s(tmp_path):
    """nanotron's Qwen2 MoE layer (nn/moe.py at 2411b02) holds a layer's experts in two tensors,
    experts.merged_gate_up_proj and experts.merged_down_proj, as femtotron does."""
    changes = {
        "model__model_config__moe_config": {"num_experts": 4, "top_k": 2, "moe_intermediate_size": 32},
        "optimizer__weight_decay_exclude_named_params": [".*experts.merged_.*"],
    }
    config = load_config(write(tmp_path, tiny(tmp_path, **changes)))
    assert config.optimizer.weight_decay_exclude_named_params == [
        r"layers\.\d+\.mlp\.experts\.gate_up_proj$",
        r"layers\.\d+\.mlp\.experts\.down_proj$",
    ]


def test_qwen2_biases_and_smollm3_layers_without_rope_translate(tmp_path):
    """Also the sliding window, which nanotron's Qwen model skips in the layers without RoPE."""
    changes = {
        "model__model_config__attention_bias": True,
        "model__model_config__no_rope_layer": 2,
        "model__model_config__sliding_window_size": 8,
        "model__model_config__num_hidden_layers": 4,
        "optimizer__weight_decay_exclude_named_params": [".*qkv_proj.bias"],
    }
    config = load_config(write(tmp_path, tiny(tmp_path, **changes)))
    model = config.model.model_config_
    assert model.qkv_bias and model.no_rope_layers == [1, 3]  # nanotron: (i + 1) % 2 == 0
    assert model.sliding_window == 8 and model.full_attention_layers == [1, 3]
    assert config.optimizer.weight_decay_exclude_named_params == [r"layers\.\d+\.self_attn\.qkv_proj\.bias$"]


def test_femtotron_rules_on_a_translated_config_name_the_nanotron_yaml_lines(tmp_path):
    path = write(tmp_path, tiny(tmp_path, parallelism__context_parallel_size=3))
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    text = path.read_text().splitlines()
    cp = [p for p in caught.value.problems if "parallelism.cp" in p.fields]
    assert cp, str(caught.value)
    where = cp[0].locations[cp[0].fields.index("parallelism.cp")]
    assert text[int(where.removeprefix("line ")) - 1].strip() == "context_parallel_size: 3"


@pytest.mark.distributed
def test_train_runs_a_nanotron_config_and_its_run_directory_holds_femtotron_s(tmp_path):
    dataset = write_patterned_tokens(tmp_path / "tokens")
    model = {**tiny(tmp_path)["model"]["model_config"], **TINY_MODEL}
    config = tiny(
        tmp_path,
        parallelism={"dp": 1, "tp": 1, "pp": 1, "tp_mode": "ALL_REDUCE", "expert_parallel_size": 1},
        model__model_config=model,
        model__dtype="float32",
        tokenizer={"tokenizer_name_or_path": None},
        tokens__sequence_length=32,
        tokens__train_steps=2,
        data_stages__0__data__dataset={"dataset_folder": dataset},
        logging__iteration_step_info_interval=1,
    )
    path = write(tmp_path, config)
    output = f"logging.output_dir={tmp_path / 'runs'}"  # overrides are femtotron's keys: nanotron has none
    done = femtotron("train", str(path), output)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("is a nanotron config; translated") == 1
    saved = tmp_path / "runs" / "tiny_llama" / "config.yaml"
    assert not is_nanotron(yaml.safe_load(saved.read_text()))
    assert load_config(saved) == load_config(path, [output])


@pytest.mark.distributed
def test_a_nanotron_config_at_dp2_tp2_pp2_trains_as_femtotron_s_own_config_of_the_run(tmp_path):
    """The same run written as nanotron writes it (two data stages, its keys) and in femtotron's own keys,
    both trained by `femtotron train` on 8 processes: the same losses, step for step, bit for bit."""
    first = write_patterned_tokens(tmp_path / "first")
    second = write_patterned_tokens(tmp_path / "second", seed=1)
    model = {**tiny(tmp_path)["model"]["model_config"], **TINY_MODEL, "num_hidden_layers": 4}
    layout = {"dp": 2, "tp": 2, "pp": 2, "pp_engine": "1f1b", "tp_mode": "REDUCE_SCATTER"}
    config = tiny(
        tmp_path,
        parallelism={**layout, "expert_parallel_size": 1, "tp_linear_async_communication": True},
        model__model_config={**model, "z_loss_enabled": True, "z_loss_coefficient": 1e-3},
        model__dtype="float32",
        tokenizer={"tokenizer_name_or_path": None},
        tokens={
            "sequence_length": 32,
            "train_steps": 4,
            "micro_batch_size": 2,
            "batch_accumulation_per_replica": 2,
        },
        optimizer__weight_decay_exclude_named_params=[".*layernorm.*", ".*final_layer_norm.*"],
        checkpoints={"checkpoint_interval": 0, "checkpoints_path": str(tmp_path / "checkpoints")},
    )
    config["data_stages"] = [
        {
            "name": "decay",
            "start_training_step": 3,
            "data": {
                "dataset": {"dataset_folder": [first, second], "dataset_weights": [0.5, 0.5]},
                "seed": 3,
            },
        },
        {
            "name": "stable",
            "start_training_step": 1,
            "data": {"dataset": {"dataset_folder": first}, "seed": 3},
        },
    ]
    own = {
        "general": {"project": "debug", "run": "own", "seed": 42},
        "model": {
            "model_config": {
                **TINY_MODEL,
                "num_hidden_layers": 4,
                "tie_word_embeddings": True,
                "rms_norm_eps": 1e-5,
                "max_position_embeddings": 256,
                "logits_z_loss_coef": 1e-3,
            },
            "init_method": {"std": 0.025},
            "dtype": "float32",
        },
        "parallelism": layout,
        "tokens": {
            "sequence_length": 32,
            "train_steps": 4,
            "micro_batch_size": 2,
            "batch_accumulation_per_replica": 2,
        },
        "optimizer": {
            "weight_decay_exclude_named_params": [
                r"layers\.\d+\.input_layernorm\.weight$",
                r"layers\.\d+\.post_attention_layernorm\.weight$",
                r"norm\.weight$",
            ],
            "learning_rate_scheduler": {
                **config["optimizer"]["learning_rate_scheduler"],
                "lr_decay_style": "cosine",
            },
        },
        "data": {
            "stages": [
                {"name": "stable", "start_training_step": 1, "dataset_folder": first, "seed": 3},
                {
                    "name": "decay",
                    "start_training_step": 3,
                    "dataset_folder": {first: 0.5, second: 0.5},
                    "seed": 3,
                },
            ]
        },
        "logging": {"output_dir": str(tmp_path / "runs")},
    }
    output = f"logging.output_dir={tmp_path / 'runs'}"
    nanotron_run = femtotron("train", str(write(tmp_path, config)), output, timeout=600)
    assert nanotron_run.returncode == 0, nanotron_run.stderr
    own_run = femtotron("train", str(write(tmp_path, own, "own.yaml")), timeout=600)
    assert own_run.returncode == 0, own_run.stderr

    def losses(run: str) -> list[float]:
        records = (tmp_path / "runs" / run / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["loss"] for line in records if "loss" in json.loads(line)]

    assert len(losses("tiny_llama")) == 4 and losses("tiny_llama") == losses("own")
    assert "step 3: data stage 2 of 2, 'decay'" in nanotron_run.stdout
