"""Declared config fields: defaults, documentation and checks in one place.

A config group is a list of fields, each with its default, what it means,
and what values it may take; the ml_collections ConfigDict that experiments
edit is built from the groups (`build`), every value is checked against its
declaration at start-up (`check`), and the reference documentation is
rendered from the same declarations (`render_markdown`). A field that
defaults to None is a typed placeholder: it may be set with a value of its
`type`, and means something derived (its doc says what) while unset.

  KTO = Group("kto", "KTO (Ethayarajh et al. 2024).", [
      Field("beta", 0.1, "KL weight of the implicit reward.", bounds=">0"),
      Field("loss", "kto", "Which loss.", choices=("kto", "kto_pair")),
  ], checks=[...])

`bounds` is a short range: ">0", ">=0", "<=1", "[0, 1]", "(0, 1]", "[1, inf)".
`choices` are the allowed values, taken from the module that defines them
(e.g. `preference.DPO_LOSS_TYPES`), never retyped. Every numeric field has
one or the other: a numeric field declared without a range is an error at
import, so a field whose every finite value is meaningful says so with
`bounds=ANY_NUMBER`. NaN and infinities are refused for every numeric field.

`resumable=True` marks a field that may change when a run resumes from its
checkpoints (how long it trains, how often it logs, saves and evaluates, how
it is laid out on devices): the other fields define the run, and a resume
that changes one of them is refused (`jaxrlhf.train.workdir`).
"""

import dataclasses
import math
import re
from typing import Any, Callable, Optional, Sequence, Tuple, Union

import ml_collections
from ml_collections import config_dict


@dataclasses.dataclass(frozen=True)
class Bounds:
  """A closed, open or half-open interval; None is unbounded."""
  low: Optional[float] = None
  high: Optional[float] = None
  low_open: bool = False
  high_open: bool = False

  def contains(self, value) -> bool:
    if self.low is not None and (value < self.low or (
        self.low_open and value == self.low)):
      return False
    if self.high is not None and (value > self.high or (
        self.high_open and value == self.high)):
      return False
    return True

  def describe(self) -> str:
    if self.high is None and self.low is None:
      return "any finite number"
    if self.high is None:
      return f"{'>' if self.low_open else '>='} {_number(self.low)}"
    if self.low is None:
      return f"{'<' if self.high_open else '<='} {_number(self.high)}"
    return (f"in {'(' if self.low_open else '['}{_number(self.low)}, "
            f"{_number(self.high)}{')' if self.high_open else ']'}")


def _number(x) -> str:
  return f"{x:g}" if isinstance(x, float) else str(x)


_COMPARISON = re.compile(r"^\s*(>=|<=|>|<)\s*(\S+)\s*$")
_INTERVAL = re.compile(r"^\s*([\[(])\s*(\S+)\s*,\s*(\S+)\s*([\])])\s*$")


# The range of a numeric field whose every finite value means something.
ANY_NUMBER = "(-inf, inf)"


def parse_bounds(text: str) -> Bounds:
  """">0", ">=1", "<=1", "[0, 1]", "(0, 1]", "[1, inf)" -> Bounds."""
  number = lambda s: None if s in ("inf", "-inf") else float(s)
  match = _COMPARISON.match(text)
  if match:
    op, value = match.group(1), number(match.group(2))
    if op.startswith(">"):
      return Bounds(low=value, low_open=op == ">")
    return Bounds(high=value, high_open=op == "<")
  match = _INTERVAL.match(text)
  if match:
    return Bounds(low=number(match.group(2)), high=number(match.group(3)),
                  low_open=match.group(1) == "(",
                  high_open=match.group(4) == ")")
  raise ValueError(f"bounds {text!r}: use '>0', '>=0', '[0, 1]' and the "
                   "like.")


@dataclasses.dataclass(frozen=True)
class Field:
  """One config field.

  Attributes:
    name: the key in its group.
    default: its value in a fresh config; None makes it a placeholder of
      `type`.
    doc: what it means (and, for a placeholder, what unset means).
    type: the placeholder's type (int, float, str, bool); ignored otherwise.
    choices: the allowed values.
    bounds: the allowed numeric range (see `parse_bounds`); required for a
      numeric field without `choices` (`ANY_NUMBER` when any is allowed).
    resumable: the field may change when the run resumes (see module doc).
    path: the field names a file, a glob of files or a checkpoint the run
      reads; when set, it must match something readable at start-up.
    read_when: for a path field, (config) -> whether the run reads it (a
      paper config's placeholder for a reward-model judge does not block a
      run judged by a function); None = always.
  """
  name: str
  default: Any
  doc: str
  type: Optional[type] = None
  choices: Optional[Sequence[Any]] = None
  bounds: Optional[str] = None
  resumable: bool = False
  path: bool = False
  read_when: Optional[Callable[[Any], bool]] = None

  def __post_init__(self):
    if self.default is None and self.type is None:
      raise ValueError(f"Field {self.name!r}: a placeholder (default None) "
                       "needs a type.")
    if self.bounds is not None:
      parse_bounds(self.bounds)  # fails at import on a typo
    elif self.is_numeric and self.choices is None:
      raise ValueError(
          f"Field {self.name!r}: a numeric field needs bounds= (e.g. '>0', "
          "'[0, 1]') or choices=; bounds=ANY_NUMBER if every value is "
          "allowed.")

  @property
  def is_numeric(self) -> bool:
    """An int or float field (bool is not a number here)."""
    if self.default is None:
      return self.type in (int, float)
    return (isinstance(self.default, (int, float))
            and not isinstance(self.default, bool))

  def value_error(self, value) -> Optional[str]:
    """Why `value` is not allowed, or None."""
    if value is None:
      return None  # an unset placeholder
    if self.choices is not None and value not in tuple(self.choices):
      return f"{value!r} is not one of {tuple(self.choices)}."
    if self.bounds is not None:
      if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{value!r} is not a number."
      if isinstance(value, float) and not math.isfinite(value):
        return f"{value!r} is not a finite number."
      bounds = parse_bounds(self.bounds)
      if not bounds.contains(value):
        return f"{value!r} must be {bounds.describe()}."
    return None


