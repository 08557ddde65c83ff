"""Tools as JSON schemas (jaxrlhf/agents/tools.py) and tool calls read from
a model's text (jaxrlhf/agents/tool_calls.py).

The schemas are checked against transformers' own `get_json_schema` output
(tests/fixtures/tool_schemas.json, written by
experiments/make_tool_fixtures.py). The call formats are the ones the
families' chat templates write (tests/fixtures/chat_templates/: Qwen 2.5's
and Qwen 3's `<tool_call>` blocks, Llama 3.1's `{"name", "parameters"}`
message, Mistral v0.3's `[TOOL_CALLS] [...]`); the round trips render an
assistant tool call with those templates and parse it back.
"""

import json

import agent_tools
from conftest import FIXTURES
import pytest

from jaxrlhf.agents import tool_calls
from jaxrlhf.agents import tools
from jaxrlhf.data import chat_templates
from jaxrlhf.rewards import host

SCHEMAS = tools.tool_schemas(agent_tools.FIXTURE_TOOLS)


def parse(text, style, **kwargs):
  return tool_calls.parse_tool_calls(text, style, schemas=SCHEMAS, **kwargs)


def call_of(name, arguments):
  return tool_calls.ToolCall(name, arguments, raw="")


# --- schemas -----------------------------------------------------------------


def test_schemas_are_transformers_own_in_its_key_order():
  fixture = json.loads((FIXTURES / "tool_schemas.json").read_text())
  assert list(fixture["schemas"]) == [
      fn.__name__ for fn in agent_tools.FIXTURE_TOOLS]
  for fn in agent_tools.FIXTURE_TOOLS:
    # json.dumps, not ==: the key order reaches the prompt through tojson.
    assert json.dumps(tools.tool_schema(fn)) == json.dumps(
        fixture["schemas"][fn.__name__]), fn.__name__


def test_schema_of_multiply_reads_as_documented():
  # Written from the OpenAI function format, independently of the fixture.
  assert tools.tool_schema(agent_tools.multiply) == {
      "type": "function",
      "function": {
          "name": "multiply", "description": "Multiplies two integers.",
          "parameters": {
              "type": "object",
              "properties": {
                  "a": {"type": "integer", "description": "the first factor."},
                  "b": {"type": "integer",
                        "description": "the second factor."}},
              "required": ["a", "b"]},
          "return": {"type": "integer", "description": "The product a * b."}}}


@pytest.mark.parametrize("fn,words", [
    (agent_tools.no_hint, ("no_hint", "'a'", "type hint")),
    (agent_tools.undocumented_argument,
     ("undocumented_argument", "'b'", "Args:")),
    (agent_tools.no_docstring, ("no_docstring", "docstring")),
    (agent_tools.bytes_argument, ("bytes_argument", "'data'", "bytes")),
])
def test_functions_that_are_not_tools_are_refused_in_one_line(fn, words):
  with pytest.raises(ValueError) as error:
    tools.tool_schema(fn)
  message = str(error.value)
  assert "\n" not in message
  for word in words:
    assert word in message


def test_choices_that_are_not_a_json_list_are_refused():
  def pick(color: str) -> str:
    """Picks.

    Args:
      color: the color (choices: ['red', 'green'])
    """
    return color
  with pytest.raises(ValueError, match=r"pick: argument 'color'.*JSON list"):
    tools.tool_schema(pick)


def test_load_tools_imports_in_order_and_checks_each():
  loaded = tools.load_tools(" agent_tools:multiply, agent_tools:divide ")
  assert loaded == [agent_tools.multiply, agent_tools.divide]
  assert tools.load_tools("") == []


def test_load_tools_errors_are_the_reward_loaders_and_name_the_field():
  for path in ("agent_tools:nothing_here", "no_such_module_xyz:f",
               "agent_tools.multiply"):
    with pytest.raises(ValueError) as ours:
      tools.load_tools(f"agent_tools:multiply,{path}")
    with pytest.raises(ValueError) as rewards:
      host.load_function(path, "online.tools")
    assert str(ours.value) == str(rewards.value)
  with pytest.raises(ValueError, match=r"^online.tools: 'agent_tools:no_hint'"
                     r": tool no_hint: argument 'a' has no type hint"):
    tools.load_tools("agent_tools:no_hint")
  with pytest.raises(ValueError, match="both named 'multiply'"):
    tools.load_tools("agent_tools:multiply,agent_tools:multiply")


