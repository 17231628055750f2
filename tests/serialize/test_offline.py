"""`femtotron reshard` and `femtotron consolidate`: one process, no cluster; round trips are exact."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from checkpoint_runs import checkpointed_run
from distributed import run_ranks
from helpers import OLMO2_FEATURES
from safetensors.torch import load_file

from femtotron.cli import main
from femtotron.config import load_config_dict
from femtotron.data.tokenizer import train_tokenizer
from femtotron.errors import FemtotronError
from femtotron.generate import generate_text, load_run
from femtotron.mesh import Mesh
from femtotron.parallel.context import ParallelContext
from femtotron.serialize import files
from femtotron.serialize.files import CheckpointError, rank_file
from femtotron.serialize.offline import reshard
from femtotron.serialize.restore import load
from femtotron.trainer import Trainer

TO_2X2X2 = ["--dp", "2", "--tp", "2", "--pp", "2", "optimizer.zero_stage=1"]


def config(tiny_config, run, *more, steps=4):
    return tiny_config(
        f"general.run={run}",
        "model.model_config.num_hidden_layers=4",
        "model.model_config.num_key_value_heads=4",
        "model.model_config.tie_word_embeddings=true",
        "model.dtype=bfloat16",
        "tokens.micro_batch_size=2",
        "tokens.batch_accumulation_per_replica=8",
        f"tokens.train_steps={steps}",
        "parallelism.dp_bucket_size_mb=0.02",
        *more,
    )


@pytest.fixture
def saved(tiny_config):
    """A bf16 run with tied embeddings, checkpointed after 2 steps on one process; and its 4-step losses."""
    whole = Trainer(config(tiny_config, "whole"), ParallelContext(), log_to_console=False)
    losses = [r.loss for r in whole.train()]
    first = config(tiny_config, "first", "checkpoints.checkpoint_interval=2", steps=2)
    Trainer(first, ParallelContext(), log_to_console=False).train()
    return first.run_dir / "checkpoints", losses


def consolidated(checkpoint, out):
    assert main(["consolidate", str(checkpoint), "--out", str(out), "--with-optimizer"]) == 0
    return load_file(str(out / "model.safetensors")), load_file(str(out / "optimizer.safetensors"))


def test_C1_reshard_then_consolidate_gives_the_same_tensors(saved, tmp_path):
    checkpoints, _ = saved
    weights, optimizer = consolidated(checkpoints, tmp_path / "original")
    assert weights["embed_tokens.weight"].dtype == torch.bfloat16 and "lm_head.weight" not in weights  # tied
    assert {k.split("/")[0] for k in optimizer} == {"master", "exp_avg", "exp_avg_sq"}
    assert main(["reshard", str(checkpoints), "--out", str(tmp_path / "mesh"), *TO_2X2X2]) == 0
    assert sorted(p.name for p in (tmp_path / "mesh" / "step-0000002").glob("*.safetensors")) == [
        rank_file(r) for r in range(8)
    ]
    assert (
        main(
            [
                "reshard",
                str(tmp_path / "mesh"),
                "--out",
                str(tmp_path / "back"),
                "--dp",
                "1",
                "--tp",
                "1",
                "--pp",
                "1",
            ]
        )
        == 0
    )
    to_cp = ["--cp", "2", "--tp", "2", "optimizer.zero_stage=1"]  # ZeRO-1 shards over the cp ranks
    assert main(["reshard", str(checkpoints), "--out", str(tmp_path / "cp"), *to_cp]) == 0
    assert len(list((tmp_path / "cp" / "step-0000002").glob("*.safetensors"))) == 4
    to_zero3 = ["--dp", "4", "--pp", "2", "optimizer.zero_stage=3"]  # every rank holds shards only
    assert main(["reshard", str(checkpoints), "--out", str(tmp_path / "zero3"), *to_zero3]) == 0
    for directory in ("mesh", "back", "cp", "zero3"):
        other_weights, other_optimizer = consolidated(tmp_path / directory, tmp_path / f"{directory}-full")
        for mine, theirs in ((weights, other_weights), (optimizer, other_optimizer)):
            assert mine.keys() == theirs.keys()
            assert all(torch.equal(mine[k], theirs[k]) for k in mine), directory
    _, model = load_run(tmp_path / "original")  # a consolidated checkpoint is a run directory for generate
    assert torch.equal(model.embed_tokens.weight.data, weights["embed_tokens.weight"].float())


def _resume_and_record_files(rank, resumed):
    ctx = ParallelContext(dp=2, tp=2, pp=2, collective_timeout_seconds=60)
    opened = set()
    read = files.CheckpointReader.read

    def recording(self, tensor, box, out=None):  # which files each kind of tensor is read from
        real_file = self._file

        def noting_file(name):
            opened.add((tensor.split("/")[0], name))
            return real_file(name)

        self._file = noting_file
        try:
            return read(self, tensor, box, out)
        finally:
            del self._file

    files.CheckpointReader.read = recording
    losses = [r.loss for r in Trainer(resumed, ctx, log_to_console=False).train()]
    ctx.close()
    return losses, opened


@pytest.mark.distributed
def test_a_resharded_checkpoint_resumes_on_its_mesh_reading_its_optimizer_state_from_its_own_file(
    saved, tiny_config, tmp_path
):
    """Weights are saved once per dp group (1/dp by each rank), so a rank reads them from several files; its
    optimizer state is in its own file, but for what only tp rank 0 (the norms) or the first stage (a tied
    embedding) saves."""
    checkpoints, losses = saved
    to_mesh = [*TO_2X2X2, "tokens.batch_accumulation_per_replica=4"]
    assert main(["reshard", str(checkpoints), "--out", str(tmp_path / "mesh"), *to_mesh]) == 0
    resumed = config(
        tiny_config,
        "resumed",
        f"checkpoints.resume_checkpoint_path={tmp_path / 'mesh'}",
        "parallelism.dp=2",
        "parallelism.tp=2",
        "parallelism.pp=2",
        "optimizer.zero_stage=1",
        "tokens.batch_accumulation_per_replica=4",
        "parallelism.collective_timeout_seconds=60",
    )
    per_rank = run_ranks(_resume_and_record_files, 8, resumed, timeout=300)
    for rank, (rank_losses, opened) in enumerate(per_rank):
        assert rank_losses == pytest.approx(losses[2:], rel=1e-2)  # bf16, another summation order
        mesh = Mesh(dp=2, tp=2, pp=2)
        at = mesh.coordinates_of(rank)
        savers = {
            rank_file(mesh.rank_of(replace(at, pp_rank=pp, tp_rank=tp)))
            for pp in {at.pp_rank, 0}
            for tp in {at.tp_rank, 0}
        }
        moments = {name for kind, name in opened if kind in ("exp_avg", "exp_avg_sq")}
        assert rank_file(rank) in moments and moments <= savers


@pytest.fixture
def with_tokenizer(tiny_config, tmp_path):
    """A checkpoint after 2 steps that holds its run's tokenizer, and a file of the user's outside it."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be, that is the question " * 50)
    train_tokenizer([corpus], 300, tmp_path / "tok" / "tokenizer.json")
    config = tiny_config(
        "model.model_config.vocab_size=320",
        "tokens.train_steps=2",
        "general.run=tok",
        f"tokenizer.tokenizer_name_or_path={tmp_path / 'tok' / 'tokenizer.json'}",
        "checkpoints.checkpoint_interval=2",
        "checkpoints.save_final_state=false",
    )
    Trainer(config, ParallelContext(), log_to_console=False).train()
    (tmp_path / "secret.txt").write_text("the user's own file")
    return config.run_dir / "checkpoints" / "step-0000002"


