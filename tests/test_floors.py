"""The library's floors, as README's layout table gives them: every module of
`jaxrlhf/` is on one floor, and imports only modules of its own floor or of
the floors below it.

The table is the one statement of the floors; this test reads it, so a
module missing from it, or an import that climbs, fails here with the
importing file, the line and both floors.

Two more rules of the layout are checked from the same import reader: no
import circle among the modules (a function-level import counts: it only
hides a circle), and no module over 800 lines.
"""

import ast
import pathlib
import re

from conftest import REPO

PACKAGE = REPO / "jaxrlhf"


def floor_table():
  """[(floor name, [path patterns])], top floor first, from README.md's
  table under "The library reads top to bottom"."""
  text = (REPO / "README.md").read_text()
  start = text.index("The library reads top to bottom")
  rows = []
  for line in text[start:].splitlines()[1:]:
    if rows and not line.startswith("|"):
      break
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) < 3 or cells[0] in ("floor", "") or set(cells[0]) <= {"-"}:
      continue
    rows.append((cells[0], re.findall(r"`([^`]+)`", cells[1])))
  return rows


def module_floors():
  """{path relative to jaxrlhf/: (floor index, floor name)}."""
  floors = {}
  for index, (name, patterns) in enumerate(floor_table()):
    for pattern in patterns:
      paths = (PACKAGE.glob(pattern + "**/*.py") if pattern.endswith("/")
               else [PACKAGE / pattern])
      for path in paths:
        floors[str(path.relative_to(PACKAGE))] = (index, name)
  return floors


def _module_path(dotted: str):
  """jaxrlhf/... file of a dotted module name, or None (an attribute)."""
  parts = dotted.split(".")[1:]
  base = PACKAGE.joinpath(*parts) if parts else PACKAGE
  for candidate in (base.with_suffix(".py"), base / "__init__.py"):
    if candidate.is_file():
      return str(candidate.relative_to(PACKAGE))
  return None


def imported_modules(path: pathlib.Path):
  """(line, jaxrlhf module file) of every import in `path`, at any depth
  (a function-level import climbs as much as one at the top)."""
  tree = ast.parse(path.read_text(), str(path))
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.split(".")[0] == "jaxrlhf":
          yield node.lineno, _module_path(alias.name)
    elif isinstance(node, ast.ImportFrom) and node.module and (
        node.module.split(".")[0] == "jaxrlhf") and node.level == 0:
      for alias in node.names:
        module = _module_path(f"{node.module}.{alias.name}")
        yield node.lineno, module or _module_path(node.module)


def test_the_floor_table_names_every_module_once():
  floors = module_floors()
  every = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")}
  missing = sorted(every - set(floors))
  assert not missing, f"modules not in README's floor table: {missing}"
  assert len(floor_table()) >= 6


def test_no_floor_imports_a_floor_above_it():
  floors = module_floors()
  climbs = []
  for relative, (level, name) in sorted(floors.items()):
    for line, module in imported_modules(PACKAGE / relative):
      if module is None or module not in floors:
        continue
      target_level, target_name = floors[module]
      if target_level < level:
        climbs.append(f"jaxrlhf/{relative}:{line} ({name}) imports "
                      f"jaxrlhf/{module} ({target_name})")
  assert not climbs, "\n".join(climbs)


def test_the_check_sees_a_climbing_import(tmp_path):
  """The import reader finds imports inside functions too (a check that
  never finds anything would pass whatever the tree holds)."""
  source = tmp_path / "example.py"
  source.write_text("import os\n\ndef f():\n  from jaxrlhf.train import loop\n"
                    "  import jaxrlhf.algorithms.base\n")
  assert [m for _, m in imported_modules(source)] == [
      "train/loop.py", "algorithms/base.py"]


# The most lines a module of jaxrlhf/ may have: a longer one holds more than
# one concern, to be split by concern.
MAX_MODULE_LINES = 800


