"""Tracing a kernel launch's pointer arguments back to a call's inputs (for launches kept
across calls: ``kernels.launch.kept_matmul_ogs``).

Inputs are nested dataclasses and dicts of tensors (triton_kernels' routing data, precision
configs, tensor wrappers); a *path* names one tensor among them, ``(root index, (is_item,
name), ...)``, so the same tensor can be found in a later call's inputs.
"""

from __future__ import annotations

import dataclasses

import torch

SCALARS = (int, float, bool, str, type(None), torch.dtype)  # launch values kept as they are


def tensor_paths(roots: tuple, depth: int = 5) -> list[tuple[tuple, torch.Tensor]]:
    """Every tensor reachable from ``roots`` through dataclass fields and dict items, with its
    path ``(root index, (is_item, name), ...)``, in a fixed order."""
    found: list[tuple[tuple, torch.Tensor]] = []

    def walk(obj, path: tuple, left: int) -> None:
        if isinstance(obj, torch.Tensor):
            found.append((path, obj))
        elif left == 0 or isinstance(obj, SCALARS):
            return
        elif isinstance(obj, dict):
            for name, value in obj.items():
                walk(value, path + ((True, name),), left - 1)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name), path + ((False, f.name),), left - 1)

    for i, root in enumerate(roots):
        walk(root, (i,), depth)
    return found


def resolve(roots: tuple, path: tuple):
    """The object at ``path`` (``tensor_paths``' form) among ``roots``."""
    obj = roots[path[0]]
    for is_item, name in path[1:]:
        obj = obj[name] if is_item else getattr(obj, name)
    return obj


def signature(obj, depth: int = 5):
    """A hashable summary of ``obj``: tensors by shape, strides and dtype, dataclasses by field,
    dicts by item, scalars by value, anything else by type and ``name``."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", tuple(obj.shape), obj.stride(), obj.dtype)
    if isinstance(obj, SCALARS):
        return obj
    if depth and isinstance(obj, dict):
        return tuple((k, signature(v, depth - 1)) for k, v in obj.items())
    if depth and dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (type(obj).__name__,) + tuple(
            (f.name, signature(getattr(obj, f.name), depth - 1)) for f in dataclasses.fields(obj))
    if isinstance(obj, (list, tuple)):
        return tuple(signature(v, depth) for v in obj)
    return (type(obj).__name__, getattr(obj, "name", None))


def trace(value: torch.Tensor, sources: list) -> tuple[tuple, int] | None:
    """``(path, byte offset)`` of the source whose bytes hold ``value``'s first address; None
    when none does, or sources starting at different addresses do."""
    ptr, hit = value.data_ptr(), None
    for path, t in sources:
        start = t.data_ptr()
        if start <= ptr < start + max(1, t.numel()) * t.element_size():
            if hit is None:
                hit = (path, ptr - start, start)
            elif hit[2] != start:
                return None
    return None if hit is None else hit[:2]


def unwrap_pointer(value):
    """For a pointer wrapper (triton_kernels' ``Tensor``: an object with ``data_ptr()``,
    ``dtype`` and ``data``, which Triton launches as a pointer of that dtype) the torch tensor
    it wraps — same address and dtype, so the same specialisation; ``value`` itself otherwise."""
    if isinstance(value, (torch.Tensor,) + SCALARS):
        return value
    data = getattr(value, "data", None)
    if (callable(getattr(value, "data_ptr", None)) and isinstance(data, torch.Tensor)
            and data.data_ptr() == value.data_ptr() and data.dtype == value.dtype):
        return data
    return value
