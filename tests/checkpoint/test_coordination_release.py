"""A rank blocked in the checkpoint manager's gloo collective is released when its peer's attempt ends."""

import pytest

from testlib import REPO, torchrun_probe

pytestmark = pytest.mark.multiprocess


def test_peer_unbind_releases_a_rank_blocked_in_coordination(tmp_path):
    """Without the release, rank 0 would wait for the 120 s coordination timeout while rank 1 stays alive (as an
    in-process restart does), and this run would hit its 100 s limit."""
    out = torchrun_probe(REPO / "tests" / "checkpoint" / "coordination_release.py", tmp_path / "ckpt",
                        "rank 0 stayed blocked in the coordination collective after rank 1 unbound")
    line = out.splitlines()[0]
    assert "released" in line and "Timed out" not in line, out