def test_the_schemas_reach_the_prompt_through_the_template():
  template = chat_templates.ChatTemplate(
      json.loads((FIXTURES / "chat_templates" / "qwen2_5.json").read_text()
                 )["template"])
  prompt = template.render([{"role": "user", "content": "2*3?"}],
                           tools=SCHEMAS[:1], add_generation_prompt=True)
  # Qwen 2.5 writes each tool as `tool | tojson` inside <tools></tools>.
  assert f"<tools>\n{json.dumps(SCHEMAS[0])}\n</tools>" in prompt


# --- each style on text as its template writes it ----------------------------

# Qwen 2.5 / Qwen 3 (their chat templates, tests/fixtures/chat_templates/
# qwen2_5.json and qwen3.json; Qwen's docs, "Function Calling"): each call is
# '\n<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>' after the
# turn's text.
QWEN_TWO_CALLS = (
    "I will multiply, then convert.\n"
    '<tool_call>\n{"name": "multiply", "arguments": {"a": 123, "b": 456}}\n'
    "</tool_call>\n"
    '<tool_call>\n{"name": "convert_temperature", "arguments": '
    '{"value": 21.5, "unit": "celsius", "style": "long"}}\n</tool_call>')


def test_qwen_two_calls_and_the_text_around_them():
  turn = parse(QWEN_TWO_CALLS + "\nDone.", "qwen")
  assert turn.content == "I will multiply, then convert.\nDone."
  assert [(c.name, c.arguments, c.error) for c in turn.calls] == [
      ("multiply", {"a": 123, "b": 456}, None),
      ("convert_temperature",
       {"value": 21.5, "unit": "celsius", "style": "long"}, None)]
  assert turn.calls[0].raw == (
      '<tool_call>\n{"name": "multiply", "arguments": {"a": 123, "b": 456}}'
      "\n</tool_call>")
  assert parse("The answer is 56088.", "qwen") == tool_calls.ParsedTurn(
      "The answer is 56088.", [])


# Llama 3.1 / 3.2 (their chat template, tests/fixtures/chat_templates/
# llama3_1.json; Meta's Llama 3.1 model card, "JSON based tool calling"): the
# assistant message is '{"name": ..., "parameters": {...}}', the model may
# open it with <|python_tag|> and end it with <|eom_id|>.
def test_llama3_json_call_with_and_without_the_python_tag():
  for text in ('{"name": "multiply", "parameters": {"a": 6, "b": 7}}',
               '<|python_tag|>{"name": "multiply", "parameters": {"a": 6, '
               '"b": 7}}<|eom_id|>'):
    turn = parse(text, "llama3")
    assert turn.content == ""
    assert [(c.name, c.arguments, c.ok) for c in turn.calls] == [
        ("multiply", {"a": 6, "b": 7}, True)]
  assert parse("6 times 7 is 42.", "llama3").calls == []


def test_llama3_two_calls_and_text_around_them():
  turn = parse('Let me check.<|python_tag|>{"name": "multiply", "parameters":'
               ' {"a": 6, "b": 7}}; {"name": "search", "arguments": {"query":'
               ' "llama"}} I called two tools.', "llama3")
  assert turn.content == "Let me check.\nI called two tools."
  assert [(c.name, c.arguments, c.ok) for c in turn.calls] == [
      ("multiply", {"a": 6, "b": 7}, True),
      ("search", {"query": "llama"}, True)]


