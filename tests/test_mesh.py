"""mesh.py: the rank layout and the groups and links derived from it, without any process."""

import pytest

from femtotron.mesh import LAYOUT, Mesh, MeshCoordinates


def at(pp_rank: int = 0, dp_rank: int = 0, cp_rank: int = 0, tp_rank: int = 0) -> MeshCoordinates:
    return MeshCoordinates(pp_rank=pp_rank, dp_rank=dp_rank, cp_rank=cp_rank, tp_rank=tp_rank)


def test_T3_rank_layout_is_tp_innermost_pp_outermost():
    mesh = Mesh(dp=2, tp=2, pp=2)
    assert [mesh.rank_of(at(tp_rank=t)) for t in range(mesh.tp)] == [0, 1]
    assert [mesh.rank_of(at(dp_rank=d)) for d in range(mesh.dp)] == [0, 2]
    assert [mesh.rank_of(at(pp_rank=p)) for p in range(mesh.pp)] == [0, 4]
    for rank in range(mesh.world_size):
        assert mesh.rank_of(mesh.coordinates_of(rank)) == rank
    mesh = Mesh(dp=2, tp=2, pp=2, cp=2)  # cp between tp and dp
    assert [mesh.rank_of(at(cp_rank=c)) for c in range(mesh.cp)] == [0, 2]
    assert mesh.rank_of(at(dp_rank=1)) == 4 and mesh.rank_of(at(pp_rank=1)) == 8
    for rank in range(mesh.world_size):
        assert mesh.rank_of(mesh.coordinates_of(rank)) == rank


def test_the_layout_is_one_tuple_and_the_coordinates_follow_it():
    assert LAYOUT == ("pp", "dp", "cp", "tp")
    assert list(MeshCoordinates.__dataclass_fields__) == [f"{name}_rank" for name in LAYOUT]
    assert Mesh(dp=4, cp=2, tp=2, pp=2, ep=8).describe() == "dp=4 cp=2 tp=2 pp=2"
    assert Mesh(dp=2, tp=2).describe() == "dp=2 tp=2 pp=1"


LAYOUTS = {  # (dp, tp, pp, cp) -> process groups created: before (one per group of every kind), now
    (8, 1, 1, 1): (8 + 8 + 1 + 1 + 8 + 8 + 8, 0),  # dp = dp_cp is the world: the default group
    (1, 8, 1, 1): (1 + 8 + 8 + 8 + 8 + 1 + 8, 0),  # tp = mp = the world
    (1, 1, 2, 1): (2 + 2 + 2 + 2 + 1 + 1 + 1, 0),  # pp = mp = embedding = the world
    (2, 2, 1, 1): (2 + 4 + 2 + 2 + 4 + 2 + 4, 4),  # mp = tp; the pp and embedding groups have one rank
    (2, 2, 2, 1): (4 + 8 + 4 + 4 + 4 + 2 + 4, 14),  # embedding = pp
    (1, 2, 4, 1): (4 + 8 + 8 + 8 + 2 + 1 + 2, 8),  # mp = the world; embedding: first and last stage
    (1, 1, 1, 2): (2 + 1 + 2 + 1 + 2 + 2 + 2, 0),  # cp = dp_cp is the world
    (2, 2, 2, 2): (8 + 8 + 8 + 4 + 8 + 4 + 8, 40),  # tp, cp, dp, dp_cp, pp (= embedding), mp
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_distinct_rank_set_gets_one_process_group(layout):
    before, now = LAYOUTS[layout]
    dp, tp, pp, cp = layout
    mesh = Mesh(dp=dp, tp=tp, pp=pp, cp=cp)
    groups = mesh.groups()
    created = mesh.subgroups()
    assert sum(len(of_kind) for of_kind in groups.values()) == before and len(created) == now
    assert len(set(created)) == len(created)
    world = layout[0] * layout[1] * layout[2] * layout[3]
    for of_kind in groups.values():  # every group of several ranks has a handle: its own, or the default
        assert all(ranks in created or len(ranks) in (1, world) for ranks in of_kind)


def test_the_cp_ring_is_the_ranks_of_one_sequence_and_its_links_go_one_way_round():
    dp, tp, pp, cp = 2, 2, 1, 4
    groups = Mesh(dp=dp, tp=tp, pp=pp, cp=cp).groups()
    assert groups["cp"][0] == (0, 2, 4, 6)  # tp innermost, then cp
    assert groups["dp"][0] == (0, 8) and groups["dp_cp"][0] == (0, 2, 4, 6, 8, 10, 12, 14)
    assert Mesh(dp=dp, tp=tp, pp=pp, cp=cp).ring_links()[:4] == [(0, 2), (2, 4), (4, 6), (6, 0)]
    assert Mesh(dp=dp, tp=tp, pp=pp, cp=2).ring_links()[:2] == [(0, 2), (2, 0)]
    assert Mesh(dp=dp, tp=tp, pp=pp).ring_links() == []
