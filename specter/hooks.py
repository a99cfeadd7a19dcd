"""Per-call hooks: attributes of shared objects set for the duration of a block and restored afterwards."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager


@contextmanager
def attributes_set(objects: Iterable, **values) -> Iterator[None]:
    """Set each attribute in `values` on every object inside the block; the previous values afterwards
    (also when the block raises)."""
    objects = list(objects)
    previous = [{name: getattr(obj, name) for name in values} for obj in objects]
    for obj in objects:
        for name, value in values.items():
            setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, old in zip(objects, previous):
            for name, value in old.items():
                setattr(obj, name, value)
