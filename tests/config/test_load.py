"""YAML loading (L2): every problem at once, each with dotted path, YAML line, value and fix; overrides."""

import subprocess
import sys
import textwrap

import pytest

from femtotron.config import load_config, load_config_dict
from femtotron.errors import ConfigError

GOOD = """\
model:
  model_config:
    num_hidden_layers: 2
    hidden_size: 64
    num_attention_heads: 4
    num_key_value_heads: 2
    intermediate_size: 96
    vocab_size: 128
    max_position_embeddings: 64
parallelism:
  dp: 1
  tp: 1
  pp: 1
tokens:
  sequence_length: 32
  train_steps: 10
data:
  dataset_folder: data/tiny
"""


def write(tmp_path, text: str):
    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def errors(tmp_path, text: str, overrides=()) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), overrides)
    assert info.value.exit_code == 2
    return info.value


def find(error: ConfigError, path: str):
    matches = [p for p in error.problems if p.path == path]
    assert matches, f"no problem for {path} in:\n{error}"
    return str(matches[0])


def test_good_config_loads(tmp_path):
    cfg = load_config(write(tmp_path, GOOD))
    assert cfg.model.model_config_.hidden_size == 64 and cfg.tokens.train_steps == 10


def test_guide_snippet_style_loads(tmp_path):
    cfg = load_config(
        write(
            tmp_path,
            """\
        model:
          model_config: {num_hidden_layers: 2, hidden_size: 256}
        parallelism: {dp: 1, tp: 1, pp: 1}
        tokens: {train_steps: 5}
        data: {dataset_folder: data/x}
        """,
        )
    )
    assert cfg.model.model_config_.num_hidden_layers == 2 and cfg.model.model_config_.hidden_size == 256


def test_L2_wrong_type_names_path_line_and_value(tmp_path):
    error = errors(tmp_path, GOOD.replace("tp: 1", "tp: two"))
    assert find(error, "parallelism.tp") == (
        "parallelism.tp (line 12): must be a valid integer, unable to parse string as an integer; got 'two' "
        "(str)"
    )


def test_out_of_range(tmp_path):
    error = errors(tmp_path, GOOD.replace("sequence_length: 32", "sequence_length: 0"))
    assert find(error, "tokens.sequence_length") == (
        "tokens.sequence_length (line 15): must be greater than 0; got 0 (int)"
    )


def test_bad_literal_lists_choices(tmp_path):
    error = errors(tmp_path, GOOD.replace("  pp: 1\n", "  pp: 1\n  tp_mode: ALLREDUCE\n"))
    assert "parallelism.tp_mode (line 14): must be 'ALL_REDUCE' or 'REDUCE_SCATTER'; got 'ALLREDUCE'" in find(
        error, "parallelism.tp_mode"
    )


def test_a_zero_stage_past_3_is_refused_with_its_line_not_treated_as_3(tmp_path):
    error = find(errors(tmp_path, GOOD + "optimizer:\n  zero_stage: 4\n"), "optimizer.zero_stage")
    assert "optimizer.zero_stage (line 20): zero_stage=4 does not exist" in error
    assert "Fix: zero_stage=3" in error


@pytest.mark.parametrize("setting", ["reshard_after_forward", "reduce_every_micro_batch"])
def test_a_zero3_setting_without_zero3_is_refused_as_changing_nothing(tmp_path, setting):
    yaml_text = GOOD + f"optimizer:\n  zero_stage: 2\n  {setting}: false\n"
    error = find(errors(tmp_path, yaml_text), f"optimizer.{setting}")
    assert "zero_stage=2 does not shard the parameters, so it would change nothing" in error
    assert f"Fix: remove optimizer.{setting}, or set optimizer.zero_stage=3" in error


def test_unknown_key_did_you_mean_without_noise(tmp_path):
    error = errors(tmp_path, GOOD.replace("hidden_size: 64", "hiden_size: 64"))
    assert [str(p) for p in error.problems] == [
        "model.model_config.hiden_size (line 4): unknown key 'hiden_size' in model.model_config; "
        "did you mean 'hidden_size'?"
    ]  # no follow-on complaint about the default hidden_size


