"""The one way pflower registers what a configuration names by a string: a model
(``learning/models.py: MODELS``), a dataset source (``learning/datasets/pools.py: SOURCES``), a
parameter-role rule (``common/roles.py: RULES``). Methods are the exception by design: a method
is its YAML row (``conf/strategy/<name>.yaml``, read by ``common/methods.py``).

Adding one is one ``REGISTRY.add(name, entry)`` line beside the others; a name registered twice
is refused at import, and an unknown name is answered with the valid ones."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Entries of one ``kind``, by name, in the order they were added."""

    def __init__(self, kind: str, error: type[Exception] = ValueError) -> None:
        self.kind, self.error = kind, error
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T) -> T:
        """Register ``entry`` as ``name`` (returns it); a name taken already is refused."""
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._entries[name] = entry
        return entry

    def __getitem__(self, name: str) -> T:
        if name not in self._entries:
            raise self.error(f"unknown {self.kind} {name!r}; valid: {', '.join(self._entries)}")
        return self._entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