# A cross-field check of a group: given the whole config, raises ValueError
# "config.<field>: ..." when a combination is wrong.
Check = Callable[[ml_collections.ConfigDict], None]


@dataclasses.dataclass(frozen=True)
class Group:
  """A named group of fields (and nested groups), with cross-field checks;
  `resumable=True`: every field of it may change when a run resumes."""
  name: str
  doc: str
  fields: Sequence[Union[Field, "Group"]]
  checks: Sequence[Check] = ()
  resumable: bool = False

  def __post_init__(self):
    names = [f.name for f in self.fields]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
      raise ValueError(f"Group {self.name!r} declares {repeated} twice.")


def _value(field: Field):
  if field.default is None:
    return config_dict.placeholder(field.type)
  if isinstance(field.default, (list, tuple)):
    return tuple(field.default)
  return field.default


def build(groups: Sequence[Union[Field, Group]]) -> ml_collections.ConfigDict:
  """A ConfigDict holding every field of `groups` at its default."""
  c = ml_collections.ConfigDict()
  for item in groups:
    if isinstance(item, Group):
      c[item.name] = build(item.fields)
    else:
      c[item.name] = _value(item)
  return c


def walk(groups: Sequence[Union[Field, Group]], prefix: str = ""
         ) -> Sequence[Tuple[str, Field]]:
  """(dotted path, Field) of every field, in declaration order."""
  out = []
  for item in groups:
    if isinstance(item, Group):
      out.extend(walk(item.fields, f"{prefix}{item.name}."))
    else:
      out.append((f"{prefix}{item.name}", item))
  return out


def resumable_paths(groups: Sequence[Union[Field, Group]], prefix: str = "",
                    inherited: bool = False) -> Sequence[str]:
  """Dotted paths of the fields that may change when a run resumes."""
  out = []
  for item in groups:
    if isinstance(item, Group):
      out.extend(resumable_paths(item.fields, f"{prefix}{item.name}.",
                                 inherited or item.resumable))
    elif inherited or item.resumable:
      out.append(f"{prefix}{item.name}")
  return out


def path_fields(groups: Sequence[Union[Field, Group]]
                ) -> Sequence[Tuple[str, Field]]:
  """(dotted path, Field) of the fields that name files a run reads."""
  return [(path, field) for path, field in walk(groups) if field.path]


def checks_of(groups: Sequence[Union[Field, Group]]) -> Sequence[Check]:
  out = []
  for item in groups:
    if isinstance(item, Group):
      out.extend(item.checks)
      out.extend(checks_of(item.fields))
  return out


def get(c: ml_collections.ConfigDict, path: str):
  node = c
  for name in path.split("."):
    node = node[name]
  return node


def check(c: ml_collections.ConfigDict,
          groups: Sequence[Union[Field, Group]]) -> None:
  """Every declared field's value, then every group's cross-field checks;
  the first problem is a ValueError naming the field."""
  for path, field in walk(groups):
    problem = field.value_error(get(c, path))
    if problem:
      raise ValueError(f"config.{path}: {problem}")
  for group_check in checks_of(groups):
    group_check(c)


def require(condition: bool, field: str, message: str) -> None:
  """A cross-field check's one line: "config.<field>: <message>"."""
  if not condition:
    raise ValueError(f"config.{field}: {message}")


def render_markdown(groups: Sequence[Union[Field, Group]],
                    heading_level: int = 2) -> str:
  """The reference documentation of `groups`: one section per group, one
  table row per field (default, allowed values, meaning)."""
  lines = []

  def section(group: Group, prefix: str, level: int):
    path = f"{prefix}{group.name}"
    lines.append(f"{'#' * level} `{path}`")
    lines.append("")
    lines.append(group.doc + (" Its fields may change when the run resumes."
                              if group.resumable else ""))
    lines.append("")
    fields = [f for f in group.fields if isinstance(f, Field)]
    if fields:
      lines.append("| field | default | allowed | meaning |")
      lines.append("| --- | --- | --- | --- |")
      for f in fields:
        default = ("unset" if f.default is None else f"`{f.default!r}`")
        allowed = ""
        if f.choices is not None:
          allowed = ", ".join(f"`{c!r}`" for c in f.choices)
        elif f.bounds is not None:
          allowed = parse_bounds(f.bounds).describe()
        doc = " ".join(f.doc.split()).replace("|", "\\|")
        if f.resumable:
          doc += " (May change when the run resumes.)"
        if f.path:
          doc += " (A path: when set, it must exist at start-up.)"
        lines.append(f"| `{f.name}` | {default} | {allowed} | {doc} |")
      lines.append("")
    for sub in group.fields:
      if isinstance(sub, Group):
        section(sub, f"{path}.", level + 1)

  top = [f for f in groups if isinstance(f, Field)]
  if top:
    section(Group("config", "Top-level fields.", top), "", heading_level)
  for item in groups:
    if isinstance(item, Group):
      section(item, "", heading_level)
  return "\n".join(lines).rstrip() + "\n"
