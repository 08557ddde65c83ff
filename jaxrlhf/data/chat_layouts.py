"""The "messages" layout: conversations rendered with a chat template.

What it reads and gives is `file_layouts`' module docstring ("messages");
this module parses its rows (`messages_layout`, registered in
`file_layouts.LAYOUTS`).
"""

import json
from typing import Any, Dict, Mapping, Tuple, Union

from jaxrlhf.data import alignment_kinds as kinds_lib
from jaxrlhf.data import chat_templates
from jaxrlhf.data import layout_rows
from jaxrlhf.data import row_checks

BadRow = row_checks.BadRow
RowContext = layout_rows.RowContext
RowResult = layout_rows.RowResult

def _messages(value, column: str, single_reply: bool = False
              ) -> Union[list, BadRow]:
  """A column's list of messages (one message object counts as a list of
  one where a reply is expected), or why it is not one."""
  if single_reply and isinstance(value, Mapping):
    value = [value]
  if not isinstance(value, (list, tuple)) or not value:
    return BadRow("wrong_type", f"column {column!r} must be a non-empty list "
                  "of messages, objects with a 'role' and a 'content'.")
  for i, message in enumerate(value):
    if not isinstance(message, Mapping) or not isinstance(
        message.get("role"), str):
      return BadRow("wrong_type", f"{column}[{i}] is not a message: an "
                    "object with a string 'role' (and its 'content').")
  return list(value)


def _single_reply(value, column: str) -> Union[Mapping[str, Any], BadRow]:
  """The one assistant message of a reply column."""
  messages = _messages(value, column, single_reply=True)
  if isinstance(messages, BadRow):
    return messages
  roles = [m["role"] for m in messages]
  if roles != [chat_templates.ASSISTANT]:
    return BadRow("wrong_type", f"column {column!r} must hold one assistant "
                  f"message (the reply), got roles {roles}.")
  return messages[0]


def _split(ctx: RowContext, context, reply, where: str, tools=None
           ) -> Union[Tuple[str, str], BadRow]:
  """(prompt, completion) texts of a reply after its context (`tools`: the
  template's tool schemas, or None)."""
  try:
    return chat_templates.split_reply(ctx.chat_template, context, reply,
                                      tools=tools)
  except chat_templates.NotAPrefixError as e:
    return BadRow("template_not_prefix", f"{where}: {e}")
  except chat_templates.ChatTemplateError as e:
    return _template_refused(ctx, where, e)


def _template_refused(ctx: RowContext, where: str, error) -> BadRow:
  """The row whose conversation at `where` the chat template refused."""
  return BadRow("chat_template_error", f"{where}: the chat template "
                f"({ctx.chat_template.origin}) refused the conversation: "
                f"{error}")


def _tools(record, ctx: RowContext):
  """A row's tool schemas (column "tools"; None where absent), or why the
  column is not a list of them."""
  column = layout_rows.column(ctx, "tools")
  tools = layout_rows.get_path(record, column)
  if isinstance(tools, str):
    try:
      tools = json.loads(tools)
    except ValueError:
      tools = ""
  if tools is not None and not (
      isinstance(tools, (list, tuple))
      and all(isinstance(t, Mapping) for t in tools)):
    return BadRow("wrong_type", f"column {column!r} must be a list of tool "
                  "JSON schemas (objects), or that list as a JSON string.")
  return tools or None


def _with_conversation(extras, messages) -> Dict[str, Any]:
  """A prompt's extra columns and the conversation it renders
  (`alignment_kinds.CONVERSATION_COLUMN`), without null fields (Parquet
  gives every message each field any message of the file has)."""
  return {**extras, kinds_lib.CONVERSATION_COLUMN: [
      {k: v for k, v in m.items() if v is not None} for m in messages]}


def _messages_demonstrations(record, ctx: RowContext) -> RowResult:
  extras = layout_rows.extra_values(record, ctx)
  if isinstance(extras, BadRow):
    yield extras
    return
  tools = _tools(record, ctx)
  if isinstance(tools, BadRow):
    yield tools
    return
  column = layout_rows.column(ctx, "messages")
  conversation = layout_rows.get_path(record, column)
  if conversation is not None:
    messages = _messages(conversation, column)
    if isinstance(messages, BadRow):
      yield messages
      return
    turns = chat_templates.assistant_turns(messages)
    if not turns:
      yield BadRow("no_assistant_turn", f"column {column!r} has no "
                   "assistant message to learn from (roles "
                   f"{[m['role'] for m in messages]}).")
      return
    if ctx.options["turns"] == "last":
      turns = turns[-1:]
    pairs = [(messages[:i], messages[i], f"{column}[{i}]") for i in turns]
  else:
    prompt_column = layout_rows.column(ctx, kinds_lib.PROMPT)
    completion_column = layout_rows.column(ctx, "completion")
    prompt = layout_rows.get_path(record, prompt_column)
    completion = layout_rows.get_path(record, completion_column)
    if prompt is None or completion is None:
      yield BadRow("missing_field", f"no conversation: neither column "
                   f"{column!r} nor both {prompt_column!r} and "
                   f"{completion_column!r}.")
      return
    context = _messages(prompt, prompt_column)
    reply = _single_reply(completion, completion_column)
    for value in (context, reply):
      if isinstance(value, BadRow):
        yield value
        return
    pairs = [(context, reply, completion_column)]
  for context, reply, where in pairs:
    split = _split(ctx, context, reply, where, tools)
    if isinstance(split, BadRow):
      yield split  # The conversation's other replies are still learnt.
      continue
    yield {"prompt": split[0], "completion": split[1],
           layout_rows.EXTRA_COLUMNS: _with_conversation(extras, context)}