def test_unknown_section_did_you_mean(tmp_path):
    error = errors(tmp_path, GOOD.replace("parallelism:", "parallelisms:"))
    assert "did you mean 'parallelism'?" in find(error, "parallelisms")


def test_key_in_wrong_section_says_where_it_belongs(tmp_path):
    error = errors(tmp_path, GOOD + "optimizer:\n  train_steps: 3\n")
    assert "belongs at tokens.train_steps" in find(error, "optimizer.train_steps")


def test_unknown_key_without_close_match_lists_valid_keys(tmp_path):
    error = errors(tmp_path, GOOD + "logging:\n  comet: true\n")
    assert "valid keys here: output_dir, iteration_step_info_interval, log_level, tensorboard, wandb" in find(
        error, "logging.comet"
    )


def test_L2_several_problems_reported_at_once(tmp_path):
    text = (
        GOOD.replace("tp: 1", "tp: two")
        .replace("hidden_size: 64", "hiden_size: 64")
        .replace("pp: 1", "pp: 4")
        .replace("train_steps: 10", "train_steps: 1.5")
    )
    error = errors(tmp_path, text)
    assert {p.path for p in error.problems} == {
        "parallelism.tp",
        "model.model_config.hiden_size",
        "tokens.train_steps",
        "model.model_config.num_hidden_layers",
    }
    assert "4 problems" in str(error)
    assert "model.model_config.num_hidden_layers (line 3), parallelism.pp (line 13)" in str(error)


def test_missing_required_field_says_where_to_add_it(tmp_path):
    error = errors(tmp_path, GOOD.replace("  train_steps: 10\n", ""))
    assert find(error, "tokens.train_steps") == (
        "tokens.train_steps (not set): required field is missing (number of optimizer steps, an integer "
        ">= 1); add it under 'tokens:' (line 14)"
    )


def test_missing_required_section(tmp_path):
    error = errors(tmp_path, GOOD.split("data:")[0])
    assert "add a 'data:' section" in find(error, "data")


def test_rule_violation_cites_every_field_line(tmp_path):
    error = errors(tmp_path, GOOD.replace("tp: 1", "tp: 4"))
    (problem,) = error.problems
    assert str(problem).startswith(
        "model.model_config.num_attention_heads (line 5), model.model_config.num_key_value_heads (line 6), "
        "parallelism.tp (line 12): "
    )
    assert "tp values that would work: 1, 2" in str(problem)


def test_rule_with_a_default_field_says_default(tmp_path):
    error = errors(tmp_path, GOOD.replace("    max_position_embeddings: 64\n", "").replace("32", "4096"))
    assert "model.model_config.max_position_embeddings (default)" in str(error)


def test_no_cross_field_noise_from_unparsed_fields(tmp_path):
    text = GOOD.replace("tp: 1", "tp: two").replace("num_key_value_heads: 2", "num_key_value_heads: 3")
    error = errors(tmp_path, text)
    assert {p.path for p in error.problems} == {"parallelism.tp", "model.model_config.num_attention_heads"}


def test_yaml_syntax_error_has_line_and_column(tmp_path):
    error = errors(tmp_path, "model:\n  model_config: {hidden_size: 64\ntokens: 1\n")
    assert "YAML syntax error at line 3, column 7" in str(error)


def test_tabs_get_a_hint(tmp_path):
    assert "never tabs" in str(errors(tmp_path, "model:\n\thidden_size: 3\n"))


def test_duplicate_key_is_reported(tmp_path):
    error = errors(tmp_path, GOOD + "tokens:\n  train_steps: 20\n")
    assert "duplicate key (also set at line 14)" in find(error, "tokens")
    assert [p.path for p in error.problems] == ["tokens", "tokens.sequence_length"]  # lines of the kept block
    assert "tokens.sequence_length (default)" in str(error)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="file not found") as info:
        load_config(tmp_path / "nope.yaml")
    assert "nope.yaml" in str(info.value)


@pytest.mark.parametrize("text", ["", "- a\n- b\n", "just a string\n"])
def test_top_level_must_be_a_mapping(tmp_path, text):
    assert "top level must be a mapping" in str(errors(tmp_path, text))


