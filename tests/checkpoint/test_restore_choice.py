"""Which step every rank restores and from which tier (``trainer.checkpoint.restore.Candidates``): the newest step every
rank can reach, each rank from its own snapshot where it holds one, from disk otherwise."""

from trainer.checkpoint.restore import Candidates, _ranges


def test_a_node_that_joined_reads_disk_and_the_others_their_memory():
    found = Candidates(held=[{38, 40}, {38, 40}, set(), set()], disk=[20, 40])  # ranks 2-3: a replacement node
    assert found.newest() == 40
    assert found.sources(40) == ["own", "own", "disk", "disk"]


def test_a_step_only_some_ranks_hold_and_the_disk_lacks_is_not_chosen():
    found = Candidates(held=[{38, 40}, {38}, set()], disk=[20, 30])  # 40: rank 1 missed it, not on disk
    assert found.newest() == 30
    assert found.sources(30) == ["disk", "disk", "disk"]


def test_every_rank_in_memory_needs_no_disk():
    found = Candidates(held=[{8, 10}, {8, 10}], disk=[4])
    assert found.newest() == 10 and found.sources(10) == ["own", "own"]


def test_a_disk_step_newer_than_every_snapshot_is_read_by_all():
    found = Candidates(held=[{8}, {8}], disk=[8, 12])
    assert found.newest() == 12 and found.sources(12) == ["disk", "disk"]


def test_nothing_reachable_by_every_rank():
    assert Candidates(held=[{4}, set()], disk=[]).newest() is None
    assert Candidates(held=[set(), set()], disk=[]).newest() is None


def test_rank_ranges_for_the_log():
    assert _ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert _ranges([3]) == "3"
