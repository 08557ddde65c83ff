"""The library's floors, as README's layout table gives them: every module of
`jaxrlhf/` is on one floor, and imports only modules of its own floor or of
the floors below it.

The table is the one statement of the floors; this test reads it, so a
module missing from it, or an import that climbs, fails here with the
importing file, the line and both floors.
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