def test_dataset_folder_shape_error(tmp_path):
    error = errors(tmp_path, GOOD.replace("dataset_folder: data/tiny", "dataset_folder: [a, [b]]"))
    assert "data.dataset_folder (line 18): must be a .bin/.idx path prefix or directory" in str(error)


def test_dict_source_never_leaks_validation_error():
    with pytest.raises(ConfigError) as info:
        load_config_dict(
            {"tokens": "many", "data": {"dataset_folder": 3}, "parallelism": None}, source="test"
        )
    assert {p.path for p in info.value.problems} == {"tokens", "data.dataset_folder", "parallelism"}
    assert "Invalid config test" in str(info.value)


# --- command line overrides ---


def test_override_applies(tmp_path):
    overrides = [
        "tokens.train_steps=50",
        "optimizer.clip_grad=null",
        "data.dataset_folder={a: 1, b: 3}",
        "checkpoints.checkpoint_interval=5",
    ]  # no checkpoints section in GOOD: it is created
    cfg = load_config(write(tmp_path, GOOD), overrides)
    assert cfg.tokens.train_steps == 50 and cfg.optimizer.clip_grad is None
    assert cfg.data.dataset_folder == {"a": 1.0, "b": 3.0} and cfg.checkpoints.checkpoint_interval == 5


def test_override_float_in_exponent_form(tmp_path):
    cfg = load_config(write(tmp_path, GOOD), ["optimizer.learning_rate_scheduler.learning_rate=1e-3"])
    assert cfg.optimizer.learning_rate_scheduler.learning_rate == 1e-3


def test_override_unknown_key_did_you_mean(tmp_path):
    error = errors(tmp_path, GOOD, ["parallelism.tpp=2"])
    assert find(error, "parallelism.tpp") == (
        "parallelism.tpp (command line override 'parallelism.tpp=2'): unknown key 'tpp' in parallelism; "
        "did you mean 'tp' or 'pp'?"
    )


def test_override_without_equals_is_reported_with_the_rest(tmp_path):
    error = errors(tmp_path, GOOD.replace("tp: 1", "tp: two"), ["foo"])
    assert "foo (command line override 'foo'): an override must look like section.key=value" in find(
        error, "foo"
    )
    assert "parallelism.tp (line 12)" in find(error, "parallelism.tp")


def test_override_value_is_located_on_the_command_line(tmp_path):
    error = errors(tmp_path, GOOD, ["parallelism.tp=two"])
    assert "parallelism.tp (command line override 'parallelism.tp=two')" in find(error, "parallelism.tp")


def test_override_into_a_scalar(tmp_path):
    error = errors(tmp_path, GOOD, ["tokens.train_steps.x=1"])
    assert "tokens.train_steps is 10, not a section" in find(error, "tokens.train_steps.x")


def test_override_on_dict_source():
    data = {"tokens": {"train_steps": 1}, "data": {"dataset_folder": "d"}}
    cfg = load_config_dict(data, overrides=["parallelism.dp=2"])
    assert cfg.parallelism.dp == 2


def alias_bomb(levels: int) -> str:
    """Each level an anchored list of nine aliases to the one before: 9**levels values, ~50 bytes a level."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


# Loads a config through the command line in a fresh process, then prints its peak memory (KiB).
MEASURED = """
import resource, sys
from femtotron.cli import main
try:
    sys.exit(main(["doctor", sys.argv[1]]))
finally:
    print("maxrss", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)
"""


@pytest.mark.distributed
def test_E1_yaml_alias_bomb_is_refused_in_little_time_and_memory(tmp_path):
    """~500 bytes that expand to 3.9e9 values: walking every alias path took minutes and gigabytes."""
    path = tmp_path / "config.yaml"
    path.write_text(alias_bomb(9))
    command = [sys.executable, "-c", MEASURED, str(path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert str(path) in result.stderr and "more than 100,000 values" in result.stderr
    assert "Traceback" not in result.stderr
    assert int(result.stderr.rsplit("maxrss", 1)[1]) < 1024 * 1024  # KiB: under 1 GiB


def test_E1_alias_within_the_limit_still_loads(tmp_path):
    cfg = load_config(
        write(
            tmp_path,
            GOOD.replace(
                "data:\n  dataset_folder: data/tiny",
                "data:\n  dataset_folder: &d data/tiny\n  validation_folder: *d",
            ),
        )
    )
    assert cfg.data.validation_folder == "data/tiny"


def test_alias_inside_itself_is_refused(tmp_path):
    error = errors(tmp_path, GOOD + "general: &g {project: *g}\n")
    assert "inside itself" in str(error)


def test_deeply_nested_yaml_is_refused(tmp_path):
    error = errors(tmp_path, GOOD + "general: " + "[" * 5000 + "]" * 5000 + "\n")
    assert "nested too deeply" in str(error)


MOE = """\
    moe:
      num_experts: 4
      num_experts_per_tok: 2
      intermediate_size: 48
      aux_los_coef: 0.1