# Mistral 7B Instruct v0.3 (its chat template, tests/fixtures/chat_templates/
# mistral_v0_3.json): '[TOOL_CALLS] [{"name": ..., "arguments": ..., "id":
# <9 characters>}, ...]' then </s>.
def test_mistral_list_of_calls_and_text_before_it():
  turn = parse('Two calls. [TOOL_CALLS] [{"name": "multiply", "arguments": '
               '{"a": 2, "b": 3}, "id": "abcDEF123"}, {"name": "count_words", '
               '"arguments": {"words": ["a", "b", "a"]}, "id": "zzzzzzzz1"}]'
               "</s>", "mistral")
  assert turn.content == "Two calls."
  assert [(c.name, c.arguments, c.id, c.ok) for c in turn.calls] == [
      ("multiply", {"a": 2, "b": 3}, "abcDEF123", True),
      ("count_words", {"words": ["a", "b", "a"]}, "zzzzzzzz1", True)]
  assert parse("No call.</s>", "mistral").calls == []


def test_regex_style_reads_the_named_groups():
  pattern = r"<call (?P<name>\w+)>(?P<arguments>.*?)</call>"
  turn = parse('First <call multiply>{"a": 2, "b": 5}</call> then '
               '<call divide>{"a": 1, "b": 4}</call>.', "regex",
               pattern=pattern)
  assert turn.content == "First\nthen\n."
  assert [(c.name, c.arguments, c.raw) for c in turn.calls] == [
      ("multiply", {"a": 2, "b": 5}, '<call multiply>{"a": 2, "b": 5}</call>'),
      ("divide", {"a": 1, "b": 4}, '<call divide>{"a": 1, "b": 4}</call>')]
  with pytest.raises(ValueError, match="no group named arguments"):
    parse("x", "regex", pattern=r"<call (?P<name>\w+)>")
  with pytest.raises(ValueError, match="not one of qwen, llama3"):
    parse("x", "hermes")


# --- malformed calls: an error the model reads, never an exception ----------

MALFORMED = [
    # (style, text, the error's start)
    ("qwen", '<tool_call>\n{"name": "multiply", "arguments": {"a": 1,}}\n'
     "</tool_call>", "error: the tool call is not valid JSON"),
    ("qwen", '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>',
     'error: a tool call is a JSON object with a "name"'),
    ("qwen", '<tool_call>\n["multiply", 1, 2]\n</tool_call>',
     'error: a tool call is a JSON object with a "name"'),
    ("qwen", '<tool_call>\n{"name": "multiply", "arguments": [1, 2]}\n'
     "</tool_call>", "error: the arguments of multiply must be a JSON object, "
     "not a list"),
    ("qwen", '<tool_call>\n{"name": "multiply", "arguments": {"a": 1',
     "error: the tool call <tool_call> is not closed"),
    ("qwen", '<tool_call>\n{"name": "mul", "arguments": {"a": 1, "b": 2}}\n'
     "</tool_call>", "error: unknown tool 'mul'; the tools are: multiply, "
     "search, count_words, convert_temperature, paint, divide"),
    ("llama3", '{"name": "multiply", "parameters": {"a": 1, "b": 2}',
     "error: the tool call is not valid JSON"),
    ("llama3", '{"parameters": {"a": 1}}',
     'error: a tool call is a JSON object with a "name" and "parameters"'),
    ("llama3", '{"name": "multiply", "parameters": "a=1, b=2"}',
     "error: the arguments of multiply must be a JSON object, not a string"),
    ("llama3", "<|python_tag|>multiply.call(a=1, b=2)",
     "error: the tool call is not valid JSON"),
    ("mistral", '[TOOL_CALLS] [{"name": "multiply", "arguments": {"a": 1}',
     "error: the tool call is not valid JSON"),
    ("mistral", '[TOOL_CALLS] [{"name": "", "arguments": {}}]',
     'error: a tool call is a JSON object with a "name"'),
    ("mistral", '[TOOL_CALLS] [{"name": "multiply", "arguments": null}]',
     "error: the arguments of multiply must be a JSON object, not null"),
    ("mistral", "[TOOL_CALLS] multiply(1, 2)",
     "error: [TOOL_CALLS] is not followed by a JSON list"),
    ("mistral", '[TOOL_CALLS] [{"name": "multiply", "arguments": {"a": 1, '
     '"b": 2}} {"name": "divide"}]', "error: the tool calls after "
     "[TOOL_CALLS] are not a JSON list"),
]


