"""Tools: Python functions offered to the model as JSON schemas.

A tool is a plain Python function with type hints and a Google-style
docstring (a description, then an `Args:` section with a line per
argument):

    def multiply(a: int, b: int) -> int:
      \"\"\"Multiplies two integers.

      Args:
        a: the first factor.
        b: the second factor.
      \"\"\"
      return a * b

`tool_schema(multiply)` is the function in the OpenAI function format, as
transformers' `transformers.utils.get_json_schema` writes it; that dict is
what a chat template's `tools` argument takes (`ChatTemplate.render(...,
tools=[...])`), so the model sees the tools as its family's template shows
them:

    {"type": "function",
     "function": {
         "name": "multiply", "description": "Multiplies two integers.",
         "parameters": {
             "type": "object",
             "properties": {
                 "a": {"type": "integer", "description": "the first factor."},
                 "b": {"type": "integer", "description": "the second factor."}},
             "required": ["a", "b"]},
         "return": {"type": "integer"}}}

The types, as transformers maps them (`tests/fixtures/tool_schemas.json`
holds transformers' own output for the test tools, and the test compares
ours to it key by key and in key order, since the order reaches the prompt
through the template's `tojson`):

- int, float, str, bool, None: {"type": "integer" / "number" / "string" /
  "boolean" / "null"}; Any: {} (anything);
- list, list[X]: {"type": "array"}, with "items": the schema of X;
- tuple[X, Y, ...]: {"type": "array", "prefixItems": [X's, Y's, ...]};
- dict, dict[str, X]: {"type": "object"}, with "additionalProperties": X's;
- Optional[X]: X's schema, then "nullable": true;
- Union[X, Y]: {"type": [the sorted types]} when X and Y are plain types,
  else {"anyOf": [X's, Y's]};
- Literal[...] and Enum classes: {"type": the values' types, "enum": the
  values}.

An argument with a default is not required. An argument whose docstring line
ends with `(choices: [...])` (a JSON list) gets that list as its "enum", and
the note leaves its description. The description is the docstring's text
before its first section; an argument's description is its `Args:` line and
the more indented lines under it, joined with spaces. A return annotation
gives "return": its schema, with the `Returns:` section's text as its
"description" when there is one.

Where we differ from transformers, on purpose: a `Returns:` section ends at
the next section (transformers' return description runs on through a later
`Example:` or `Args:` section), and an `Arguments:` section or a space
before an argument's colon is read where transformers refuses the function.

What we refuse, in one line naming the function and the argument (a
`ValueError`): no docstring, no description, an argument with no type hint
or no line in `Args:`, a type that has no JSON schema (a class, bytes,
tuple[X] or tuple[X, ...], as transformers refuses them), `(choices: ...)`
that is not a JSON list.

`load_tools("pkg.module:fn,pkg.module:fn2")` imports tools named in a config
(`jaxrlhf.rewards.host.load_function`, so a bad path reads as a bad reward
function path does) and checks each has a schema.
"""

import enum
import inspect
import json
import re
import types
import typing
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from jaxrlhf.rewards import host

Tool = Callable[..., Any]

# The Google-style sections that end the description or another section.
_SECTIONS = ("Args", "Arguments", "Returns", "Return", "Yields", "Raises",
             "Example", "Examples", "Note", "Notes", "Attributes", "See Also",
             "Warning", "Warnings", "Todo", "References")
_SECTION_LINE = re.compile(r"^\s*(" + "|".join(_SECTIONS) + r")\s*:\s*$")
# "name: text" or "name (type): text", the start of an argument's entry.
_ARGUMENT_LINE = re.compile(r"^\s*(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:(.*)$")
# A choices note at the end of an argument's description.
_CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.DOTALL)
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

_PLAIN_TYPES = {int: "integer", float: "number", str: "string",
                bool: "boolean", type(None): "null"}


class _NoSchema(ValueError):
  """A type hint with no JSON schema; the message says which and why."""


def _value_type(value: Any) -> str:
  """The JSON type of one Literal or Enum value."""
  if isinstance(value, bool):  # Before int: a bool is an int in Python.
    return "boolean"
  for python_type, json_type in _PLAIN_TYPES.items():
    if isinstance(value, python_type):
      return json_type
  raise _NoSchema(f"the value {value!r} has no JSON type")


