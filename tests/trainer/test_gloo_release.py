"""A rank blocked in an FSDP2 gloo collective is released at once when its failed peer leaves the group."""

import pytest

from testlib import REPO, torchrun_probe

pytestmark = pytest.mark.multiprocess


def test_peer_abort_releases_a_rank_blocked_in_an_fsdp_collective(tmp_path):
    """Without shutting the group's connections, rank 0 waits for the 120 s collective timeout while rank 1 stays
    alive (as an in-process restart does): measured with destroy_process_group and _abort_process_group alone."""
    out = torchrun_probe(REPO / "tests" / "trainer" / "gloo_release.py", tmp_path / "done",
                        "rank 0 stayed blocked in the FSDP collective after rank 1 left the group")
    line = out.splitlines()[0]
    assert "released" in line and "Connection closed by peer" in line, out
