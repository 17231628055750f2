"""`femtotron import-hf` and `export-hf`, proven with transformers itself on models transformers wrote."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from femtotron.cli import main
from femtotron.config import load_config
from femtotron.data.tokenizer import load_tokenizer
from femtotron.errors import FemtotronError, PathError
from femtotron.generate import load_run
from femtotron.parallel.context import ParallelContext
from femtotron.serialize.hf import HFError, export_hf, import_hf
from femtotron.trainer import Trainer

SHAPE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA
    max_position_embeddings=64,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
)


def hf_directory(path, tied=False, shard="40KB", **changes):
    """A random LlamaForCausalLM saved by transformers, sharded into several safetensors files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**SHAPE, **changes}, tie_word_embeddings=tied)).float().eval()
    model.save_pretrained(path, max_shard_size=shard)
    return model


def logits_close(ours, theirs):
    assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max(), (ours - theirs).abs().max()


@pytest.mark.parametrize("tied", [False, True])
def test_an_imported_model_gives_transformers_logits_and_exports_back_bit_identical(tmp_path, tied):
    hf = hf_directory(tmp_path / "hf", tied)
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()  # several shards
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    config, ours = load_run(tmp_path / "run")
    assert (
        config.model.model_config_.rope_theta == 500000.0
        and config.model.model_config_.tie_word_embeddings == tied
    )
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 24))
    with torch.no_grad():
        logits_close(ours.logits(ids), hf(ids).logits)

    assert (
        main(["export-hf", str(tmp_path / "run"), "--out", str(tmp_path / "back"), "--shard-size", "30KB"])
        == 0
    )
    original = _tensors(tmp_path / "hf")
    exported = _tensors(tmp_path / "back")
    assert original.keys() == exported.keys()
    assert all(torch.equal(original[name], exported[name]) for name in original)


def test_a_tied_checkpoint_that_also_lists_its_head_imports(tmp_path):
    """transformers 5 leaves a tied model's lm_head.weight out; older versions and other tools write it,
    as a copy of the embedding. Both are the same model."""
    hf = hf_directory(tmp_path / "hf", tied=True, shard="10MB")
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert "lm_head.weight" not in weights
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    config, ours = load_run(tmp_path / "run")
    assert config.model.model_config_.tie_word_embeddings
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 24))
    with torch.no_grad():
        logits_close(ours.logits(ids), hf(ids).logits)


def test_training_an_imported_config_continues_from_the_import_in_a_run_of_its_own(
    tmp_path, tiny_dataset, capsys
):
    """`import-hf`, then `train OUT/config.yaml data.dataset_folder=... tokens.train_steps=3`: the run starts
    from the imported weights (model.init_from) in OUT-train, its schedule follows its own train_steps (it
    was at the floor from step 1), step 1 is not warned about as a fresh model, and the import is left as
    it was. Training in the import's own directory is refused: the run would overwrite weights it did not
    produce."""
    hf_directory(tmp_path / "hf", vocab_size=256)
    imported = tmp_path / "run_hf"
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(imported)]) == 0
    before = {p.name: p.read_bytes() for p in imported.iterdir() if p.is_file()}
    overrides = [f"data.dataset_folder={tiny_dataset}", "tokens.train_steps=3"]
    capsys.readouterr()
    assert main(["train", str(imported / "config.yaml"), *overrides]) == 0
    out = capsys.readouterr().out
    assert f"initialised the weights from {imported.resolve()} (model.init_from)" in out
    assert "should start near ln(vocab_size)" not in out
    records = [
        json.loads(line) for line in (tmp_path / "run_hf-train" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["lr"] for r in records] == pytest.approx(
        [3e-4, 1.5e-4, 0.0]
    )  # over 3 steps, not the import's 1
    assert (tmp_path / "run_hf-train" / "model.safetensors").is_file()
    assert {p.name: p.read_bytes() for p in imported.iterdir() if p.is_file()} == before

    assert main(["train", str(imported / "config.yaml"), *overrides, "general.run=run_hf"]) == 2
    assert (
        f"{imported / 'model.safetensors'} holds weights this run did not produce (imported from "
        f"{tmp_path / 'hf'}): training in {imported} would overwrite them" in capsys.readouterr().err
    )
    assert {p.name: p.read_bytes() for p in imported.iterdir() if p.is_file()} == before


def test_llama3_rope_scaling_gives_transformers_logits_in_and_out(tmp_path):
    """Llama 3.1/3.2's RoPE: frequencies slowed past an original context of 32 positions; 100 tokens."""
    from transformers import LlamaForCausalLM

    rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0}
    rope.update(high_freq_factor=4.0, original_max_position_embeddings=32)
    hf = hf_directory(tmp_path / "hf", max_position_embeddings=128, rope_parameters=rope)
    import_hf(tmp_path / "hf", tmp_path / "run")
    config, ours = load_run(tmp_path / "run")
    assert config.model.model_config_.rope_scaling.factor == 8.0
    ids = torch.randint(0, SHAPE["vocab_size"], (1, 100))
    export_hf(tmp_path / "run", tmp_path / "back")
    back = LlamaForCausalLM.from_pretrained(tmp_path / "back").float().eval()
    with torch.no_grad():
        logits_close(ours.logits(ids), hf(ids).logits)
        logits_close(back(ids).logits, hf(ids).logits)


