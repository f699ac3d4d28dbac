"""A model's weights in transparent huge pages (2 MiB) on Linux CPUs.

Why: a decode step reads every weight once, from DRAM, as a few long streams. With 4 KiB pages
the CPU's hardware prefetchers stop at every page boundary and each page needs its own TLB entry,
so a stream keeps stalling to restart; with 2 MiB pages it runs on. Streaming SmolLM2-shaped
projections (576 x 1536 fp32, 1 GB of them, 2 threads, Intel Xeon with AVX-512) through the CPU's
`linear` kernel ran 1.09x / 1.12x / 1.16x faster at 1 / 8 / 16 rows.

How: one anonymous mapping sized for all the tensors, advised MADV_HUGEPAGE before anything is
written to it (on kernels whose THP mode is `madvise`, the common default, only advised memory
gets huge pages, and pages touched before the advice stay small); each tensor is then copied in
at a 64-byte aligned offset and the model keeps the views. torch's own `THP_MEM_ALLOC_ENABLE`
does the same per allocation, but it is read once per process, before the model exists.

The paged KV cache is allocated the same way (`zeros_in_huge_pages`): attention streams it too.

`EECORE_HUGE_PAGES=0` keeps the weights where they were loaded (to compare, or where memory is
tight: packing holds a second copy of the tensors the loaded checkpoint still holds).
"""
from __future__ import annotations

import dataclasses
import mmap
import weakref
from typing import Any

import torch

from eecore import envs

HUGE_PAGE_BYTES = 2 << 20
_ALIGNMENT = 64  # the CPU kernels' weight alignment (eecore.models.weights.WEIGHT_ALIGNMENT)


def huge_pages_enabled() -> bool:
    """Whether weights are packed into huge pages: Linux (MADV_HUGEPAGE exists) and not disabled
    by EECORE_HUGE_PAGES=0."""
    return hasattr(mmap, "MADV_HUGEPAGE") and envs.flag("EECORE_HUGE_PAGES")


def _aligned(nbytes: int) -> int:
    return (nbytes + _ALIGNMENT - 1) // _ALIGNMENT * _ALIGNMENT


# Address ranges of the live buffers weight_buffer made: what place_in_huge_pages leaves in place.
_WRITTEN_IN_PLACE: set[tuple[int, int]] = set()


def _advised_arena(nbytes: int, in_place: bool = False) -> torch.Tensor | None:
    """`nbytes` of zeros (uint8) starting on a huge-page boundary, in an anonymous mapping advised
    MADV_HUGEPAGE before anything touches it; None where huge pages are not available. Pages are
    backed on first write, so a large buffer costs memory only as it fills. `in_place`: the range
    is recorded (while the mapping lives) as one whose tensors need no packing."""
    if not huge_pages_enabled():
        return None
    # One huge page more than needed, so the range can start on a 2 MiB boundary (the kernel only
    # maps whole aligned huge pages; the unused head is never touched, never backed).
    size = (nbytes + HUGE_PAGE_BYTES - 1) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES + HUGE_PAGE_BYTES
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP compiled out or disabled ("never"): plain pages would only cost a copy
        mapping.close()
        return None
    arena = torch.frombuffer(mapping, dtype=torch.uint8)  # the tensor keeps the mapping alive
    start = -arena.data_ptr() % HUGE_PAGE_BYTES
    if in_place:
        span = (arena.data_ptr() + start, arena.data_ptr() + start + nbytes)
        _WRITTEN_IN_PLACE.add(span)
        weakref.finalize(mapping, _WRITTEN_IN_PLACE.discard, span)  # when the last view is gone
    return arena[start:start + nbytes]


def weight_buffer(nbytes: int) -> torch.Tensor:
    """uint8 `[nbytes]` for weights a loader writes in place (a GGUF file's blocks): in huge pages
    where they are available, else a plain allocation. place_in_huge_pages leaves the tensors in it
    where they are, so the weights are copied once, from the file."""
    arena = _advised_arena(nbytes, in_place=True) if nbytes > 0 else None
    return torch.empty(nbytes, dtype=torch.uint8) if arena is None else arena


def _written_in_place(t: torch.Tensor) -> bool:
    ptr = t.data_ptr()
    return any(start <= ptr < end for start, end in _WRITTEN_IN_PLACE)


def zeros_in_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """A zero-filled CPU tensor in huge pages (a paged KV cache), or None where they are not
    available (the caller then allocates as usual)."""
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    arena = _advised_arena(nbytes) if nbytes > 0 else None
    return None if arena is None else arena.view(dtype).view(shape)


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors of a weight attribute: a tensor, a list or tuple of them, a dataclass of them (a
    layer's weights, an Int8Weight's integers and scales, a GGUFWeight's blocks), nested; None and
    other values hold none."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for f in dataclasses.fields(value) for t in _tensors_in(getattr(value, f.name))]
    return []


def place_in_huge_pages(*holders: tuple[object, tuple[str, ...]]) -> bool:
    """Move the weights held in each `(object, attribute names)` into one huge-page mapping: every
    tensor of those attributes (see _tensors_in) is replaced by its packed copy, and a tensor held
    twice (tied embeddings) stays one tensor. Returns whether anything moved (not where huge pages
    are unavailable: the weights then stay as they are).

    Tensors move one at a time, list items (a model's layers) replaced in place as they go, so an
    original nothing else holds is freed before the next is copied: with a consumed checkpoint the
    peak is the weights plus one layer, not the weights twice."""
    unique: dict[int, torch.Tensor] = {}
    for obj, names in holders:
        for name in names:
            for t in _tensors_in(getattr(obj, name)):
                if _written_in_place(t):
                    continue
                if t.device.type != "cpu" or not t.is_contiguous():
                    raise ValueError(f"place_in_huge_pages: expected contiguous CPU tensors, got {t.device} "
                                     f"{'contiguous' if t.is_contiguous() else 'strided'} {tuple(t.shape)}")
                unique.setdefault(id(t), t)
    total = sum(_aligned(t.nbytes) for t in unique.values())
    arena = _advised_arena(total) if total > 0 else None
    del unique
    if arena is None:
        return False
    packed: dict[int, torch.Tensor] = {}  # id(original) -> its copy (an id is only looked up while alive)
    offset = 0

    def move(value: Any) -> Any:
        nonlocal offset
        if isinstance(value, torch.Tensor):
            if _written_in_place(value):
                return value
            if id(value) not in packed:
                view = arena[offset:offset + value.nbytes].view(value.dtype).view(value.shape)
                view.copy_(value)
                packed[id(value)] = view
                offset += _aligned(value.nbytes)
            return packed[id(value)]
        if isinstance(value, list):
            for k in range(len(value)):
                value[k] = move(value[k])
            return value
        if isinstance(value, tuple):
            return type(value)(move(v) for v in value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return dataclasses.replace(value, **{f.name: move(getattr(value, f.name))
                                                 for f in dataclasses.fields(value) if f.init})
        return value

    for obj, names in holders:
        for name in names:
            setattr(obj, name, move(getattr(obj, name)))
    return True