@pytest.mark.parametrize("style,text,error", MALFORMED)
def test_a_malformed_call_is_a_failed_call(style, text, error):
  turn = parse(text, style)
  failed = [c for c in turn.calls if not c.ok]
  assert len(failed) == 1, turn
  assert failed[0].error.startswith(error), failed[0].error
  assert "\n" not in failed[0].error
  assert failed[0].raw and failed[0].raw in text
  assert tool_calls.run_tool_call(failed[0], agent_tools.FIXTURE_TOOLS) == (
      failed[0].error)


def test_regex_malformed_calls():
  pattern = r"<call (?P<name>\w*)>(?P<arguments>.*?)</call>"
  turn = parse('<call >{"a": 1}</call><call multiply>{"a": 1</call>'
               '<call multiply>[1]</call>', "regex", pattern=pattern)
  assert [c.error.split(" (")[0] for c in turn.calls] == [
      "error: the tool call names no tool.",
      "error: the tool call is not valid JSON",
      "error: the arguments of multiply must be a JSON object, not a list."]


@pytest.mark.parametrize("name,arguments,error", [
    ("multiply", {"a": 1}, "error: multiply is missing the required argument "
     "'b'."),
    ("multiply", {"a": 1, "b": 2, "c": 3}, "error: multiply has no argument "
     "'c'; its arguments are: a, b."),
    ("multiply", {"a": "3", "b": 2}, "error: argument 'a' of multiply must be "
     'an integer, not a string ("3").'),
    ("multiply", {"a": 3.0, "b": 2}, "error: argument 'a' of multiply must be "
     "an integer, not a number (3.0)."),
    ("multiply", {"a": True, "b": 2}, "error: argument 'a' of multiply must "
     "be an integer, not a boolean (true)."),
    ("multiply", {"a": None, "b": 2}, "error: argument 'a' of multiply must "
     "be an integer, not null."),
    ("count_words", {"words": ["a", 1]}, "error: argument 'words' of "
     "count_words item 1 must be a string, not an integer (1)."),
    ("convert_temperature", {"value": 1, "unit": "kelvin"}, "error: argument "
     "'unit' of convert_temperature must be one of \"celsius\", "
     '"fahrenheit", not a string ("kelvin").'),
    ("convert_temperature", {"value": 1, "unit": "celsius", "style": "tiny"},
     "error: argument 'style' of convert_temperature must be one of "
     '"short", "long", not a string ("tiny").'),
    ("paint", {"color": "red", "area": 2, "layers": [2]}, "error: argument "
     "'layers' of paint must be a list of 2 items, not 1."),
    ("paint", {"color": "red", "area": 2, "layers": [2, 3]}, "error: "
     "argument 'layers' of paint item 1 must be a string, not an integer (3)."),
    ("paint", {"color": "red", "area": "2", "layers": [2, "x"]}, "error: "
     "argument 'area' of paint must be an integer or a number, not a string "
     '("2").'),
    ("paint", {"color": "red", "area": 2, "layers": [2, "x"],
               "label": ["a"]}, "error: argument 'label' of paint does not "
     "fit any of its types, being a list."),
    ("search", {"query": "q", "max_results": 2.5}, "error: argument "
     "'max_results' of search must be an integer, not a number (2.5)."),
    ("divide", {}, "error: divide is missing the required argument 'a'."),
])
def test_arguments_that_do_not_fit_the_schema(name, arguments, error):
  assert tool_calls.validate_arguments(call_of(name, arguments),
                                       SCHEMAS).error == error


@pytest.mark.parametrize("name,arguments", [
    ("multiply", {"a": -4, "b": 10**30}),
    ("search", {"query": "q", "max_results": None}),  # Optional: null is fine
    ("search", {"query": "q"}),  # defaults are not required
    ("count_words", {"words": [], "ignore_case": False}),
    ("convert_temperature", {"value": 3, "unit": "fahrenheit"}),  # int: number
    ("paint", {"color": "green", "area": 2.5, "layers": [1, "matte"],
               "options": {"any": [1, {"x": None}]}, "label": [1, 2]}),
    ("paint", {"color": "red", "area": 2, "layers": [1, "matte"],
               "options": None, "label": "kitchen"}),
])
def test_arguments_that_fit_the_schema(name, arguments):
  call = call_of(name, arguments)
  assert tool_calls.validate_arguments(call, SCHEMAS) is call