"""


def test_misspelt_key_in_an_optional_section_names_it(tmp_path):
    """moe is `MoEConfig | None`: the lookup of its keys raised AttributeError on the union."""
    error = errors(tmp_path, GOOD.replace("parallelism:\n", MOE + "parallelism:\n"))
    assert "did you mean 'aux_loss_coef'" in find(error, "model.model_config.moe.aux_los_coef")


def test_key_of_an_optional_section_in_the_wrong_place_says_where_it_belongs(tmp_path):
    error = errors(tmp_path, GOOD.replace("  dp: 1\n", "  dp: 1\n  num_experts_per_tok: 2\n"))
    assert "model.model_config.moe.num_experts_per_tok" in find(error, "parallelism.num_experts_per_tok")


def test_deeply_nested_dict_is_refused():
    """A config embedded in a manifest's JSON: deep nesting raised RecursionError while it was copied."""
    nested: list = []
    for _ in range(900):
        nested = [nested]
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_config_dict({"general": nested}, source="manifest.json")


def test_a_number_of_more_digits_than_python_reads_is_refused_with_its_line(tmp_path):
    """YAML's int() of 5,000 digits raised Python's ValueError (a 4,300-digit limit) from inside yaml."""
    error = errors(tmp_path, GOOD.replace("train_steps: 10", "train_steps: " + "9" * 5000))
    assert "line 16: a number of 5,000 digits (999999999999...): Python reads at most 4,300" in str(error)


def test_an_override_of_more_digits_than_python_reads_is_refused_naming_its_field(tmp_path):
    error = errors(tmp_path, GOOD, [f"tokens.train_steps={'9' * 5000}"])
    problem = find(error, "tokens.train_steps")
    assert "a number of 5,000 digits" in problem and "9" * 100 not in problem


def test_a_config_file_over_1_mib_is_refused_before_it_is_parsed(tmp_path):
    """A 50 MB or a 200,000-key YAML took minutes to load; /dev/zero was read until memory ran out."""
    path = write(tmp_path, GOOD + "#" * 2**20 + "\n")
    with pytest.raises(ConfigError, match=f"Cannot load config {path}:\n  - larger than 1 MiB"):
        load_config(path)
    with pytest.raises(ConfigError, match="1,048,576 bytes"):
        load_config("/dev/zero")
    assert load_config(write(tmp_path, GOOD + "#" * (2**20 - len(GOOD) - 1) + "\n"))  # 1 MiB exactly


def test_a_position_count_beyond_any_machine_is_refused_naming_its_line(tmp_path):
    """max_position_embeddings: 10^30 loaded, and doctor's RoPE tables overflowed the meta device."""
    huge = f"max_position_embeddings: {10**30}"
    error = errors(tmp_path, GOOD.replace("max_position_embeddings: 64", huge))
    problem = find(error, "model.model_config.max_position_embeddings")
    assert "(line 9)" in problem and "elements in each of RoPE's tables" in problem


def test_a_date_that_does_not_exist_is_refused_not_raised(tmp_path):
    """YAML reads 2001-13-45 as a date, and its constructor raised ValueError from inside yaml."""
    error = errors(tmp_path, GOOD.replace("train_steps: 10", "train_steps: 2001-13-45"))
    assert "a value cannot be read (month must be in 1..12); quote it" in str(error)
    error = errors(tmp_path, GOOD, ["tokens.train_steps=2001-13-45"])
    assert "the value '2001-13-45' cannot be read (month must be in 1..12)" in find(
        error, "tokens.train_steps"
    )
