"""A snapshot header is unpickled once per version of its file in a process (``snapshot_header.load_header``): a
restore looks through the node's headers several times (the node-local discovery, the peer tier's holdings, the
reshard's candidates and clean-up), and each unpickling lies on the restart's critical path."""

from __future__ import annotations

import os

import pytest
import torch

from statelib import assert_equal, make_state, manager, pg, save_two_steps, snapshot  # noqa: F401 - pg
from trainer.checkpoint import slots, snapshot_header


@pytest.fixture
def header_loads(monkeypatch):
    """The header files ``torch.load`` unpickles through ``slots`` (every header read goes through it)."""
    loads: list[str] = []
    real = torch.load

    def counting(path, *args, **kwargs):
        loads.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(slots.torch, "load", counting)
    monkeypatch.setattr(snapshot_header, "_HEADERS", {})  # a process of its own
    yield loads


def _published(mgr) -> None:
    for slot in mgr.snapshots.slots:
        slot.published.wait(30)


def test_an_in_process_restore_reads_back_no_header_this_process_published(tmp_path, pg, header_loads):
    mgr = manager(tmp_path, persist_every=0, memory_slots=2)
    try:
        state = make_state()
        save_two_steps(mgr, state)
        _published(mgr)
        expected = snapshot(state)
        restarted = make_state(seed=5)  # the in-process restart's fresh model and optimizer, the same manager
        mgr.unbind()
        mgr.bind()
        assert mgr.load_latest(restarted) == 2
        assert_equal(snapshot(restarted), expected)
        assert header_loads == []
    finally:
        mgr.close(job_over=True)


def test_a_new_process_unpickles_each_header_once_in_its_restore(tmp_path, pg, header_loads):
    mgr = manager(tmp_path, persist_every=0, memory_slots=2)
    state = make_state()
    save_two_steps(mgr, state)
    expected = snapshot(state)
    files = [str(slot.meta_path) for slot in mgr.snapshots.slots]
    mgr.close()
    snapshot_header._HEADERS.clear()  # the respawned worker's process
    respawned = manager(tmp_path, memory_slots=2)
    try:
        restored = make_state(seed=7)
        assert respawned.load_latest(restored) == 2
        assert_equal(snapshot(restored), expected)
        assert sorted(header_loads) == sorted(files)  # discovery, holdings, candidates, clean-up: once each
    finally:
        respawned.close(job_over=True)


def test_a_replaced_or_removed_header_is_read_again(tmp_path, header_loads):
    path = tmp_path / "rank-00000.slot-0.meta"
    torch.save({"step": 1}, path)
    assert snapshot_header.load_header(path) == {"step": 1}
    assert snapshot_header.load_header(path) == {"step": 1} and len(header_loads) == 1
    partial = tmp_path / "partial"
    torch.save({"step": 2}, partial)
    os.replace(partial, path)  # how headers are published: a new file
    assert snapshot_header.load_header(path) == {"step": 2} and len(header_loads) == 2
    path.unlink()
    with pytest.raises(FileNotFoundError):
        snapshot_header.load_header(path)


@pytest.mark.parametrize("tables", ["{not json", '{"pieces": {}}', '{"layout": {"model/w": [1]}, "pieces": {}}'])
def test_a_published_header_keeps_its_tables_as_json_and_reads_back_whole(tmp_path, pg, header_loads, caplog,
                                                                          tables):
    """``snapshot_header.encode_header``: the per-tensor tables are one JSON string in the stored header (the
    weights-only unpickler is slow on hundreds of small objects); a reader gets them back as the publisher had them.
    A header whose tables are not JSON, lack the layout or hold a malformed entry is ignored with a warning by a
    respawned worker (``decode_header`` checks them for every reader), which restores the snapshot before it."""
    import json
    import logging

    mgr = manager(tmp_path, persist_every=0, memory_slots=2)
    state = make_state()
    at_step_1 = save_two_steps(mgr, state)
    _published(mgr)
    slot = mgr.snapshots.newest()
    stored = torch.load(slot.meta_path, weights_only=True)
    assert isinstance(stored["tables"], str) and "layout" not in stored and "pieces" not in stored
    written = json.loads(stored["tables"])
    assert set(written["layout"]) == set(slot.layout) and set(written["pieces"]) == set(slot.pieces)
    snapshot_header._HEADERS.clear()
    read = snapshot_header.load_header(slot.meta_path)
    assert read["layout"] == {k: [d, o, list(s)] for k, (d, o, s) in slot.layout.items()}
    assert read["step"] == 2 and read["payload"].keys() == stored["payload"].keys()
    mgr.close()
    stored["tables"] = tables
    partial = slot.meta_path.with_name("partial")
    torch.save(stored, partial)
    os.replace(partial, slot.meta_path)
    snapshot_header._HEADERS.clear()  # the respawned worker's process
    respawned = manager(tmp_path, memory_slots=2)
    try:
        restored = make_state(seed=7)
        with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
            assert respawned.load_latest(restored) == 1
        assert_equal(snapshot(restored), at_step_1)
        assert f"ignoring node-local snapshot {slot.meta_path}" in caplog.text
    finally:
        respawned.close(job_over=True)