# --- running calls -----------------------------------------------------------


def test_run_tool_call_returns_str_of_the_result_or_the_error():
  turn = parse(QWEN_TWO_CALLS, "qwen")
  fahrenheit = 21.5 * 9 / 5 + 32
  assert [tool_calls.run_tool_call(c, agent_tools.FIXTURE_TOOLS)
          for c in turn.calls] == [str(123 * 456),
                                   f"{fahrenheit:.1f} degrees fahrenheit"]
  count = call_of("count_words", {"words": ["The", "the", "a"]})
  assert tool_calls.run_tool_call(count, agent_tools.FIXTURE_TOOLS) == str(
      {"the": 2, "a": 1})
  divide = call_of("divide", {"a": 1, "b": 0})
  assert tool_calls.run_tool_call(divide, agent_tools.FIXTURE_TOOLS) == (
      "error: divide raised ZeroDivisionError: division by zero")
  assert tool_calls.run_tool_call(divide, [agent_tools.multiply]) == (
      "error: unknown tool 'divide'; the tools are: multiply")


def test_a_call_that_does_not_fit_never_reaches_the_function():
  seen = []

  def record(n: int) -> int:
    """Records.

    Args:
      n: a number.
    """
    seen.append(n)
    raise RuntimeError("boom\nsecond line")

  bad = call_of("record", {"n": "1"})
  assert tool_calls.run_tool_call(bad, [record]).startswith(
      "error: argument 'n' of record must be an integer")
  assert seen == []
  good = call_of("record", {"n": 1})
  assert tool_calls.run_tool_call(good, {"record": record}) == (
      "error: record raised RuntimeError: boom")
  assert seen == [1]


# --- round trips through the families' templates ------------------------------


def _rendered_reply(family, tool_call_list, tools_offered):
  """The assistant turn's text as the family's template renders a message
  with these tool calls, after a user question (the completion a model
  trained on this template writes)."""
  fixture = json.loads(
      (FIXTURES / "chat_templates" / f"{family}.json").read_text())
  special = fixture["special_tokens"]
  template = chat_templates.ChatTemplate(
      fixture["template"], special_tokens=special,
      eos_text=special["eos_token"])
  question = [{"role": "user", "content": "What is 123 times 456?"}]
  reply = {"role": "assistant", "content": "", "tool_calls": tool_call_list}
  prompt = template.render(question, add_generation_prompt=True,
                           tools=tools_offered)
  full = template.render(question + [reply], tools=tools_offered)
  assert full.startswith(prompt)
  return template.reply_text(full[len(prompt):])


def _openai_call(name, arguments, call_id):
  return {"id": call_id, "type": "function",
          "function": {"name": name, "arguments": arguments}}


@pytest.mark.parametrize("family,style,calls", [
    ("qwen2_5", "qwen", 1), ("qwen2_5", "qwen", 2), ("qwen3", "qwen", 2),
    ("llama3_1", "llama3", 1),  # its template allows one call per turn
    ("mistral_v0_3", "mistral", 2),
])
def test_a_call_the_template_renders_parses_back(family, style, calls):
  wanted = [("multiply", {"a": 123, "b": 456}, "call00001"),
            ("search", {"query": "été \"quoted\"", "max_results": 3},
             "call00002")][:calls]
  text = _rendered_reply(family, [_openai_call(*w) for w in wanted], SCHEMAS)
  turn = parse(text, style)
  assert [(c.name, c.arguments, c.error) for c in turn.calls] == [
      (name, arguments, None) for name, arguments, _ in wanted], text
  if family == "mistral_v0_3":
    assert [c.id for c in turn.calls] == [w[2] for w in wanted]
  # Qwen 3 opens the last turn with an empty think block; no other text.
  assert turn.content in ("", "<think>\n\n</think>")
