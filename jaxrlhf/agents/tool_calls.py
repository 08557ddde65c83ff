"""Tool calls read from a model's turn, checked, and run.

`parse_tool_calls(text, style)` splits one assistant turn (its text, decoded
with the special tokens kept: `<|python_tag|>` and `[TOOL_CALLS]` are
special tokens) into what it says (`content`) and the tools it calls. The
styles are the formats the families' own chat templates write an assistant
tool call in (the templates are under `tests/fixtures/chat_templates/`):

- `qwen` (Qwen 2.5, Qwen 3): text, then one block per call,
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`.
- `llama3` (Llama 3.1, 3.2): the whole message is
  `{"name": "f", "parameters": {...}}`, possibly after `<|python_tag|>`.
- `mistral` (Mistral 7B Instruct v0.3): text, then
  `[TOOL_CALLS] [{"name": "f", "arguments": {...}, "id": "..."}, ...]`.
- `regex` (any): each match of a pattern with the named groups `name` and
  `arguments`.

For example (Qwen 2.5):

    >>> turn = parse_tool_calls(
    ...     'Let me compute.\\n<tool_call>\\n{"name": "multiply", '
    ...     '"arguments": {"a": 123, "b": 456}}\\n</tool_call>', "qwen")
    >>> turn.content, turn.calls[0].name, turn.calls[0].arguments
    ('Let me compute.', 'multiply', {'a': 123, 'b': 456})

Per style: `qwen` also reads a `<tool_call>` block that the turn ended in
before closing it (a failed call). `llama3` reads a turn as calls when it
has `<|python_tag|>` or starts with `{`: then the JSON objects are calls
(one, as the template writes it, or several separated by `;`),
"arguments" is read where "parameters" is missing, and text after the last
object is content. `mistral` takes a single object where a list is expected; the
later format of Mistral's v7+ tokenizers (`[TOOL_CALLS]name[ARGS]{...}`) is
not read. For all styles `content` is the text outside the calls, each
piece stripped, joined by newlines; a missing "arguments" is `{}` (a tool
without arguments).

A malformed call is never an exception: it is a `ToolCall` whose `error` is
the message the model reads as the tool's reply, starting "error: ".

- the JSON does not parse: "error: the tool call is not valid JSON (...)";
- not an object, or no "name": "error: a tool call is a JSON object with a
  "name" ...";
- "arguments" not an object: "error: the arguments of f must be a JSON
  object, not a list.";
- an unknown tool: "error: unknown tool 'mul'; the tools are: multiply";
- a missing required or an unknown argument: "error: multiply is missing
  the required argument 'b'." / "error: multiply has no argument 'c'; ...";
- a value of the wrong JSON type: "error: argument 'a' of multiply must be
  an integer, not a string ("3").";
- the function raised (`run_tool_call`): "error: divide raised
  ZeroDivisionError: float division by zero".

The unknown tool, argument and type errors come from checking the call
against the tools' schemas (`validate_arguments`, or `parse_tool_calls(...,
schemas=...)`): required arguments present, no unknown ones, each value of
its JSON type ("integer" is a JSON number without a fraction: 3, not 3.0;
"nullable" admits null; "enum", "anyOf", array items and object values are
checked too).
`run_tool_call(call, tools)` checks, calls the function and returns its
result as `str(result)`, or the error.
"""

import dataclasses
import json
import re
from typing import (Any, Callable, Dict, List, Mapping, Optional, Pattern,
                    Sequence, Tuple, Union)

from jaxrlhf.agents import tools as tools_lib

STYLES = ("qwen", "llama3", "mistral", "regex")

