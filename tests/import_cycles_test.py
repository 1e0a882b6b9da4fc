"""No import cycles in exgrpo_jax/: the module graph from every import statement.

Every `import` / `from ... import` anywhere in a module counts, those inside functions too
(an import deferred into a function still ties the two modules together: it only moves the
failure to the first call). An import of `exgrpo_jax.a.b` also runs the packages
`exgrpo_jax.a` and `exgrpo_jax` (their `__init__`), so those are edges as well, except the
packages that contain the importing module (Python has started them before it).
"""

import ast
import os

from tests import conftest

PACKAGE = "exgrpo_jax"


def _modules() -> dict[str, str]:
  """Module name -> file of every module of the package (packages by their __init__)."""
  root, found = os.path.join(conftest.REPO_ROOT, PACKAGE), {}
  for directory, _, files in os.walk(root):
    for name in files:
      if name.endswith(".py"):
        parts = os.path.relpath(os.path.join(directory, name[:-3]), conftest.REPO_ROOT)
        module = parts.replace(os.sep, ".").removesuffix(".__init__")
        found[module] = os.path.join(directory, name)
  return found


def _with_packages(module: str, importer: str) -> set[str]:
  """`module` and the packages an import of it runs, less the importer's own packages."""
  parts = module.split(".")
  chain = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
  own = importer.split(".")
  return chain - {".".join(own[:i]) for i in range(1, len(own))}


def import_graph() -> dict[str, set[str]]:
  """Module -> the package modules its import statements run."""
  modules, graph = _modules(), {}
  for module, path in modules.items():
    is_package = path.endswith("__init__.py")
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read(), path)
    targets = set()
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        targets |= {a.name for a in node.names if a.name.split(".")[0] == PACKAGE}
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: from the importer's package
          anchor = module.split(".")[:len(module.split(".")) + is_package - node.level]
          base = ".".join(anchor + ([base] if base else []))
        if base.split(".")[0] != PACKAGE:
          continue
        for alias in node.names:
          name = f"{base}.{alias.name}"
          targets.add(name if name in modules else base)
    graph[module] = set()
    for target in targets:
      graph[module] |= {m for m in _with_packages(target, module) if m in modules}
    graph[module].discard(module)
  return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One cycle as [a, b, ..., a], or None (depth-first search, sorted for stable output)."""
  state, stack = {}, []

  def visit(node):
    state[node] = "open"
    stack.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == "open":
        return stack[stack.index(nxt):] + [nxt]
      if nxt not in state:
        cycle = visit(nxt)
        if cycle:
          return cycle
    state[node] = "done"
    stack.pop()
    return None

  for node in sorted(graph):
    if node not in state:
      cycle = visit(node)
      if cycle:
        return cycle
  return None


def test_find_cycle_names_one():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_graph_sees_deferred_imports_and_packages():
  graph = import_graph()
  # data/readers.py imports models.loading inside a function: an edge, with its package.
  assert {"exgrpo_jax.models.loading", "exgrpo_jax.models"} <= graph["exgrpo_jax.data.readers"]
  # `from exgrpo_jax.data import readers` in data/questions.py: the module, not the package
  # the importer is in; `from exgrpo_jax import data` elsewhere: the package.
  assert "exgrpo_jax.data.readers" in graph["exgrpo_jax.data.questions"]
  assert "exgrpo_jax.data" not in graph["exgrpo_jax.data.questions"]
  assert "exgrpo_jax.data" in graph["exgrpo_jax.eval"]


def test_no_import_cycles():
  cycle = find_cycle(import_graph())
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
  """The module graph with each module replaced by its top-level unit below the package
  (`exgrpo_jax.training.trainer` -> `exgrpo_jax.training`), the package itself left out."""
  unit = lambda m: ".".join(m.split(".")[:2])
  units = {}
  for module, targets in graph.items():
    if module != PACKAGE:
      units.setdefault(unit(module), set()).update(
          unit(t) for t in targets if t != PACKAGE and unit(t) != unit(module))
  return units


def test_no_import_runs_back_up():
  """Between the package's parts (subpackages and top-level modules) the imports run one
  way: a part never imports one that imports it (the trainer's checks import no planner
  code, the checkpoint store no trainer code)."""
  cycle = find_cycle(package_graph(import_graph()))
  assert cycle is None, "imports run back up: " + " -> ".join(cycle)
