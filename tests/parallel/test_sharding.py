import pytest
import torch

from femtotron.parallel.sharding import full_init, make_param, param_seed


def test_seed_depends_on_seed_and_name_only():
    assert param_seed(1, "a.weight") == param_seed(1, "a.weight")
    assert len({param_seed(1, "a.weight"), param_seed(2, "a.weight"), param_seed(1, "b.weight")}) == 3


def test_shards_are_slices_of_the_full_single_device_tensor():
    full = full_init("layers.0.mlp.up_proj.weight", (8, 6), 0.02, seed=5)
    for dim in (0, 1):
        pieces = []
        for rank in range(2):
            p = make_param(
                "layers.0.mlp.up_proj.weight",
                (8, 6),
                std=0.02,
                seed=5,
                dtype=torch.float32,
                device=torch.device("cpu"),
                shard_dim=dim,
                rank=rank,
                world=2,
            )
            assert p.shard.global_shape == (8, 6)
            assert p.shard.local_slice[dim] == slice(rank * (8, 6)[dim] // 2, (rank + 1) * (8, 6)[dim] // 2)
            assert torch.equal(p.detach(), full[p.shard.local_slice])
            pieces.append(p.detach())
        assert torch.equal(torch.cat(pieces, dim=dim), full)


def test_norm_weights_start_at_one_and_tie_group_is_kept():
    p = make_param(
        "norm.weight",
        (4,),
        std=None,
        seed=0,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
        tie_group="norm",
    )
    assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), torch.ones(4, dtype=torch.bfloat16))
    assert p.shard.tie_group == "norm" and p.shard.local_slice == (slice(0, 4),)


def shards(device: torch.device, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [
        make_param(
            "lm_head.weight",
            (300, 64),
            std=0.02,
            seed=3,
            dtype=dtype,
            device=device,
            shard_dim=0,
            rank=r,
            world=4,
        )
        for r in range(4)
    ]


def test_parameters_are_made_on_their_device_without_values_on_meta():
    assert all(p.is_meta and p.shape == (75, 64) for p in shards(torch.device("meta")))
    full = full_init("lm_head.weight", (300, 64), 0.02, seed=3)
    assert torch.equal(
        torch.cat([p.detach() for p in shards(torch.device("cpu"), torch.bfloat16)]), full.bfloat16()
    )


@pytest.mark.cuda
def test_on_cuda_shards_are_slices_of_the_full_tensor_generated_on_the_gpu():
    gpu = torch.device("cuda")
    full = full_init("lm_head.weight", (300, 64), 0.02, seed=3, device=gpu)
    pieces = shards(gpu)
    assert all(p.device.type == "cuda" for p in pieces)
    assert torch.equal(torch.cat([p.detach() for p in pieces]), full)
    # The same distribution, other values than the CPU's (docs/parallelism.md says so).
    assert not torch.equal(full.cpu(), full_init("lm_head.weight", (300, 64), 0.02, seed=3))
    assert abs(full.std().item() - 0.02) < 0.002