_QWEN_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)
_LLAMA_TAG = "<|python_tag|>"
_LLAMA_ENDS = ("<|eom_id|>", "<|eot_id|>")
_MISTRAL_TAG = "[TOOL_CALLS]"
_MISTRAL_END = "</s>"
_DECODER = json.JSONDecoder()
_MAX_SHOWN = 40  # characters of a wrong value quoted in a message
_TYPE_NAMES = {"integer": "an integer", "number": "a number",
               "boolean": "a boolean", "string": "a string",
               "array": "a list", "object": "an object", "null": "null"}


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """One call of a tool, as the model wrote it.

  Attributes:
    name: the tool's name ('' when the call has none).
    arguments: {argument: value}, the decoded JSON; None when the call did
      not give an object.
    raw: the text of the call in the turn (markers included for `qwen` and
      `regex`; the JSON object for `llama3` and `mistral`).
    error: None for a well-formed call, else the message ("error: ...")
      the model gets as the tool's reply.
    id: the call's id where the format has one (Mistral's 9 characters),
      else None.
  """
  name: str
  arguments: Optional[Dict[str, Any]]
  raw: str
  error: Optional[str] = None
  id: Optional[str] = None

  @property
  def ok(self) -> bool:
    return self.error is None


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
  """An assistant turn split into its text and its tool calls.

  Attributes:
    content: the text outside the calls (stripped pieces, joined by
      newlines; '' when there is none).
    calls: the calls in the order written, failed ones included.
  """
  content: str
  calls: List[ToolCall]


# --- one call's JSON ---------------------------------------------------------


def _describe(value: Any) -> str:
  """'a string ("3")': a JSON value's type and a short quote of it."""
  kind = _json_kind(value)
  if isinstance(value, (dict, list)) or value is None:
    return kind
  shown = json.dumps(value, ensure_ascii=False)
  if len(shown) > _MAX_SHOWN:
    shown = shown[:_MAX_SHOWN] + "..."
  return f"{kind} ({shown})"


def _json_kind(value: Any) -> str:
  if value is None:
    return "null"
  if isinstance(value, bool):
    return "a boolean"
  if isinstance(value, int):
    return "an integer"
  if isinstance(value, float):
    return "a number"
  if isinstance(value, str):
    return "a string"
  if isinstance(value, list):
    return "a list"
  if isinstance(value, dict):
    return "an object"
  return f"a {type(value).__name__}"


def _bad_json(raw: str, error: json.JSONDecodeError) -> ToolCall:
  return ToolCall("", None, raw, f"error: the tool call is not valid JSON "
                  f"({error.msg} at character {error.pos}).")


def _call_from_object(obj: Any, raw: str,
                      argument_keys: Sequence[str] = ("arguments",)
                      ) -> ToolCall:
  """The call a decoded JSON value describes; its first key of
  `argument_keys` present holds the arguments."""
  if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or (
      not obj["name"].strip()):
    what = ("its \"name\" is not a non-empty string"
            if isinstance(obj, dict) else f"not {_json_kind(obj)}")
    return ToolCall("", None, raw, "error: a tool call is a JSON object with "
                    f"a \"name\" and \"{argument_keys[0]}\"; {what}.")
  name = obj["name"].strip()
  call_id = obj.get("id") if isinstance(obj.get("id"), str) else None
  key = next((k for k in argument_keys if k in obj), None)
  arguments = {} if key is None else obj[key]
  if not isinstance(arguments, dict):
    return ToolCall(name, None, raw, f"error: the arguments of {name} must "
                    f"be a JSON object, not {_json_kind(arguments)}.",
                    call_id)
  return ToolCall(name, arguments, raw, None, call_id)


def _call_from_json(text: str, raw: str,
                    argument_keys: Sequence[str] = ("arguments",)
                    ) -> ToolCall:
  try:
    obj = json.loads(text)
  except json.JSONDecodeError as e:
    return _bad_json(raw, e)
  return _call_from_object(obj, raw, argument_keys)


def _content(pieces: Sequence[str]) -> str:
  return "\n".join(p.strip() for p in pieces if p.strip())


# --- the styles --------------------------------------------------------------


def _parse_qwen(text: str) -> ParsedTurn:
  calls, pieces, start = [], [], 0
  for match in _QWEN_CALL.finditer(text):
    pieces.append(text[start:match.start()])
    start = match.end()
    if not match.group(2):
      calls.append(ToolCall("", None, match.group(0), "error: the tool call "
                            "<tool_call> is not closed by </tool_call>."))
    else:
      calls.append(_call_from_json(match.group(1).strip(), match.group(0)))
  pieces.append(text[start:])
  return ParsedTurn(_content(pieces), calls)