MOE = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, intermediate_size=32)),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        # Top-2 of 4: Qwen2MoeConfig's default k routes to all 4, where renormalising changes nothing.
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            qkv_bias=False,
        ),
    ),
}


@pytest.mark.parametrize(
    "kind, changes",
    [("mixtral", {}), ("qwen2_moe", {"norm_topk_prob": False}), ("qwen2_moe", {"norm_topk_prob": True})],
)
def test_mixture_of_experts_models_give_transformers_logits_in_and_out(tmp_path, kind, changes):
    """Mixtral (top-2 of 4 experts, renormalised) and Qwen2-MoE (shared experts with a sigmoid gate, top-k
    probabilities as they are or renormalised), written by transformers in their checkpoints' per-expert
    layout: femtotron's logits equal theirs, and the export is the same files, which transformers loads."""
    import transformers

    config_name, model_name, shape = MOE[kind]
    model_class = getattr(transformers, model_name)
    torch.manual_seed(0)
    hf = model_class(getattr(transformers, config_name)(**{**SHAPE, **shape, **changes})).float().eval()
    with torch.no_grad():  # weights large enough that the routing differs between tokens
        for param in hf.parameters():
            param.normal_(0.0, 0.1)
    hf.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "run")
    config, ours = load_run(tmp_path / "run")
    assert config.model.model_config_.moe.num_experts == 4
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 24))
    export_hf(tmp_path / "run", tmp_path / "back", shard_bytes=30_000)
    back = model_class.from_pretrained(tmp_path / "back").float().eval()
    with torch.no_grad():
        logits_close(ours.logits(ids), hf(ids).logits)
        logits_close(back(ids).logits, hf(ids).logits)
    original = _tensors(tmp_path / "hf")
    exported = _tensors(tmp_path / "back")
    assert original.keys() == exported.keys()
    assert all(torch.equal(original[name], exported[name]) for name in original)


def _tensors(directory):
    out = {}
    for file in directory.glob("*.safetensors"):
        out.update(load_file(str(file)))
    return out