def _messages_pairs(record, ctx: RowContext) -> RowResult:
  columns = {f: layout_rows.column(ctx, f) for f in ("prompt", "chosen", "rejected")}
  values = {f: layout_rows.get_path(record, c) for f, c in columns.items()}
  for field in ("chosen", "rejected"):
    if values[field] is None:
      yield BadRow("missing_field", f"column {columns[field]!r} is missing "
                   "or null.")
      return
  replies = {}
  if isinstance(values["prompt"], (list, tuple)):
    # TRL's explicit prompt: the shared turns, then one reply each.
    context = _messages(values["prompt"], columns["prompt"])
    if isinstance(context, BadRow):
      yield context
      return
    for field in ("chosen", "rejected"):
      replies[field] = _single_reply(values[field], columns[field])
  else:
    # Two whole conversations that differ in their last (assistant) turn.
    conversations = {}
    for field in ("chosen", "rejected"):
      messages = _messages(values[field], columns[field])
      if isinstance(messages, BadRow):
        yield messages
        return
      conversations[field] = messages
      replies[field] = messages[-1]
      if messages[-1]["role"] != chat_templates.ASSISTANT:
        yield BadRow("unparsable_dialogue", f"column {columns[field]!r} "
                     "must end with the assistant reply being compared, not "
                     f"a {messages[-1]['role']!r} message.")
        return
    context = conversations["chosen"][:-1]
    if ([chat_templates.message_for_template(m) for m in context] !=
        [chat_templates.message_for_template(m)
         for m in conversations["rejected"][:-1]]):
      yield BadRow("prompts_differ", "the chosen and rejected conversations "
                   "differ before their last message.")
      return
  example = {}
  for field in ("chosen", "rejected"):
    if isinstance(replies[field], BadRow):
      yield replies[field]
      return
    split = _split(ctx, context, replies[field], columns[field])
    if isinstance(split, BadRow):
      yield split
      return
    example[kinds_lib.PROMPT], example[field] = split
  for field in ctx.kind.scalar_fields:
    value = layout_rows.get_path(record, layout_rows.column(ctx, field))
    if value is not None:
      example[field] = value
  yield example


def _messages_prompts(record, ctx: RowContext) -> RowResult:
  """Online RL's prompts of a conversation (column "messages", or TRL's
  prompt-only {"prompt": [messages]}): the conversation before each
  assistant reply and, when it does not end with one, the whole of it, each
  rendered with the generation prompt."""
  extras = layout_rows.extra_values(record, ctx)
  if isinstance(extras, BadRow):
    yield extras
    return
  column = layout_rows.column(ctx, "messages")
  conversation = layout_rows.get_path(record, column)
  if conversation is None:
    column = layout_rows.column(ctx, kinds_lib.PROMPT)
    conversation = layout_rows.get_path(record, column)
  if conversation is None:
    yield BadRow("missing_field", f"no conversation: neither column "
                 f"{layout_rows.column(ctx, 'messages')!r} nor {column!r}.")
    return
  messages = _messages(conversation, column)
  if isinstance(messages, BadRow):
    yield messages
    return
  ends = chat_templates.assistant_turns(messages)
  if not ends or ends[-1] != len(messages) - 1:
    ends.append(len(messages))
  if ctx.options["turns"] == "last":
    ends = ends[-1:]
  for end in ends:
    try:
      prompt = ctx.chat_template.render(messages[:end],
                                        add_generation_prompt=True)
    except chat_templates.ChatTemplateError as e:
      yield _template_refused(ctx, f"{column}[:{end}]", e)
      continue
    yield {kinds_lib.PROMPT: prompt,
           layout_rows.EXTRA_COLUMNS: _with_conversation(extras, messages[:end])}


def messages_layout(record, ctx: RowContext) -> RowResult:
  if ctx.kind.name == kinds_lib.DEMONSTRATIONS.name:
    return _messages_demonstrations(record, ctx)
  if ctx.kind.name == kinds_lib.PROMPTS.name:
    return _messages_prompts(record, ctx)
  return _messages_pairs(record, ctx)