def _json_sequence(body: str, argument_keys: Sequence[str],
                   separators: str) -> Tuple[List[ToolCall], str]:
  """The calls of JSON objects written one after another in `body`
  (separated by whitespace and `separators`), and the text after them."""
  calls, position = [], 0
  while True:
    while position < len(body) and (body[position].isspace()
                                    or body[position] in separators):
      position += 1
    if position >= len(body) or (calls and body[position] != "{"):
      return calls, body[position:]
    try:
      obj, end = _DECODER.raw_decode(body, position)
    except json.JSONDecodeError as e:
      calls.append(_bad_json(body[position:].strip(), e))
      return calls, ""
    calls.append(_call_from_object(obj, body[position:end], argument_keys))
    position = end


def _parse_llama3(text: str) -> ParsedTurn:
  body = text.strip()
  for end in _LLAMA_ENDS:
    if body.endswith(end):
      body = body[:-len(end)].rstrip()
  before = ""
  if _LLAMA_TAG in body:
    before, _, body = body.partition(_LLAMA_TAG)
  elif not body.startswith("{"):
    return ParsedTurn(text.strip(), [])
  calls, after = _json_sequence(body, ("parameters", "arguments"), ";")
  return ParsedTurn(_content([before, after]), calls)


def _mistral_calls(body: str) -> Tuple[List[ToolCall], str]:
  """The calls of one `[TOOL_CALLS]`'s list (or single object), and the
  text after it."""
  body = body.strip()
  if body.endswith(_MISTRAL_END):
    body = body[:-len(_MISTRAL_END)].rstrip()
  if body.startswith("{"):  # One call written without its list.
    return _json_sequence(body, ("arguments",), ",")
  if not body.startswith("["):
    return [ToolCall("", None, body, "error: [TOOL_CALLS] is not followed "
                     "by a JSON list of calls.")], ""
  calls, position = [], 1
  while True:
    while position < len(body) and body[position].isspace():
      position += 1
    if body.startswith("]", position):
      return calls, body[position + 1:]
    try:
      obj, end = _DECODER.raw_decode(body, position)
    except json.JSONDecodeError as e:
      calls.append(_bad_json(body[position:].strip(), e))
      return calls, ""
    calls.append(_call_from_object(obj, body[position:end]))
    position = end
    while position < len(body) and body[position].isspace():
      position += 1
    if body.startswith(",", position):
      position += 1
    elif not body.startswith("]", position):
      calls.append(ToolCall("", None, body[position:].strip(), "error: the "
                            "tool calls after [TOOL_CALLS] are not a JSON "
                            "list (',' or ']' expected)."))
      return calls, ""


def _parse_mistral(text: str) -> ParsedTurn:
  before, *bodies = text.split(_MISTRAL_TAG)
  calls, pieces = [], [before]
  for body in bodies:
    found, after = _mistral_calls(body)
    calls.extend(found)
    pieces.append(after)
  return ParsedTurn(_content(pieces), calls)


def _regex_call(match: re.Match) -> ToolCall:
  name, raw = (match.group("name") or "").strip(), match.group(0)
  if not name:
    return ToolCall("", None, raw, "error: the tool call names no tool.")
  try:
    arguments = json.loads((match.group("arguments") or "").strip() or "{}")
  except json.JSONDecodeError as e:
    return dataclasses.replace(_bad_json(raw, e), name=name)
  if not isinstance(arguments, dict):
    return ToolCall(name, None, raw, f"error: the arguments of {name} must "
                    f"be a JSON object, not {_json_kind(arguments)}.")
  return ToolCall(name, arguments, raw)


def _parse_regex(text: str, pattern: Pattern[str]) -> ParsedTurn:
  calls, pieces, start = [], [], 0
  for match in pattern.finditer(text):
    if match.end() == match.start():
      continue
    pieces.append(text[start:match.start()])
    start = match.end()
    calls.append(_regex_call(match))
  pieces.append(text[start:])
  return ParsedTurn(_content(pieces), calls)


