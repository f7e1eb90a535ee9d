"""The checkpoint's host copy (``checkpoint.writer.snapshot``): device tensors into one staging buffer per
save, host tensors cloned as before.

No GPU here. What is checked: the staging buffer's logic, run for real on host tensors of every kind a
trainer has (dtypes of 1 to 8 bytes, 0-d, empty, non-contiguous): each copy is a view into one buffer,
aligned, none overlapping, byte-identical to its source and independent of it; that the snapshot sends
every tensor not on the CPU, and only those, to one staged copy, pinned when they are on CUDA; and that
the CPU path is byte for byte what it was (a private contiguous clone). The pinned, non-blocking copies
and their one wait run on a GPU in scripts/gpu_smoke.sh.
"""

from __future__ import annotations

import torch

from elastic_ft.checkpoint import writer


def kinds() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(6, 10, generator=g, dtype=torch.float64)
    return [
        torch.randn(3, 5, generator=g),  # float32
        torch.randn(7, generator=g).to(torch.bfloat16),  # 2 bytes, odd count: the next must realign
        torch.tensor(3.0),  # 0-d (an optimizer's step)
        torch.randint(0, 9, (2, 3), generator=g),  # int64
        torch.zeros(0, 4),  # empty
        torch.tensor([True, False, True]),  # 1 byte
        wide.t()[::2],  # non-contiguous view
    ]


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_staged_copies_are_aligned_views_of_one_buffer_byte_identical_to_their_sources():
    sources = kinds()
    offsets, size = writer.staging_layout(sources)
    assert all(o % writer.STAGING_ALIGN == 0 for o in offsets)
    spans = [(o, o + t.numel() * t.element_size()) for o, t in zip(offsets, sources)]
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])) and size == spans[-1][1]

    copies = writer.staged_copy(sources, pin=False)
    assert len({c.untyped_storage().data_ptr() for c in copies}) == 1  # one buffer for the whole save
    for src, copy, offset in zip(sources, copies, offsets):
        assert (copy.dtype, copy.shape, copy.is_contiguous()) == (src.dtype, src.shape, True)
        assert copy.storage_offset() * copy.element_size() == offset
        assert as_bytes(copy) == as_bytes(src)
    before = [as_bytes(c) for c in copies]
    for src in sources:
        src.add_(1) if src.dtype != torch.bool else src.logical_not_()  # training moves on
    assert [as_bytes(c) for c in copies] == before


def test_device_tensors_go_to_one_staged_copy_and_host_tensors_are_cloned(monkeypatch):
    calls = []

    def staged(tensors, *, pin):
        calls.append(([t.device.type for t in tensors], pin))
        return [torch.zeros(t.shape, dtype=t.dtype) for t in tensors]

    monkeypatch.setattr(writer, "staged_copy", staged)
    host = torch.arange(4.0)
    state = {"model": {"a": torch.empty(2, 3, device="meta"), "b": host},
             "optimizer": {"a.exp_avg": torch.empty(2, 3, device="meta"), "step": torch.tensor(1.0)}}
    snap = writer.snapshot(5, 40, state, documents={}, config_hash="h")
    assert calls == [(["meta", "meta"], False)]  # one staged copy for the save; not pinned off CUDA
    assert list(snap.tensors["model"]) == ["a", "b"] and list(snap.tensors["optimizer"]) == ["a.exp_avg", "step"]
    assert snap.tensors["model"]["b"] is not host and torch.equal(snap.tensors["model"]["b"], host)


def test_the_cpu_path_is_a_private_contiguous_clone_byte_for_byte():
    sources = kinds()
    state = {"model": {f"t{i}": t for i, t in enumerate(sources)}}
    snap = writer.snapshot(1, 8, state, documents={}, config_hash="h")
    for name, src in state["model"].items():
        copy = snap.tensors["model"][name]
        assert copy.is_contiguous()
        assert not src.numel() or copy.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()
        assert (copy.dtype, copy.shape) == (src.dtype, src.shape) and as_bytes(copy) == as_bytes(src)