def import_graph(package: pathlib.Path = PACKAGE):
  """{module file: set of jaxrlhf module files it imports}, relative to
  jaxrlhf/, top-level and function-level imports alike (`imported_modules`).
  A module importing itself is no edge."""
  graph = {}
  for path in sorted(package.rglob("*.py")):
    relative = str(path.relative_to(package))
    graph[relative] = {m for _, m in imported_modules(path)
                       if m is not None and m != relative}
  return graph


def import_cycles(graph):
  """[(cycle [a, b, ..., a], every node of its circle)], one per strongly
  connected component of `graph` ({node: set of nodes}) with more than one
  node: the shortest cycle from the component's smallest node (ties to the
  smaller next node), and the sorted component; [] when the graph has no
  cycle."""
  # Tarjan's strongly connected components, iteratively (no recursion
  # limit on a long chain).
  index, low, on_stack, stack, components = {}, {}, set(), [], []
  for root in sorted(graph):
    if root in index:
      continue
    work = [(root, iter(sorted(graph.get(root, ()))))]
    index[root] = low[root] = len(index)
    stack.append(root)
    on_stack.add(root)
    while work:
      node, children = work[-1]
      child = next(children, None)
      if child is not None:
        if child not in index:
          index[child] = low[child] = len(index)
          stack.append(child)
          on_stack.add(child)
          work.append((child, iter(sorted(graph.get(child, ())))))
        elif child in on_stack:
          low[node] = min(low[node], index[child])
        continue
      work.pop()
      if work:
        low[work[-1][0]] = min(low[work[-1][0]], low[node])
      if low[node] == index[node]:
        component = set()
        while True:
          member = stack.pop()
          on_stack.discard(member)
          component.add(member)
          if member == node:
            break
        if len(component) > 1:
          components.append(component)
  cycles = []
  for component in sorted(components, key=min):
    # The shortest way back to the start within the component (breadth
    # first), so the message names a real cycle, not just its members.
    start = min(component)
    came_from = {}
    frontier = [start]
    while start not in came_from:
      following = []
      for node in frontier:
        for child in sorted(graph[node] & component):
          if child not in came_from:
            came_from[child] = node
            following.append(child)
      frontier = following
    path = [start]
    node = came_from[start]
    while node != start:
      path.append(node)
      node = came_from[node]
    cycles.append(([start] + path[:0:-1] + [start], sorted(component)))
  return cycles


def test_no_import_cycle_among_modules():
  cycles = import_cycles(import_graph())
  assert not cycles, "import cycles among jaxrlhf/ modules:\n" + "\n".join(
      " -> ".join(f"jaxrlhf/{m}" for m in cycle)
      + f"\n  (the circle holds {', '.join(members)})"
      for cycle, members in cycles)


def test_the_cycle_finder_sees_a_cycle():
  """A finder that never finds one would pass whatever the tree holds."""
  graph = {"a.py": {"b.py"}, "b.py": {"c.py", "d.py"}, "c.py": {"a.py"},
           "d.py": set(), "e.py": {"e.py", "d.py"}}
  assert import_cycles(graph) == [(["a.py", "b.py", "c.py", "a.py"],
                                   ["a.py", "b.py", "c.py"])]
  assert import_cycles({"x.py": {"y.py"}, "y.py": set()}) == []
  assert import_cycles({"p.py": {"q.py"}, "q.py": {"p.py"}}) == [
      (["p.py", "q.py", "p.py"], ["p.py", "q.py"])]


def test_the_import_graph_reads_function_level_imports(tmp_path):
  (tmp_path / "one.py").write_text(
      "import os\n\ndef f():\n  from jaxrlhf.models import family\n")
  (tmp_path / "two.py").write_text("from jaxrlhf import checks\n")
  assert import_graph(tmp_path) == {"one.py": {"models/family.py"},
                                    "two.py": {"checks.py"}}


def test_no_module_is_over_the_line_limit():
  long = sorted(
      f"jaxrlhf/{p.relative_to(PACKAGE)}: {n} lines"
      for p in PACKAGE.rglob("*.py")
      if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES)
  assert not long, (f"modules over {MAX_MODULE_LINES} lines (split them by "
                    "concern):\n" + "\n".join(long))