def _one_or_list(names: Sequence[str]):
  """"x" for one distinct name, else the distinct names in order."""
  distinct = list(dict.fromkeys(names))
  return distinct[0] if len(distinct) == 1 else distinct


def _union_schema(members: Sequence[Any]) -> Dict[str, Any]:
  present = [m for m in members if m is not type(None)]
  if len(present) == 1:
    schema = _type_schema(present[0])
  else:
    parts = [_type_schema(m) for m in present]
    if all(set(p) == {"type"} and isinstance(p["type"], str) for p in parts):
      schema = {"type": _one_or_list(sorted({p["type"] for p in parts}))}
    else:
      schema = {"anyOf": parts}
  if len(present) < len(members):
    schema["nullable"] = True
  return schema


def _type_schema(hint: Any) -> Dict[str, Any]:
  """The JSON schema of one type hint (module docstring's table)."""
  if hint is Any:
    return {}
  if hint in _PLAIN_TYPES:
    return {"type": _PLAIN_TYPES[hint]}
  if isinstance(hint, type) and issubclass(hint, enum.Enum):
    values = [member.value for member in hint]
    return {"type": _one_or_list([_value_type(v) for v in values]),
            "enum": values}
  origin, args = typing.get_origin(hint), typing.get_args(hint)
  if origin in (typing.Union, types.UnionType):
    return _union_schema(args)
  if origin is typing.Literal:
    return {"type": _one_or_list([_value_type(v) for v in args]),
            "enum": list(args)}
  if hint is list or origin is list:
    return ({"type": "array", "items": _type_schema(args[0])} if args
            else {"type": "array"})
  if hint is tuple or origin is tuple:
    if not args:
      return {"type": "array"}
    if len(args) == 1 or args[-1] is Ellipsis:
      raise _NoSchema(f"{hint} has no JSON schema; use list[...] for a "
                      "sequence of any length")
    return {"type": "array", "prefixItems": [_type_schema(a) for a in args]}
  if hint is dict or origin is dict:
    return ({"type": "object", "additionalProperties": _type_schema(args[1])}
            if args else {"type": "object"})
  raise _NoSchema(f"{hint!r} has no JSON schema (the types are int, float, "
                  "str, bool, None, Any, list, tuple, dict, Optional, Union, "
                  "Literal and Enum classes)")


def _sections(docstring: str) -> Tuple[str, Dict[str, List[str]]]:
  """(the description, {section name: its lines}) of a cleaned docstring."""
  description, sections, current = [], {}, None
  for line in docstring.splitlines():
    header = _SECTION_LINE.match(line)
    if header:
      current = sections.setdefault(header.group(1), [])
    elif current is None:
      description.append(line)
    else:
      current.append(line)
  return "\n".join(description).strip(), sections


def _argument_docs(lines: Sequence[str]) -> Dict[str, str]:
  """{argument: description} of an `Args:` section's lines: an entry is a
  line at the section's own indentation and the deeper lines under it."""
  filled = [line for line in lines if line.strip()]
  if not filled:
    return {}
  base = min(len(line) - len(line.lstrip()) for line in filled)
  docs, name = {}, None
  for line in filled:
    entry = _ARGUMENT_LINE.match(line)
    if entry and len(line) - len(line.lstrip()) == base:
      name = entry.group(1).lstrip("*")
      docs[name] = [entry.group(2).strip()]
    elif name is not None:
      docs[name].append(line.strip())
  return {key: " ".join(p for p in parts if p) for key, parts in docs.items()}


def _choices(fn_name: str, argument: str,
             text: str) -> Tuple[str, Optional[list]]:
  """(the description without its choices note, the choices or None)."""
  note = _CHOICES.search(text)
  if not note:
    return text, None
  try:
    choices = json.loads(note.group(1))
  except ValueError:
    choices = None
  if not isinstance(choices, list):
    raise ValueError(f"tool {fn_name}: argument {argument!r} has '(choices: "
                     f"{note.group(1)})', which is not a JSON list; write "
                     "e.g. (choices: [\"celsius\", \"fahrenheit\"]).")
  choices = [c.strip() if isinstance(c, str) else c for c in choices]
  return text[:note.start()].strip(), choices


