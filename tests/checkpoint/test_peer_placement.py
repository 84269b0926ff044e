"""Where a rank's replicas go (``replicas.holders``) and how the restore counts them (``restore.Candidates``): the
loss of any one node (and, where racks are known, of any one rack) leaves a copy of every rank's snapshot."""

import itertools

from trainer.checkpoint.replicas import holders, resolve_count
from trainer.checkpoint.restore import Candidates


def _nodes(per_node, count):
    return [f"n{i}" for i in range(count) for _ in range(per_node)]


def _survives(nodes, plan, lost):
    """Every rank on a lost node has a holder on a node that is not lost."""
    return all(any(nodes[h] not in lost for h in plan[r]) for r in range(len(nodes)) if nodes[r] in lost)


def test_a_ring_across_nodes_same_local_index_on_the_next_node():
    nodes = _nodes(2, 3)  # ranks 0-1 on n0, 2-3 on n1, 4-5 on n2
    assert holders(nodes, [""] * 6, 1) == [[2], [3], [4], [5], [0], [1]]
    assert holders(nodes, [""] * 6, 2) == [[2, 4], [3, 5], [4, 0], [5, 1], [0, 2], [1, 3]]


def test_the_loss_of_any_one_node_leaves_a_copy_of_every_shard():
    for per_node, count in [(1, 2), (2, 3), (4, 5), (8, 8)]:
        nodes = _nodes(per_node, count)
        plan = holders(nodes, [""] * len(nodes), 1)
        for node in set(nodes):
            assert _survives(nodes, plan, {node}), (per_node, count, node)
            assert all(nodes[h] != nodes[r] for r, hs in enumerate(plan) for h in hs)


def test_with_racks_known_a_replica_goes_to_another_rack_so_a_rack_loss_leaves_a_copy():
    nodes = _nodes(2, 4)
    racks = ["a", "a", "a", "a", "b", "b", "b", "b"]  # n0, n1 in rack a; n2, n3 in rack b: the ring's next node of
    plan = holders(nodes, racks, 1)                   # n0 is n1, the same rack: skipped
    for rack in "ab":
        lost = {n for n, r in zip(nodes, racks) if r == rack}
        assert _survives(nodes, plan, lost), (rack, plan)
    held = [sum(nodes[h] == node for hs in plan for h in hs) for node in ("n0", "n1", "n2", "n3")]
    assert held == [2, 2, 2, 2], plan  # every node holds as much as the others
    plain = holders(nodes, [""] * 8, 1)
    assert not _survives(nodes, plain, {"n0", "n1"})  # without racks, the ring keeps n0's copy on n1


def test_two_replicas_survive_any_two_nodes():
    nodes = _nodes(1, 5)
    plan = holders(nodes, [""] * 5, 2)
    for lost in itertools.combinations(set(nodes), 2):
        assert _survives(nodes, plan, set(lost)), lost


def test_the_count_auto_is_one_from_two_nodes_and_never_more_than_the_other_nodes():
    assert [resolve_count("auto", n) for n in (1, 2, 8)] == [0, 1, 1]
    assert resolve_count(3, 2) == 1 and resolve_count(0, 4) == 0 and resolve_count(2, 4) == 2


def test_a_replacement_reads_its_replica_the_others_their_memory():
    found = Candidates(held=[{38, 40}, set(), {38, 40}], disk=[20, 40], peer=[{}, {38: 2, 40: 2}, {}])
    assert found.newest() == 40 and found.sources(40) == ["own", "peer", "own"]


def test_a_node_lost_with_its_holder_reads_the_disk_the_other_its_replica():
    found = Candidates(held=[set(), set(), {38, 40}], disk=[40], peer=[{}, {38: 2, 40: 2}, {}])
    assert found.newest() == 40 and found.sources(40) == ["disk", "peer", "own"]


def test_a_replica_lagging_the_memory_and_disk_gives_the_newest_step_every_rank_reaches():
    found = Candidates(held=[{38, 40}, set()], disk=[20], peer=[{}, {38: 0}])  # 40 was still being pushed
    assert found.newest() == 38 and found.sources(38) == ["own", "peer"]
