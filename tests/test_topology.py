"""hvdcompress.topology: node layout and slices, pure."""

import pytest

from hvdcompress.topology import Topology, parse_topology, slices, topology_from_env


def test_groups_of_two_nodes_of_four():
    t = Topology(8, 4)
    assert (t.nodes, t.flat, str(t)) == (2, False, "2x4")
    assert t.local_group(5) == (4, 5, 6, 7) and t.cross_group(5) == (1, 5)
    assert t.local_groups() == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert t.cross_groups() == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert [t.node_of(r) for r in range(8)] == [0] * 4 + [1] * 4
    assert [t.local_rank(r) for r in range(8)] == [0, 1, 2, 3] * 2


def test_every_rank_is_in_exactly_one_local_and_one_cross_group():
    for world, local in ((6, 2), (6, 3), (12, 4), (5, 1), (4, 4)):
        t = Topology(world, local)
        assert sorted(r for g in t.local_groups() for r in g) == list(range(world))
        assert sorted(r for g in t.cross_groups() for r in g) == list(range(world))
        for r in range(world):
            assert set(t.local_group(r)) & set(t.cross_group(r)) == {r}


def test_flat_layouts():
    assert Topology(4, 4).flat and Topology(4, 1).flat and not Topology(4, 2).flat


@pytest.mark.parametrize("world,local,word", [(6, 4, "whole number"), (4, 0, "local_size"), (4, 5, "local_size"),
                                              (0, 1, "world")])
def test_bad_layouts_name_the_parameter(world, local, word):
    with pytest.raises(ValueError, match=word):
        Topology(world, local)


def test_rank_out_of_range():
    with pytest.raises(ValueError, match=r"rank must be in \[0, 3\]"):
        Topology(4, 2).node_of(4)


def test_parse_and_env():
    assert parse_topology("2x4", 8) == Topology(8, 4) and parse_topology("4", 8) == Topology(8, 4)
    with pytest.raises(ValueError, match="3 nodes x 2 ranks is 6"):
        parse_topology("3x2", 8)
    with pytest.raises(ValueError, match="expected 'NxL'"):
        parse_topology("two", 8)
    assert topology_from_env(8, {"LOCAL_WORLD_SIZE": "2"}) == Topology(8, 2)
    assert topology_from_env(8, {"HOROVOD_LOCAL_SIZE": "8"}).flat
    assert topology_from_env(8, {}) == Topology(8, 8)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        topology_from_env(8, {"LOCAL_WORLD_SIZE": "x"})


def test_slices_cover_and_balance():
    assert slices(10, 4) == ((0, 3), (3, 6), (6, 8), (8, 10))
    assert slices(2, 4) == ((0, 1), (1, 2), (2, 2), (2, 2))
    for n in range(0, 40):
        for p in range(1, 7):
            s = slices(n, p)
            assert s[0][0] == 0 and s[-1][1] == n and all(a[1] == b[0] for a, b in zip(s, s[1:]))
            sizes = [b - a for a, b in s]
            assert max(sizes) - min(sizes) <= 1