def test_an_export_from_a_checkpoint_saved_at_another_mesh_loads_in_transformers(tiny_config, tmp_path):
    """No consolidate step: the checkpoint's slices are gathered by export-hf itself. The checkpoint here is a
    one-process one rewritten for dp=2 tp=2 pp=2 (8 rank files); transformers gets femtotron's logits."""
    from transformers import LlamaForCausalLM

    config = tiny_config(
        "general.run=export",
        "model.model_config.num_hidden_layers=4",
        "checkpoints.checkpoint_interval=2",
        "tokens.train_steps=2",
    )
    Trainer(config, ParallelContext(), log_to_console=False).train()
    mesh = ["--dp", "2", "--tp", "2", "--pp", "2"]
    assert main(["reshard", str(config.run_dir / "checkpoints"), "--out", str(tmp_path / "mesh"), *mesh]) == 0
    assert (
        main(["export-hf", str(tmp_path / "mesh"), "--out", str(tmp_path / "hf"), "--dtype", "float32"]) == 0
    )
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_hidden_layers"] == 4
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
    _, ours = load_run(config.run_dir)  # the same weights, as the run saved them at its end
    ids = torch.randint(0, config.model.model_config_.vocab_size, (2, 16))
    with torch.no_grad():
        logits_close(ours.logits(ids), hf(ids).logits)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"attention_bias": True}, "attention_bias=True: femtotron's model has none"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0}}, "rope type 'yarn'"),
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures=['GPT2LMHeadModel']"),
    ],
)
def test_a_model_femtotron_does_not_compute_is_refused_naming_the_field(tmp_path, change, message):
    hf_directory(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(HFError, match=re.escape(message)):
        import_hf(tmp_path / "hf", tmp_path / "run")


def test_bad_directories_get_clear_errors(tmp_path):
    with pytest.raises(PathError, match="config.json does not exist"):  # exit 1: a path given
        import_hf(tmp_path, tmp_path / "run")
    hf_directory(tmp_path / "sharded")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / "sharded" / shard).unlink()
    with pytest.raises(HFError, match=f"lists {shard}, which"):
        import_hf(tmp_path / "sharded", tmp_path / "run")

    hf_directory(tmp_path / "one", shard="1GB")
    weights = load_file(str(tmp_path / "one" / "model.safetensors"))
    weights["model.norm.weight"] = torch.ones(32)
    save_file(weights, str(tmp_path / "one" / "model.safetensors"))
    with pytest.raises(
        HFError, match=r"model.norm.weight .* has shape \(32,\), but config.json makes it \(64,\)"
    ):
        import_hf(tmp_path / "one", tmp_path / "run")

    (tmp_path / "one" / "model.safetensors").unlink()
    (tmp_path / "one" / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(HFError, match="pickles .*pytorch_model.bin.* can run any code"):
        import_hf(tmp_path / "one", tmp_path / "run")
    assert main(["import-hf", str(tmp_path / "one"), "--out", str(tmp_path / "run")]) == 2


def test_the_shard_size_is_checked():
    with pytest.raises(SystemExit):
        main(["export-hf", "run", "--out", "hf", "--dtype", "int8"])
    assert main(["export-hf", "run", "--out", "hf", "--shard-size", "lots"]) == 2


def test_export_writes_what_transformers_expects(tmp_path):
    hf_directory(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "run")
    export_hf(tmp_path / "run", tmp_path / "back", dtype="bfloat16", shard_bytes=10**9)
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "bfloat16"
    assert (tmp_path / "back" / "generation_config.json").is_file()
    assert not (tmp_path / "back" / "model.safetensors.index.json").exists()  # one file when it fits
    assert all(
        t.dtype == torch.bfloat16 for t in load_file(str(tmp_path / "back" / "model.safetensors")).values()
    )


TOKENIZER = Path(__file__).resolve().parents[2] / "examples" / "tokenizer.json"


@pytest.fixture
def hf_with_tokenizer(tmp_path):
    """An HF directory in one safetensors file, with a tokenizer.json, and a secret file outside it."""
    hf_directory(tmp_path / "hf", shard="1GB")
    shutil.copyfile(TOKENIZER, tmp_path / "hf" / "tokenizer.json")
    (tmp_path / "secret.txt").write_text("the user's own file")
    return tmp_path / "hf"


def test_W1_import_and_export_replace_a_symlinked_tokenizer_in_out_instead_of_writing_through_it(
    hf_with_tokenizer, tmp_path
):
    secret = tmp_path / "secret.txt"
    for out in (tmp_path / "run", tmp_path / "back"):
        out.mkdir()
        (out / "tokenizer.json").symlink_to(secret)  # as in a git clone of an HF repository
    import_hf(hf_with_tokenizer, tmp_path / "run")
    export_hf(tmp_path / "run", tmp_path / "back")
    assert secret.read_text() == "the user's own file"
    for out in (tmp_path / "run", tmp_path / "back"):
        assert not (out / "tokenizer.json").is_symlink()
        assert (out / "tokenizer.json").read_bytes() == TOKENIZER.read_bytes()


def test_an_exported_tokenizer_names_its_special_tokens_for_transformers(hf_with_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    import_hf(hf_with_tokenizer, tmp_path / "run")
    export_hf(tmp_path / "run", tmp_path / "back")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "back")
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>" and tokenizer.eos_token_id == 0
    # generation stops where the imported directory's generation_config.json said (transformers' default 2)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["eos_token_id"] == 2
    assert json.loads((tmp_path / "back" / "generation_config.json").read_text())["eos_token_id"] == 2


def test_an_import_without_a_tokenizer_says_how_to_sample_from_it(tmp_path, capsys):
    hf_directory(tmp_path / "hf")
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "without a tokenizer" in out and f"copy the model's tokenizer.json into {tmp_path / 'run'}" in out
    assert main(["generate", str(tmp_path / "run"), "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert f"copy the model's tokenizer.json into {tmp_path / 'run'}" in err and "train again" not in err


@pytest.mark.parametrize("file", ["tokenizer.json", "model.safetensors"])
def test_X3_a_file_linked_from_outside_the_directory_is_refused_naming_it(hf_with_tokenizer, tmp_path, file):
    outside = tmp_path / "elsewhere" / file
    outside.parent.mkdir()
    shutil.move(hf_with_tokenizer / file, outside)
    (hf_with_tokenizer / file).symlink_to(outside)
    with pytest.raises(HFError, match=f"{file} .*outside {hf_with_tokenizer}"):
        import_hf(hf_with_tokenizer, tmp_path / "run")
    assert not (tmp_path / "run" / "tokenizer.json").exists()


@pytest.mark.parametrize("absolute", [False, True], ids=["dot-dot", "absolute"])
def test_X4_an_index_entry_outside_the_directory_is_refused_naming_it(tmp_path, absolute):
    hf_directory(tmp_path / "hf")
    index_path = tmp_path / "hf" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    (tmp_path / "elsewhere").mkdir()
    shutil.copyfile(tmp_path / "hf" / shard, tmp_path / "elsewhere" / shard)
    entry = str(tmp_path / "elsewhere" / shard) if absolute else f"../elsewhere/{shard}"
    index["weight_map"] = {
        name: entry if file == shard else file for name, file in index["weight_map"].items()
    }
    index_path.write_text(json.dumps(index))
    with pytest.raises(HFError, match=f"{re.escape(entry)} .*outside {tmp_path / 'hf'}"):
        import_hf(tmp_path / "hf", tmp_path / "run")


def test_the_hugging_face_cache_layout_with_links_into_its_blobs_is_read(hf_with_tokenizer, tmp_path):
    """huggingface_hub keeps repo/snapshots/REVISION/FILE as links to repo/blobs/SHA: inside the repo."""
    repo = tmp_path / "models--someone--tiny"
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(p.name for p in hf_with_tokenizer.iterdir())):
        shutil.move(hf_with_tokenizer / file, repo / "blobs" / f"sha{i}")
        (snapshot / file).symlink_to(f"../../blobs/sha{i}")
    import_hf(snapshot, tmp_path / "run")
    assert (tmp_path / "run" / "tokenizer.json").read_bytes() == TOKENIZER.read_bytes()


def test_S1_an_export_over_an_earlier_one_with_other_shards_leaves_no_stale_weights(
    hf_with_tokenizer, tmp_path
):
    import_hf(hf_with_tokenizer, tmp_path / "run")
    export_hf(tmp_path / "run", tmp_path / "back", shard_bytes=30_000)
    assert (tmp_path / "back" / "model.safetensors.index.json").is_file()
    (tmp_path / "back" / "README.md").write_text("the user's")
    export_hf(tmp_path / "run", tmp_path / "back", dtype="bfloat16")
    assert sorted(p.name for p in (tmp_path / "back").iterdir()) == [
        "README.md",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    export_hf(tmp_path / "run", tmp_path / "back", shard_bytes=30_000)
    assert not (tmp_path / "back" / "model.safetensors").exists()


def run_cli(*args, crash_at=None):
    env = {key: value for key, value in os.environ.items() if not key.startswith("FEMTOTRON_CRASH")}
    if crash_at:
        env["FEMTOTRON_CRASH_AT"] = crash_at
    command = [sys.executable, "-m", "femtotron.cli", *map(str, args)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.distributed
def test_S8_an_export_killed_while_moving_its_files_in_leaves_a_directory_generate_refuses(
    hf_with_tokenizer, tmp_path
):
    import_hf(hf_with_tokenizer, tmp_path / "run")
    export_hf(tmp_path / "run", tmp_path / "back", shard_bytes=30_000)
    killed = run_cli("export-hf", tmp_path / "run", "--out", tmp_path / "back", crash_at="outputs.moved_one")
    assert killed.returncode == -signal.SIGKILL
    assert not (tmp_path / "back" / "config.json").exists()  # removed first, moved in last
    with pytest.raises(FemtotronError, match="config.yaml does not exist"):
        load_run(tmp_path / "back")
    again = run_cli("export-hf", tmp_path / "run", "--out", tmp_path / "back")
    assert again.returncode == 0, again.stderr
    assert "left by an earlier run that was killed" in again.stderr
    assert not [p for p in (tmp_path / "back").iterdir() if ".tmp" in p.name]
    load_run(tmp_path / "back")


@pytest.mark.distributed
def test_L2_an_export_from_a_checkpoint_killed_mid_way_is_cleaned_up_by_the_next(tiny_config, tmp_path):
    config = tiny_config("general.run=export", "checkpoints.checkpoint_interval=2", "tokens.train_steps=2")
    Trainer(config, ParallelContext(), log_to_console=False).train()
    checkpoints = config.run_dir / "checkpoints"
    killed = run_cli("export-hf", checkpoints, "--out", tmp_path / "hf", crash_at="atomic.written")
    assert killed.returncode == -signal.SIGKILL
    leftovers = [p.name for p in (tmp_path / "hf").iterdir()]
    assert leftovers and all(".tmp" in name for name in leftovers), leftovers
    again = run_cli("export-hf", checkpoints, "--out", tmp_path / "hf")
    assert again.returncode == 0, again.stderr
    assert all(name in again.stderr for name in leftovers)
    assert not [p for p in (tmp_path / "hf").iterdir() if ".tmp" in p.name]
    assert not [p for p in tmp_path.iterdir() if p.name not in ("hf", "runs", "data")], list(
        tmp_path.iterdir()
    )


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_hidden_layers": 1000}, "num_hidden_layers=1000, but .* holds? 2 layers"),
        ({"num_hidden_layers": 10**9}, "has num_hidden_layers=1000000000: a whole number from 1 to 1024"),
        ({"num_hidden_layers": 1e9}, "has num_hidden_layers=1000000000.0: a whole number from 1 to 1024"),
        (
            {"hidden_size": 2**40, "head_dim": None},
            "vocab_size=128 \\* hidden_size=1099511627776 = .* elements in the embedding, more than",
        ),
        (
            {"intermediate_size": 10**9},
            r"mlp.down_proj.weight .* has shape \(64, 96\), but config.json makes it \(64, 1000000000\)",
        ),
        (
            {"intermediate_size": 2**62},
            "intermediate_size=4611686018427387904 = .* elements in an MLP weight",
        ),
        (
            {"max_position_embeddings": 10**30},
            "max_position_embeddings=10{30} \\* head_dim=16 = .* RoPE's tables",
        ),
    ],
)
def test_E2_a_config_far_larger_than_its_weights_is_refused_from_the_headers_at_once(
    tmp_path, change, message
):
    hf_directory(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    started = time.monotonic()
    with pytest.raises(HFError, match=message):
        import_hf(tmp_path / "hf", tmp_path / "run")
    assert time.monotonic() - started < 10


def test_E2_a_huge_position_count_builds_no_tables_and_generate_refuses_it(tmp_path, capsys):
    hf_directory(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "max_position_embeddings": 2 * 10**8}))
    import_hf(tmp_path / "hf", tmp_path / "run")  # the weights do not depend on it
    assert main(["generate", str(tmp_path / "run"), "--prompt", "hi"]) == 2
    assert "max_position_embeddings=200000000" in capsys.readouterr().err


def test_an_index_whose_weight_map_is_a_list_is_refused(tmp_path):
    hf_directory(tmp_path / "hf")
    index_path = tmp_path / "hf" / "model.safetensors.index.json"
    index_path.write_text(json.dumps({"weight_map": ["model.norm.weight"]}))
    with pytest.raises(HFError, match="weight_map"):
        import_hf(tmp_path / "hf", tmp_path / "run")


def test_an_export_with_a_tokenizer_that_is_not_json_is_refused_before_writing_anything(
    hf_with_tokenizer, tmp_path
):
    import_hf(hf_with_tokenizer, tmp_path / "run")
    (tmp_path / "run" / "tokenizer.json").write_text("not json {")
    with pytest.raises(FemtotronError, match="tokenizer.json cannot be read as a HF tokenizers JSON file"):
        export_hf(tmp_path / "run", tmp_path / "back")
    assert not (tmp_path / "back").exists() or not list((tmp_path / "back").iterdir())


def test_an_output_directory_that_is_the_source_is_refused(hf_with_tokenizer, tmp_path):
    import_hf(hf_with_tokenizer, tmp_path / "run")
    assert main(["export-hf", str(tmp_path / "run"), "--out", str(tmp_path / "run")]) == 2
    assert main(["import-hf", str(hf_with_tokenizer), "--out", str(hf_with_tokenizer)]) == 2
    load_run(tmp_path / "run")
    load_run(hf_with_tokenizer)


def test_an_imported_config_works_from_any_directory(tmp_path, monkeypatch, tiny_dataset):
    """import-hf wrote init_from absolute but the tokenizer and the output directory relative to where it ran:
    from another directory the config named a tokenizer that was not there."""
    hf_directory(tmp_path / "hf", shard="1GB", vocab_size=256)
    shutil.copyfile(TOKENIZER, tmp_path / "hf" / "tokenizer.json")
    monkeypatch.chdir(tmp_path)
    assert main(["import-hf", "hf", "--out", "imported"]) == 0
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    config = load_config(tmp_path / "imported" / "config.yaml", [f"data.dataset_folder={tiny_dataset}"])
    assert config.tokenizer.tokenizer_name_or_path == str(tmp_path / "imported" / "tokenizer.json")
    assert config.model.init_from == str(tmp_path / "imported")
    assert config.run_dir == tmp_path / "imported-train"
    load_tokenizer(config.tokenizer.tokenizer_name_or_path)


@pytest.mark.parametrize(
    "text, message",
    [
        ("[" + json.dumps(dict(SHAPE)) + "]", "config.json holds a JSON list, not an object"),
        ("[" * 100_000 + "]" * 100_000, "config.json is not JSON (RecursionError"),
    ],
    ids=["list", "nested"],
)
def test_a_config_json_that_is_not_an_object_is_refused_naming_it(tmp_path, text, message):
    """A JSON list raised AttributeError (a list has no .get), deep nesting RecursionError."""
    hf_directory(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(text)
    with pytest.raises(HFError, match=re.escape(message)):
        import_hf(tmp_path / "hf", tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rope_parameters": {"rope_type": "default", "rope_theta": float("nan")}}, "rope_theta=nan"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": float("inf")}}, "rope_theta=inf"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 0.0}}, "rope_theta=0.0"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps=nan"),
        ({"rms_norm_eps": float("inf")}, "rms_norm_eps=inf"),
        ({"rms_norm_eps": -1e-5}, "rms_norm_eps=-1e-05"),
        ({"max_position_embeddings": 1e30}, "max_position_embeddings=1e+30"),
    ],
)
def test_a_non_finite_or_non_positive_value_in_config_json_is_refused_naming_it(tmp_path, change, message):
    """NaN and inf (JSON as Python writes it) were imported: a model computing NaN, or RoPE's tables built for
    1e30 positions."""
    hf_directory(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(
        HFError, match=f"config.json holds values femtotron's Llama cannot take: {re.escape(message)}"
    ):
        import_hf(tmp_path / "hf", tmp_path / "run")


def test_a_generation_config_nested_too_deep_is_refused_naming_it(tmp_path):
    hf_directory(tmp_path / "hf")
    (tmp_path / "hf" / "generation_config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(HFError, match="generation_config.json is not a JSON object"):
        import_hf(tmp_path / "hf", tmp_path / "run")
