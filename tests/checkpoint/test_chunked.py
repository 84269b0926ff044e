"""The chunked copy of a node-local snapshot (``trainer.checkpoint.chunked``): on CUDA the chunks are page-locked
while earlier ones are copied; here the plan and the copies are checked on CPU tensors with a recording ``register``
in place of ``cudaHostRegister``."""

from __future__ import annotations

import threading

import pytest
import torch

from trainer.checkpoint import chunked
from trainer.checkpoint.layout import Piece
from trainer.checkpoint.slots import checksum, device_checksum, map_views, plan_layout

CHUNK = 4096


def _slot():
    """A slot holding tensors of several dtypes and sizes, some smaller than a chunk, one spanning several."""
    shapes = {"a": ((3,), torch.float32), "b": ((1500, 3), torch.float32), "c": ((7,), torch.int64),
              "d": ((2, 2049), torch.bfloat16), "e": ((1,), torch.float32), "f": ((5000,), torch.uint8)}
    pieces = {k: Piece(shape, (0,) * len(shape), shape, dtype, False) for k, (shape, dtype) in shapes.items()}
    layout, nbytes = plan_layout(pieces)
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    views = map_views(buffer, layout)
    generator = torch.Generator().manual_seed(0)
    for view in views.values():
        view.view(-1).view(torch.uint8).copy_(torch.randint(0, 256, (view.numel() * view.element_size(),),
                                                            dtype=torch.uint8, generator=generator))
    return buffer, layout, views


def test_plan_covers_every_tensor_byte_once_within_its_chunk():
    buffer, layout, views = _slot()
    plan = chunked.chunk_plan(layout, views, buffer.numel(), CHUNK)
    assert [start for start, _, _ in plan] == sorted({start for start, _, _ in plan})
    covered = {key: [] for key in views}
    for start, end, pieces in plan:
        assert start % CHUNK == 0 and end - start <= CHUNK
        for key, at, src, length in pieces:
            assert start <= src and src + length <= end, "a piece never crosses a chunk boundary"
            assert src - layout[key][1] == at
            covered[key].append((at, at + length))
    for key, view in views.items():
        spans = sorted(covered[key])
        assert spans[0][0] == 0 and spans[-1][1] == view.numel() * view.element_size()
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), f"{key}: gap or overlap"
    assert sum(len(p) for _, _, p in plan) > len(views), "some tensors span several chunks"


def test_chunks_are_registered_ahead_and_copied_exactly_even_when_one_cannot_be_locked():
    buffer, layout, views = _slot()
    plan = chunked.chunk_plan(layout, views, buffer.numel(), CHUNK)
    targets = {key: torch.empty_like(view) for key, view in views.items()}
    registered, lock = [], threading.Lock()
    refused = buffer.data_ptr() + plan[1][0]

    def register(address: int, nbytes: int) -> bool:
        with lock:
            registered.append((address, nbytes))
        return address != refused  # the driver refuses one chunk: it is copied from pageable memory

    pinned: list[int] = []
    chunked.copy_in_chunks(buffer, plan, targets, register, pinned)
    for key, view in views.items():
        assert torch.equal(targets[key].view(torch.uint8), view.view(torch.uint8)), key
    base = buffer.data_ptr()
    assert sorted(registered) == [(base + start, end - start) for start, end, _ in plan]
    assert sorted(pinned) == [base + start for start, _, _ in plan if base + start != refused]
    # what the GPU path compares with the header: the targets' checksum equals the slot's
    assert chunked.wrap64(int(device_checksum(list(targets.values())))) == checksum(buffer)


def test_wrap64_matches_int64_overflow():
    words = torch.tensor([2**62, 2**62, 2**62], dtype=torch.int64)
    assert chunked.wrap64(sum(int(w) for w in words)) == int(words.sum())


def test_chunks_locked_before_a_failed_copy_are_still_reported_for_unlocking():
    buffer, layout, views = _slot()
    plan = chunked.chunk_plan(layout, views, buffer.numel(), CHUNK)
    targets = {key: torch.empty_like(view) for key, view in views.items()}
    targets["d"] = targets["d"][:1]  # too small: its copy fails mid-restore
    pinned: list[int] = []
    with pytest.raises(RuntimeError):
        chunked.copy_in_chunks(buffer, plan, targets, lambda address, nbytes: True, pinned)
    assert sorted(pinned) == [buffer.data_ptr() + start for start, _, _ in plan], "every locked chunk is reported"


def test_chunks_locked_ahead_are_not_locked_again():
    """A standby's premap (``premap``) locked the slot's first chunks in the restore's own chunking: the restore
    locks only the rest, and reports each chunk once."""
    buffer, layout, views = _slot()
    plan = chunked.chunk_plan(layout, views, buffer.numel(), CHUNK)
    targets = {key: torch.empty_like(view) for key, view in views.items()}
    base = buffer.data_ptr()
    ahead = [base + start for start, _, _ in plan[:2]]
    registered: list[int] = []
    pinned = list(ahead)
    chunked.copy_in_chunks(buffer, plan, targets, lambda address, nbytes: registered.append(address) or True, pinned)
    assert sorted(registered) == [base + start for start, _, _ in plan[2:]]
    assert sorted(pinned) == [base + start for start, _, _ in plan]
    for key, view in views.items():
        assert torch.equal(targets[key].view(torch.uint8), view.view(torch.uint8)), key