def test_a_consolidated_checkpoint_is_a_self_contained_run_directory(with_tokenizer, tmp_path, monkeypatch):
    """The checkpoint keeps the run's tokenizer, so consolidate writes it beside the weights and `generate`
    works from anywhere, even once the original tokenizer file is gone."""
    (tmp_path / "tok" / "tokenizer.json").unlink()
    checkpoints = with_tokenizer.parent
    out = tmp_path / "out"
    assert main(["consolidate", str(checkpoints), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.yaml",
        "model-parts.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert main(["reshard", str(checkpoints), "--out", str(tmp_path / "resharded")]) == 0
    assert (tmp_path / "resharded" / "step-0000002" / "tokenizer.json").is_file()
    monkeypatch.chdir(tmp_path / "tok")
    assert generate_text(out, "to be", max_new_tokens=4, temperature=0).startswith("to be")


@pytest.mark.parametrize("verb", ["consolidate", "reshard"])
def test_a_bad_checkpoint_argument_is_named_as_the_argument(verb, tmp_path, capsys):
    assert main([verb, str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")]) == 6
    err = capsys.readouterr().err
    assert f"the CHECKPOINT argument: {tmp_path / 'nowhere'} does not exist" in err
    assert "resume_checkpoint_path" not in err


def test_W1_consolidate_replaces_a_symlinked_tokenizer_in_out_instead_of_writing_through_it(
    with_tokenizer, tmp_path
):
    out = tmp_path / "out"
    out.mkdir()
    (out / "tokenizer.json").symlink_to(tmp_path / "secret.txt")
    assert main(["consolidate", str(with_tokenizer), "--out", str(out)]) == 0
    assert (tmp_path / "secret.txt").read_text() == "the user's own file"
    assert (out / "tokenizer.json").read_bytes() == (with_tokenizer / "tokenizer.json").read_bytes()


def edit_manifest(checkpoint, edit):
    path = checkpoint / files.MANIFEST
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(files.sealed(manifest)))  # made by hand, whole


def test_X1_a_manifest_listing_no_tokenizer_gets_none_copied_whatever_its_config_names(
    with_tokenizer, tmp_path
):
    def forge(manifest):
        del manifest["files"]["tokenizer.json"]
        manifest["config"]["tokenizer"]["tokenizer_name_or_path"] = str(tmp_path / "secret.txt")

    edit_manifest(with_tokenizer, forge)
    (with_tokenizer / "tokenizer.json").unlink()
    assert main(["consolidate", str(with_tokenizer), "--out", str(tmp_path / "out")]) == 0
    assert not (tmp_path / "out" / "tokenizer.json").exists()
    assert not [
        p for p in (tmp_path / "out").iterdir() if "the user's own file" in p.read_text(errors="replace")
    ]


def test_an_moe_checkpoint_resharded_over_expert_parallel_ranks_and_back_keeps_every_tensor(
    tiny_config, tmp_path
):
    """One process -> dp2 x ep2 (each rank file half the experts) -> one process: every weight, master and
    Adam moment as saved, each rank of the middle mesh holding its own experts' slices only."""
    moe = ("model.model_config.moe.num_experts=4", "model.model_config.moe.intermediate_size=32")
    run = config(tiny_config, "moe", *moe, "checkpoints.checkpoint_interval=2", steps=2)
    Trainer(run, ParallelContext(), log_to_console=False).train()
    checkpoints = run.run_dir / "checkpoints"
    weights, optimizer = consolidated(checkpoints, tmp_path / "original")
    assert main(["reshard", str(checkpoints), "--out", str(tmp_path / "ep"), "--dp", "2", "--ep", "2"]) == 0
    manifest = files.read_manifest(tmp_path / "ep" / "step-0000002")
    experts = manifest["tensors"]["model/layers.0.mlp.experts.down_proj"]["slices"]
    assert sorted((piece["file"], piece["start"][0], piece["stop"][0]) for piece in experts) == [
        (rank_file(0), 0, 2),
        (rank_file(1), 2, 4),
    ]
    back = ["reshard", str(tmp_path / "ep"), "--out", str(tmp_path / "one"), "--dp", "1", "--ep", "1"]
    assert main(back) == 0
    round_weights, round_optimizer = consolidated(tmp_path / "one", tmp_path / "round")
    for original, again in ((weights, round_weights), (optimizer, round_optimizer)):
        assert original.keys() == again.keys()
        for name, tensor in original.items():
            assert torch.equal(again[name], tensor), name


# The families' features together: OLMo2's norms (q/k weights split with the heads), biases split with their
# rows, a head_dim of its own, a layer without RoPE, a sliding window, Granite's scalings, and experts with a
# dense layer among them.
EVERY_FEATURE = (
    *OLMO2_FEATURES,
    "model.model_config.head_dim=24",
    "model.model_config.qkv_bias=true",
    "model.model_config.no_rope_layers=[1]",
    "model.model_config.sliding_window=5",
    "model.model_config.full_attention_layers=[0]",
    "model.model_config.residual_multiplier=0.7",
    "model.model_config.moe.num_experts=4",
    "model.model_config.moe.intermediate_size=32",
    "model.model_config.moe.dense_layers=[2]",
)


def test_a_checkpoint_with_every_model_feature_reshards_consolidates_and_is_diagnosed(
    tiny_config, tmp_path, capsys
):
    """One process -> dp2 x tp2 x ep2 -> consolidated: every weight, master and Adam moment as saved (the
    q/k norms' weights split by heads in between); the config counts the model's parameters, and `doctor`
    checks it and estimates its memory (on the meta device)."""
    run = config(tiny_config, "features", *EVERY_FEATURE, "checkpoints.checkpoint_interval=2", steps=2)
    Trainer(run, ParallelContext(), log_to_console=False).train()
    checkpoints = run.run_dir / "checkpoints"
    weights, optimizer = consolidated(checkpoints, tmp_path / "original")
    mesh = ["--dp", "2", "--tp", "2", "--ep", "2", "optimizer.zero_stage=1"]
    assert main(["reshard", str(checkpoints), "--out", str(tmp_path / "mesh"), *mesh]) == 0
    manifest = files.read_manifest(tmp_path / "mesh" / "step-0000002")
    q_norm = manifest["tensors"]["model/layers.0.self_attn.q_norm.weight"]["slices"]
    assert {(piece["start"][0], piece["stop"][0]) for piece in q_norm} == {(0, 48), (48, 96)}  # by heads
    round_weights, round_optimizer = consolidated(tmp_path / "mesh", tmp_path / "round")
    for original, again in ((weights, round_weights), (optimizer, round_optimizer)):
        assert original.keys() == again.keys()
        for name, tensor in original.items():
            assert torch.equal(again[name], tensor), name
    mcfg = run.model.model_config_
    assert mcfg.parameter_count == sum(tensor.numel() for tensor in weights.values())
    capsys.readouterr()
    assert main(["doctor", str(tmp_path / "round" / "config.yaml"), "--device", "H100"]) == 0
    assert "config: every rule holds" in capsys.readouterr().out  # its memory estimate built the model


def test_a_resharded_checkpoint_records_its_new_world_size_and_resumes_as_written_offline(
    with_tokenizer, tmp_path
):
    """The new manifest's world size counts the new mesh's ranks (the tokenizer's file once counted as one):
    resuming on that mesh is not reported as `resharded ()` with "RNG states not restored"."""
    assert main(["reshard", str(with_tokenizer), "--out", str(tmp_path / "same")]) == 0
    resharded = tmp_path / "same" / with_tokenizer.name
    manifest = files.read_manifest(resharded)
    assert manifest["world_size"] == 1 and "tokenizer.json" in manifest["files"]
    trainer = Trainer(load_config_dict(manifest["config"]), ParallelContext(), log_to_console=False)
    summary, _ = load(trainer.parts, resharded)
    assert summary.endswith("; no RNG states in the checkpoint (written offline)"), summary


def test_X2_reshard_refuses_a_tokenizer_that_fails_its_checksum(with_tokenizer, tmp_path, capsys):
    tokenizer = with_tokenizer / "tokenizer.json"
    text = tokenizer.read_text()
    tokenizer.write_text(text.replace("question", "qvestion"))  # the same size, other contents
    assert main(["reshard", str(with_tokenizer), "--out", str(tmp_path / "resharded")]) == 6
    assert "tokenizer.json fails its xxh3_128 checksum" in capsys.readouterr().err
    assert not (tmp_path / "resharded" / with_tokenizer.name).exists()


def test_S1_consolidate_without_the_optimizer_over_one_with_it_leaves_no_stale_file(with_tokenizer, tmp_path):
    out = tmp_path / "out"
    assert main(["consolidate", str(with_tokenizer), "--out", str(out), "--with-optimizer"]) == 0
    assert main(["consolidate", str(with_tokenizer), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.yaml",
        "model-parts.json",
        "model.safetensors",
        "tokenizer.json",
    ]


@pytest.mark.distributed
def test_S8_consolidate_killed_while_moving_its_files_in_leaves_a_directory_generate_refuses(
    with_tokenizer, tmp_path
):
    out = tmp_path / "out"
    assert main(["consolidate", str(with_tokenizer), "--out", str(out)]) == 0
    env = {key: value for key, value in os.environ.items() if not key.startswith("FEMTOTRON_CRASH")}
    command = [sys.executable, "-m", "femtotron.cli", "consolidate", str(with_tokenizer), "--out", str(out)]
    killed = subprocess.run(command, env=env | {"FEMTOTRON_CRASH_AT": "outputs.moved_one"}, timeout=300)
    assert killed.returncode == -signal.SIGKILL
    with pytest.raises(FemtotronError, match="config.yaml does not exist"):
        load_run(out)
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "left by an earlier run that was killed" in again.stderr, again.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "config.yaml",
        "model-parts.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    load_run(out)


def test_a_reshard_that_would_change_the_optimizer_is_refused(saved, tmp_path, capsys):
    """The checkpoint holds Adam's moments: resharded as Muon's, its manifest would promise a momentum it
    does not hold."""
    checkpoints, _ = saved
    muon = "optimizer.optimizer_factory.name=muon"
    assert main(["reshard", str(checkpoints), "--out", str(tmp_path / "muon"), muon]) != 0
    assert "holds the state of optimizer_factory.name=adamW" in capsys.readouterr().err
    assert not (tmp_path / "muon").exists()


def test_reshard_refuses_to_write_over_its_source(tiny_config):
    saved = checkpointed_run(tiny_config, "self")
    with pytest.raises(CheckpointError, match="is the directory the checkpoint step-0000004 is in"):
        reshard(saved, saved, ["parallelism.tp=2"])


def test_a_layout_the_model_cannot_take_is_refused_naming_the_option_and_the_checkpoint(
    with_tokenizer, tmp_path, capsys
):
    """`reshard --tp 3` reported `Invalid config <dict>` and an override `'parallelism.tp=3'` never typed."""
    assert main(["reshard", str(with_tokenizer), "--out", str(tmp_path / "tp3"), "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert f"Invalid config in checkpoint {with_tokenizer}: 2 problems" in err
    assert (
        "parallelism.tp (--tp 3): num_attention_heads=4 and num_key_value_heads=2 must both be divisible"
        in err
    )
    assert "<dict>" not in err and "override" not in err
    assert not (tmp_path / "tp3").exists()


@pytest.mark.parametrize("kind", ["model", "exp_avg"])
def test_a_manifest_whose_shape_disagrees_with_its_config_is_a_damaged_checkpoint(
    with_tokenizer, tmp_path, capsys, kind
):
    """A manifest (sealed: its own checksum holds) giving the embedding the shape [0, 64] with no slices:
    consolidate wrote an empty embedding, exit 0."""

    def empty_embedding(manifest):
        manifest["tensors"][f"{kind}/embed_tokens.weight"].update(shape=[0, 64], slices=[])

    edit_manifest(with_tokenizer, empty_embedding)
    manifest = with_tokenizer / files.MANIFEST
    for verb, options in (("consolidate", ["--with-optimizer"]), ("reshard", ["--dp", "2"])):
        assert main([verb, str(with_tokenizer), "--out", str(tmp_path / verb), *options]) == 6
        err = capsys.readouterr().err
        assert f"{kind}/embed_tokens.weight in {manifest} has shape (0, 64), " in err, err
        assert "the checkpoint is damaged" in err
        assert not (tmp_path / verb / "model.safetensors").exists()
