"""Name -> function registries for swappable pieces (losses, advantages, rewards).

  POLICY_LOSSES = registry.Registry("policy loss")

  @POLICY_LOSSES.register("exgrpo")
  def exgrpo_loss(...): ...

  POLICY_LOSSES.get(config.algo.loss)   # a clear error lists the known names
"""

from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)


class Registry:
  """A named table of functions with a decorator to fill it."""

  def __init__(self, kind: str):
    self.kind = kind
    self._table: dict[str, Callable] = {}

  def register(self, name: str) -> Callable[[F], F]:
    def decorator(fn: F) -> F:
      if name in self._table:
        raise ValueError(f"{self.kind} {name!r} is already registered")
      self._table[name] = fn
      return fn
    return decorator

  def get(self, name: str) -> Callable:
    if name not in self._table:
      raise KeyError(f"unknown {self.kind} {name!r}; known: {', '.join(sorted(self._table))}")
    return self._table[name]

  def names(self) -> list[str]:
    return sorted(self._table)

  def __contains__(self, name: str) -> bool:
    return name in self._table