def compile_pattern(pattern: Union[str, Pattern[str]],
                    field: str = "pattern") -> Pattern[str]:
  """A regex style's pattern, checked to have the named groups `name` and
  `arguments` (a one-line ValueError naming `field` otherwise)."""
  try:
    compiled = re.compile(pattern, re.DOTALL) if isinstance(pattern, str) \
        else pattern
  except re.error as e:
    raise ValueError(f"{field}: {pattern!r} is not a regular expression "
                     f"({e}).") from None
  missing = {"name", "arguments"} - set(compiled.groupindex)
  if missing:
    raise ValueError(f"{field}: {compiled.pattern!r} has no group named "
                     f"{' or '.join(sorted(missing))}; write e.g. "
                     r"'<call name=\"(?P<name>\w+)\">(?P<arguments>.*?)"
                     r"</call>'.")
  return compiled


def parse_tool_calls(text: str, style: str, *,
                     schemas: Optional[Sequence[Mapping[str, Any]]] = None,
                     pattern: Union[None, str, Pattern[str]] = None
                     ) -> ParsedTurn:
  """The content and tool calls of one assistant turn (module docstring).

  Args:
    text: the turn's text, special tokens kept.
    style: one of `STYLES`.
    schemas: the tools' schemas (`tools.tool_schemas`); when given, each
      well-formed call is also checked against them (`validate_arguments`).
    pattern: the `regex` style's pattern (a string is compiled with
      re.DOTALL), with the named groups `name` and `arguments` (the
      arguments' JSON object; an empty group is `{}`).

  Returns:
    A ParsedTurn; malformed calls have `error` set, never raise.

  Raises:
    ValueError: an unknown style, or a `regex` style without a valid
      pattern (configuration errors, not the model's).
  """
  if style == "qwen":
    turn = _parse_qwen(text)
  elif style == "llama3":
    turn = _parse_llama3(text)
  elif style == "mistral":
    turn = _parse_mistral(text)
  elif style == "regex":
    if pattern is None:
      raise ValueError("parse_tool_calls: the 'regex' style needs a pattern "
                       "with the named groups 'name' and 'arguments'.")
    turn = _parse_regex(text, compile_pattern(pattern))
  else:
    raise ValueError(f"tool call style {style!r} is not one of "
                     f"{', '.join(STYLES)}.")
  if schemas is not None:
    turn = ParsedTurn(turn.content,
                      [validate_arguments(c, schemas) for c in turn.calls])
  return turn


# --- checking a call against the schemas -------------------------------------


def _functions(schemas: Sequence[Mapping[str, Any]]) -> Dict[str, Mapping]:
  """{name: the "function" part} of tool schemas (bare function parts are
  taken too)."""
  functions = {}
  for schema in schemas:
    function = schema.get("function", schema)
    functions[function["name"]] = function
  return functions


def _has_type(value: Any, json_type: str) -> bool:
  if json_type == "integer":
    return isinstance(value, int) and not isinstance(value, bool)
  if json_type == "number":
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  if json_type == "boolean":
    return isinstance(value, bool)
  if json_type == "string":
    return isinstance(value, str)
  if json_type == "array":
    return isinstance(value, list)
  if json_type == "object":
    return isinstance(value, dict)
  if json_type == "null":
    return value is None
  return False


def _same(a: Any, b: Any) -> bool:
  """JSON equality: 1 and true differ, 1 and 1.0 do not."""
  return a == b and (isinstance(a, bool) == isinstance(b, bool))