def tool_schema(fn: Tool) -> Dict[str, Any]:
  """The JSON schema of a tool function, as transformers' `get_json_schema`
  writes it (module docstring).

  Args:
    fn: a function with a type hint on each argument and a Google-style
      docstring: a description, and an `Args:` line for each argument.

  Returns:
    {"type": "function", "function": {"name", "description", "parameters":
    {"type": "object", "properties": {...}, "required": [...]}, "return"}}
    ("required" only when an argument is; "return" only with a return
    annotation).

  Raises:
    ValueError: (one line, naming the function and the argument) no
      docstring or description, an argument without a type hint or an
      `Args:` line, a type with no JSON schema, a bad choices note.
  """
  name = getattr(fn, "__name__", None)
  if not callable(fn) or not isinstance(name, str) or not _NAME.match(name):
    raise ValueError(f"tool {fn!r} is not a named function; a tool is a "
                     "def with type hints and a docstring.")
  docstring = inspect.getdoc(fn)
  if not docstring or not docstring.strip():
    raise ValueError(f"tool {name} has no docstring; write one: a "
                     "description, then an 'Args:' line per argument.")
  description, sections = _sections(docstring)
  if not description:
    raise ValueError(f"tool {name}'s docstring has no description before "
                     "its sections; say in a line what the tool does.")
  docs = _argument_docs(sections.get("Args", sections.get("Arguments", [])))
  try:
    hints = typing.get_type_hints(fn)
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f"tool {name}: its type hints cannot be read "
                     f"({type(e).__name__}: {e}).") from None
  properties, required = {}, []
  for argument in inspect.signature(fn).parameters.values():
    where = f"tool {name}: argument {argument.name!r}"
    if argument.name not in hints:
      raise ValueError(f"{where} has no type hint; annotate it "
                       f"({argument.name}: int, str, list[str], ...).")
    if argument.name not in docs:
      raise ValueError(f"{where} has no line in the docstring's 'Args:' "
                       f"section; add '{argument.name}: what it is.'")
    try:
      schema = _type_schema(hints[argument.name])
    except _NoSchema as e:
      raise ValueError(f"{where}: {e}.") from None
    text, choices = _choices(name, argument.name, docs[argument.name])
    if choices is not None:
      schema["enum"] = choices
    schema["description"] = text
    properties[argument.name] = schema
    if argument.default is inspect.Parameter.empty:
      required.append(argument.name)
  parameters = {"type": "object", "properties": properties}
  if required:
    parameters["required"] = required
  function = {"name": name, "description": description,
              "parameters": parameters}
  if "return" in hints:
    try:
      function["return"] = _type_schema(hints["return"])
    except _NoSchema as e:
      raise ValueError(f"tool {name}: its return type: {e}.") from None
    returns = sections.get("Returns", sections.get("Return"))
    if returns:
      function["return"]["description"] = "\n".join(returns).strip()
  return {"type": "function", "function": function}


def tool_schemas(tools: Sequence[Tool]) -> List[Dict[str, Any]]:
  """`tool_schema` of each tool, in order: a chat template's `tools`."""
  return [tool_schema(fn) for fn in tools]


def load_tools(import_paths: str, field: str = "online.tools") -> List[Tool]:
  """The tools named "pkg.module:fn,pkg.module:fn2" ('' is none).

  Args:
    import_paths: comma-separated import paths, as reward functions are
      named (`jaxrlhf.rewards.host.load_function`).
    field: the config field, for messages.

  Returns:
    The functions, in order; each has a schema (`tool_schema`).

  Raises:
    ValueError: (one line) a path that does not import, a function that is
      not a tool (`tool_schema`), two tools of one name.
  """
  tools, seen = [], {}
  for import_path in (p.strip() for p in import_paths.split(",")):
    if not import_path:
      continue
    fn = host.load_function(import_path, field)
    try:
      schema = tool_schema(fn)
    except ValueError as e:
      raise ValueError(f"{field}: {import_path!r}: {e}") from None
    name = schema["function"]["name"]
    if name in seen:
      raise ValueError(f"{field}: {import_path!r} and {seen[name]!r} are "
                       f"both named {name!r}; the model calls tools by name, "
                       "so give each its own.")
    seen[name] = import_path
    tools.append(fn)
  return tools