def _mismatch(value: Any, schema: Mapping[str, Any]) -> Optional[str]:
  """Why `value` does not fit `schema` ("must be an integer, not ..."), or
  None when it fits."""
  if value is None and schema.get("nullable"):
    return None
  if "anyOf" in schema:
    if all(_mismatch(value, part) for part in schema["anyOf"]):
      return f"does not fit any of its types, being {_describe(value)}"
    return None
  json_types = schema.get("type")
  if json_types is not None:
    json_types = [json_types] if isinstance(json_types, str) else json_types
    if not any(_has_type(value, t) for t in json_types):
      names = " or ".join(_TYPE_NAMES.get(t, repr(t)) for t in json_types)
      return f"must be {names}, not {_describe(value)}"
  if "enum" in schema and not any(_same(value, e) for e in schema["enum"]):
    choices = ", ".join(json.dumps(e, ensure_ascii=False)
                        for e in schema["enum"])
    return f"must be one of {choices}, not {_describe(value)}"
  if isinstance(value, list):
    parts = schema.get("prefixItems")
    if parts is not None and len(parts) != len(value):
      return f"must be a list of {len(parts)} items, not {len(value)}"
    for i, item in enumerate(value):
      part = parts[i] if parts is not None else schema.get("items")
      reason = _mismatch(item, part) if part is not None else None
      if reason:
        return f"item {i} {reason}"
  if isinstance(value, dict) and isinstance(
      schema.get("additionalProperties"), Mapping):
    for key, item in value.items():
      reason = _mismatch(item, schema["additionalProperties"])
      if reason:
        return f"key {key!r} {reason}"
  return None


def _unknown_tool(name: str, known: Sequence[str]) -> str:
  listed = ", ".join(known) if known else "(none)"
  return f"error: unknown tool {name!r}; the tools are: {listed}"


def validate_arguments(call: ToolCall,
                       schemas: Sequence[Mapping[str, Any]]) -> ToolCall:
  """`call`, with `error` set when it does not fit the tools' schemas.

  Args:
    call: a parsed call; one that already failed comes back as it is.
    schemas: the tools' schemas (`tools.tool_schema`'s dicts).

  Returns:
    The call, unchanged when it fits: a known tool, every required argument
    there, no unknown one, each value of its JSON type (module docstring).
  """
  if not call.ok:
    return call
  functions = _functions(schemas)
  if call.name not in functions:
    return dataclasses.replace(call,
                               error=_unknown_tool(call.name, list(functions)))
  parameters = functions[call.name].get("parameters", {})
  properties = parameters.get("properties", {})
  for argument in call.arguments:
    if argument not in properties:
      takes = (f"its arguments are: {', '.join(properties)}" if properties
               else "it takes no arguments")
      return dataclasses.replace(call, error=f"error: {call.name} has no "
                                 f"argument {argument!r}; {takes}.")
  for argument in parameters.get("required", []):
    if argument not in call.arguments:
      return dataclasses.replace(call, error=f"error: {call.name} is missing "
                                 f"the required argument {argument!r}.")
  for argument, value in call.arguments.items():
    reason = _mismatch(value, properties[argument])
    if reason:
      return dataclasses.replace(call, error=f"error: argument {argument!r} "
                                 f"of {call.name} {reason}.")
  return call


# --- running a call ----------------------------------------------------------


def run_tool_call(call: ToolCall,
                  tools: Union[Sequence[Callable], Mapping[str, Callable]]
                  ) -> str:
  """What the model reads as the tool's reply: `str(result)` of the tool
  called with the call's arguments, or the error message.

  Args:
    call: a parsed call.
    tools: the tool functions (named by `__name__`), or {name: function}.

  Returns:
    `str` of the function's result; the call's own error when it failed to
    parse; "error: ..." when the tool is unknown, the arguments do not fit
    its schema, or the function raised (its exception's type and the first
    line of its message). An `Exception` never propagates.

  Raises:
    ValueError: a function in `tools` is not a tool (`tools.tool_schema`),
      which `tools.load_tools` refuses at load time.
  """
  if not call.ok:
    return call.error
  by_name = dict(tools) if isinstance(tools, Mapping) else {
      fn.__name__: fn for fn in tools}
  if call.name not in by_name:
    return _unknown_tool(call.name, list(by_name))
  fn = by_name[call.name]
  schema = tools_lib.tool_schema(fn)
  schema["function"]["name"] = call.name
  checked = validate_arguments(call, [schema])
  if not checked.ok:
    return checked.error
  try:
    result = fn(**call.arguments)
  except Exception as e:  # pylint: disable=broad-except
    lines = str(e).strip().splitlines()
    message = f": {lines[0]}" if lines else ""
    return f"error: {call.name} raised {type(e).__name__}{message}"
  return str(result)
