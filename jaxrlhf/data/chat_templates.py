"""Chat templates: a checkpoint's own Jinja `chat_template`, rendered as
transformers renders it, and conversations split into prompts and replies.

Where the template comes from (`for_vocabulary`, `from_files`), in the order
transformers loads it: a template file named explicitly
(`config.data.files.chat_template`), else a `chat_template.jinja` beside the
`tokenizer.json` (where transformers >= 4.51 saves it), else the
`chat_template` of the `tokenizer_config.json` beside it: a string, or a
list of named templates ({"name", "template"}) of which "default" is taken.
The template is data; nothing is downloaded.

How it is rendered (`ChatTemplate.render`), as `apply_chat_template` does:
a sandboxed Jinja environment (jinja2's `ImmutableSandboxedEnvironment`,
with `trim_blocks` and `lstrip_blocks`, and the `loopcontrols` extension for
`{% break %}`), a `tojson` filter that is `json.dumps` (no HTML escaping,
non-ASCII kept, `indent`/`separators`/`sort_keys`), the globals
`raise_exception(message)` (the template refusing a conversation: a
`ChatTemplateError`), `strftime_now(format)`, a restricted `dict` and a
`namespace` that refuses underscore names, and the `{% generation %}`
block, rendered as its body (`render_with_generation_spans` also returns
where each block's text lies). The variables are `messages`, `tools`,
`documents`, `add_generation_prompt`, the tokenizer's named special tokens
as strings (`bos_token`, `eos_token`, `unk_token`, `sep_token`,
`pad_token`, `cls_token`, `mask_token`, from `tokenizer_config.json`; a
missing or null one is undefined, as Qwen's `bos_token`), and any extra
variables (`enable_thinking=False` for Qwen 3, `date_string` for Llama 3).
Messages are passed with their null-valued keys dropped, and a message's
reasoning under any of `reasoning_content`, `thinking`, `reasoning` is also
given under `reasoning_content` and `thinking` (transformers does both).

Prompts and replies (`split_reply`). A reply (one assistant message) after
its context (the messages before it) is cut from two renderings: the prompt
is the context rendered with the generation prompt, exactly what the policy
reads before it speaks (`<|im_start|>assistant\\n`); the reply is the rest
of the context rendered with the reply (no generation prompt). The second
must start with the first; templates whose history depends on what follows
(Mistral's v3 template shows the system message only when the last message
is a user turn) are refused for such a conversation (`NotAPrefixError`)
rather than trained on a context the model never sees.

The end of a reply. The rendered reply ends with the template's end-of-turn
text (`<|im_end|>\\n`, `<|eot_id|>`, `<end_of_turn>\\n`, `</s>`). Tasks
append the vocabulary's EOS id to every completion, and sampling stops at
that id (`vocabulary.eos_id`), so the reply text (`ChatTemplate.reply_text`)
loses its trailing whitespace (what the template puts between turns: it
belongs to the next prompt) and then, when it ends with the EOS token's text
(`eos_text`: Qwen instruct's `<|im_end|>`, Llama 3.1 Instruct's
`<|eot_id|>`, Mistral's `</s>`), that text: the appended EOS id is it, so
the completion's tokens are the template's, once. When the end-of-turn
token is another one (Gemma 3's `<end_of_turn>`, whose tokenizer's EOS is
`<eos>`), the reply keeps it and the EOS follows it: the policy learns to
close its turn and then stop where sampling stops.
"""

import contextvars
import datetime
import json
import os
from typing import (Any, Dict, Iterator, List, Mapping, Optional, Sequence,
                    Tuple)

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils


# Where transformers (>= 4.51) saves a tokenizer's single template.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# The named special tokens transformers hands every template (its
# `special_tokens_map`), as strings.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token",
                       "pad_token", "cls_token", "mask_token")
# A message's reasoning may come under any of these names; templates read
# the first (Qwen 3) or `thinking` (gpt-oss).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
ASSISTANT = "assistant"


class ChatTemplateError(ValueError):
  """The template refused a conversation (its `raise_exception`) or failed
  while rendering it."""


class NotAPrefixError(ChatTemplateError):
  """The context rendered with the generation prompt is not where the
  rendering with the reply starts."""


# --- the Jinja environment ---------------------------------------------------

# The text rendered so far and the generation spans of the rendering under
# way, while `render_with_generation_spans` runs.
_TRACKER: contextvars.ContextVar = contextvars.ContextVar(
    "chat_template_generation_tracker", default=None)


class _GenerationBlock(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}`: renders its body, and records
  where that text lies in the output when a tracker is active (transformers
  marks the assistant's tokens with it, `return_assistant_tokens_mask`)."""
  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [],
                                  body).set_lineno(lineno)

  def _render_body(self, caller):
    text = caller()
    tracker = _TRACKER.get()
    if tracker is not None:
      chunks, spans = tracker
      start = sum(len(c) for c in chunks)
      spans.append((start, start + len(text)))
    return text


def _raise_exception(message):
  raise ChatTemplateError(str(message))


def _tojson(value, ensure_ascii=False, indent=None, separators=None,
            sort_keys=False):
  # Jinja's own `tojson` escapes <, >, & and ' for HTML; templates want JSON.
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                    separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
  return datetime.datetime.now().strftime(fmt)


class _Dict:
  """`dict(...)` and `dict.fromkeys(...)` inside a template, and nothing
  else of the type."""

  def __call__(self, *args, **kwargs):
    return dict(*args, **kwargs)

  def fromkeys(self, *args, **kwargs):
    return dict.fromkeys(*args, **kwargs)


def _check_namespace_name(name):
  if isinstance(name, str) and name.startswith("_"):
    raise jinja2.exceptions.SecurityError(
        f"a chat template may not store {name!r} on a namespace: names "
        "starting with '_' are refused.")


class _Namespace(jinja2.utils.Namespace):
  """Jinja's `namespace()`, refusing underscore names (which could reach
  Python internals)."""

  def __init__(*args, **kwargs):  # pylint: disable=no-method-argument
    self, args = args[0], args[1:]
    attrs = dict(*args, **kwargs)
    for name in attrs:
      _check_namespace_name(name)
    jinja2.utils.Namespace.__init__(self, attrs)

  def __setitem__(self, name, value):
    _check_namespace_name(name)
    jinja2.utils.Namespace.__setitem__(self, name, value)


def _environment() -> jinja2.Environment:
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True,
      extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals.update(raise_exception=_raise_exception,
                     strftime_now=_strftime_now, dict=_Dict(),
                     namespace=_Namespace)
  return env


_ENV = _environment()


def message_for_template(message: Mapping[str, Any]) -> Dict[str, Any]:
  """A message as transformers hands it to the template: null-valued keys
  dropped, its reasoning under `reasoning_content` and `thinking` too."""
  out = {key: value for key, value in message.items() if value is not None}
  reasoning = next((out[key] for key in REASONING_FIELDS if key in out), None)
  if reasoning is not None:
    out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
  return out


# --- the template -------------------------------------------------------------


class ChatTemplate:
  """A compiled chat template and the values it is rendered with.

  Args:
    source: the Jinja text.
    special_tokens: {"bos_token": "<s>", ...}: the tokenizer's named special
      tokens (`special_tokens_of`).
    variables: extra template variables for every rendering
      ({"enable_thinking": False}).
    eos_text: the text of the EOS id that tasks append to completions;
      a reply ending with it loses it (module docstring). None: nothing is
      removed.
    origin: where the template came from, for messages.
  """

  def __init__(self, source: str, *,
               special_tokens: Optional[Mapping[str, str]] = None,
               variables: Optional[Mapping[str, Any]] = None,
               eos_text: Optional[str] = None, origin: str = "<string>"):
    self.source = source
    self.special_tokens = dict(special_tokens or {})
    self.variables = dict(variables or {})
    self.eos_text = eos_text or None
    self.origin = origin
    try:
      self._template = _ENV.from_string(source)
    except jinja2.TemplateSyntaxError as e:
      raise ValueError(f"{origin}: the chat template is not valid Jinja "
                       f"(line {e.lineno}: {e.message}).") from None

  def _context(self, messages, add_generation_prompt, tools, documents,
               variables) -> Dict[str, Any]:
    if not messages:
      # As transformers: templates read messages[0].
      raise ChatTemplateError("no message to render (an assistant reply "
                              "needs a message before it).")
    for i, message in enumerate(messages):
      if not isinstance(message, Mapping):
        raise ChatTemplateError(f"message {i} is a {type(message).__name__}, "
                                "not an object with 'role' and 'content'.")
    return {**self.special_tokens, **self.variables, **variables,
            "messages": [message_for_template(m) for m in messages],
            "tools": None if tools is None else list(tools),
            "documents": None if documents is None else list(documents),
            "add_generation_prompt": bool(add_generation_prompt)}

  def _render_chunks(self, context) -> Iterator[str]:
    try:
      yield from self._template.generate(**context)
    except ChatTemplateError:
      raise
    except (jinja2.TemplateError, TypeError, ValueError, KeyError,
            IndexError, AttributeError) as e:
      raise ChatTemplateError(f"{type(e).__name__}: {e}") from None

  def render(self, messages: Sequence[Mapping[str, Any]], *,
             add_generation_prompt: bool = False,
             tools: Optional[Sequence[Mapping[str, Any]]] = None,
             documents: Optional[Sequence[Mapping[str, Any]]] = None,
             **variables) -> str:
    """The conversation as text (`apply_chat_template(..., tokenize=False)`).

    Raises:
      ChatTemplateError: the template refused the conversation.
    """
    context = self._context(messages, add_generation_prompt, tools,
                            documents, variables)
    return "".join(self._render_chunks(context))

  def render_with_generation_spans(
      self, messages: Sequence[Mapping[str, Any]], *,
      add_generation_prompt: bool = False, **variables
  ) -> Tuple[str, List[Tuple[int, int]]]:
    """`render`, and the [start, end) character span of the text of each
    `{% generation %}` block (transformers' assistant mask); no spans for a
    template without such blocks."""
    context = self._context(messages, add_generation_prompt, None, None,
                            variables)
    chunks, spans = [], []
    token = _TRACKER.set((chunks, spans))
    try:
      for chunk in self._render_chunks(context):
        chunks.append(chunk)
    finally:
      _TRACKER.reset(token)
    return "".join(chunks), spans

  def reply_text(self, rendered_reply: str) -> str:
    """The completion text of a rendered reply: trailing whitespace dropped,
    then the EOS text it ends with, which the task's EOS id stands for
    (module docstring)."""
    text = rendered_reply.rstrip()
    if self.eos_text and text.endswith(self.eos_text):
      text = text[:-len(self.eos_text)]
    return text

  def __repr__(self):
    return (f"ChatTemplate(origin={self.origin!r}, eos_text="
            f"{self.eos_text!r}, variables={self.variables})")


# --- prompts and replies --------------------------------------------------------


def _first_difference(a: str, b: str) -> int:
  n = min(len(a), len(b))
  return next((i for i in range(n) if a[i] != b[i]), n)


def split_reply(template: ChatTemplate, context: Sequence[Mapping[str, Any]],
                reply: Mapping[str, Any], *,
                tools: Optional[Sequence[Mapping[str, Any]]] = None
                ) -> Tuple[str, str]:
  """(prompt text, completion text) of one assistant `reply` after the
  messages of `context` (module docstring), rendered with the template's
  `tools` (JSON schemas; None: none).

  Raises:
    NotAPrefixError: the template renders the context differently once the
      reply follows.
    ChatTemplateError: the template refused the conversation.
  """
  prompt = template.render(context, add_generation_prompt=True, tools=tools)
  full = template.render(list(context) + [reply], tools=tools)
  if not full.startswith(prompt):
    at = _first_difference(prompt, full)
    raise NotAPrefixError(
        f"the chat template renders the {len(context)} message(s) before this "
        f"assistant reply differently once the reply follows: from character "
        f"{at} the prompt reads {prompt[at:at + 40]!r} and the conversation "
        f"{full[at:at + 40]!r} (Mistral's v3 template, for one, shows the "
        "system message only when the last message is a user turn); fold the "
        "system message into the first user message, or give a template "
        "(config.data.files.chat_template) whose history does not depend on "
        "what follows.")
  return prompt, template.reply_text(full[len(prompt):])


def assistant_turns(messages: Sequence[Mapping[str, Any]]) -> List[int]:
  """Indices of the assistant messages of a conversation."""
  return [i for i, m in enumerate(messages)
          if isinstance(m, Mapping) and m.get("role") == ASSISTANT]


# --- loading --------------------------------------------------------------------

# `from_files`' default EOS text: the tokenizer_config.json's eos_token.
_CONFIG_EOS = object()


# TensorFlow's file system reads gs:// too. It and the tokenizers
# (`hf_tokenizer`, seqio) load where a template is read, not when the config
# loads this module (through `file_layouts`).


def _read_text(path: str) -> str:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  with tf.io.gfile.GFile(path, "r") as f:
    return f.read()


def _exists(path: str) -> bool:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf.io.gfile.exists(path)


def special_tokens_of(tokenizer_config: Mapping[str, Any]) -> Dict[str, str]:
  """The named special tokens a template is rendered with, from a
  tokenizer_config.json (the null or absent ones left out)."""
  from jaxrlhf.data import hf_tokenizer  # pylint: disable=g-import-not-at-top
  out = {}
  for name in SPECIAL_TOKEN_NAMES:
    text = hf_tokenizer.token_content(tokenizer_config.get(name))
    if text is not None:
      out[name] = text
  return out


def template_in_config(tokenizer_config: Mapping[str, Any], where: str
                       ) -> Optional[str]:
  """The `chat_template` of a tokenizer_config.json: the string, or the
  template named "default" of a list of named templates; None if absent."""
  value = tokenizer_config.get("chat_template")
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, list):
    named = {t.get("name"): t.get("template") for t in value
             if isinstance(t, Mapping)}
    if isinstance(named.get("default"), str):
      return named["default"]
    raise ValueError(
        f"{where}: chat_template is a list of named templates "
        f"{sorted(str(n) for n in named)} with none named 'default'; save the "
        "one to use as a Jinja file and set config.data.files.chat_template "
        "to it.")
  raise ValueError(f"{where}: chat_template is a {type(value).__name__}; "
                   "expected a string or a list of {name, template}.")


def from_files(tokenizer_file: Optional[str] = None, *,
               template_file: str = "",
               tokenizer_config: Optional[Mapping[str, Any]] = None,
               variables: Optional[Mapping[str, Any]] = None,
               eos_text: Any = _CONFIG_EOS) -> ChatTemplate:
  """The chat template of a tokenizer's files (module docstring).

  Args:
    tokenizer_file: a `tokenizer.json`; its folder is searched for
      chat_template.jinja and tokenizer_config.json.
    template_file: a Jinja file that takes precedence ('' = none).
    tokenizer_config: the tokenizer_config.json's content, when already read
      (else it is read from the tokenizer's folder, if there).
    variables: extra template variables.
    eos_text: the text tasks' EOS stands for; by default the config's
      `eos_token`.

  Raises:
    ValueError: no template is found, or it is not valid Jinja.
  """
  folder = os.path.dirname(tokenizer_file) if tokenizer_file else ""
  config_path = os.path.join(folder, TOKENIZER_CONFIG_FILE) if folder else ""
  if tokenizer_config is None:
    tokenizer_config = {}
    if config_path and _exists(config_path):
      try:
        tokenizer_config = json.loads(_read_text(config_path))
      except ValueError as e:
        raise ValueError(f"{config_path} is not JSON: {e}") from None
  special_tokens = special_tokens_of(tokenizer_config)
  jinja_path = os.path.join(folder, CHAT_TEMPLATE_FILE) if folder else ""
  if template_file:
    if not _exists(template_file):
      raise ValueError(f"config.data.files.chat_template: no file "
                       f"{template_file!r}.")
    source, origin = _read_text(template_file), template_file
  elif jinja_path and _exists(jinja_path):
    source, origin = _read_text(jinja_path), jinja_path
  else:
    origin = f"{config_path} chat_template"
    source = template_in_config(tokenizer_config, config_path)
    if source is None:
      where = f"beside {tokenizer_file}" if tokenizer_file else "anywhere"
      raise ValueError(
          f"no chat template {where}: neither a {CHAT_TEMPLATE_FILE} nor a "
          f"chat_template in {TOKENIZER_CONFIG_FILE}. Copy the checkpoint's "
          "tokenizer_config.json (or chat_template.jinja) next to the "
          "tokenizer, or set config.data.files.chat_template to a Jinja "
          "file.")
  if eos_text is _CONFIG_EOS:
    eos_text = special_tokens.get("eos_token")
  return ChatTemplate(source, special_tokens=special_tokens,
                      variables=variables, eos_text=eos_text, origin=origin)


def for_vocabulary(vocabulary, template_file: str = "",
                   variables: Optional[Mapping[str, Any]] = None
                   ) -> ChatTemplate:
  """The chat template to render a task's conversations with: the
  vocabulary's own (a Hugging Face tokenizer's files), or `template_file`.
  Its `eos_text` is the text of the vocabulary's EOS, the id tasks append.

  Raises:
    ValueError: no template; a vocabulary that is not a Hugging Face
      tokenizer and no `template_file`; or a vocabulary that adds the
      tokenizer's own special tokens to every text it encodes (the template
      writes them: Llama 3's `<|begin_of_text|>` would come twice).
  """
  from jaxrlhf.data import hf_tokenizer  # pylint: disable=g-import-not-at-top
  if isinstance(vocabulary, hf_tokenizer.HFTokenizerVocabulary):
    if vocabulary.add_special_tokens:
      raise ValueError(
          f"{vocabulary.tokenizer_file}: this vocabulary adds the tokenizer's "
          "special tokens (its post-processor, e.g. a leading BOS) to every "
          "text it encodes, but a chat template writes them itself, so they "
          "would come twice. Use a vocabulary with add_special_tokens=False "
          "(the default) for chat-templated data.")
    return from_files(vocabulary.tokenizer_file, template_file=template_file,
                      tokenizer_config=vocabulary.tokenizer_config,
                      variables=variables,
                      eos_text=vocabulary.token_text(vocabulary.eos_id))
  if not template_file:
    raise ValueError(
        "layout 'messages' renders conversations with a chat template: set "
        "config.data.files.vocabulary to a Hugging Face tokenizer.json with "
        "its tokenizer_config.json (or chat_template.jinja) beside it, or "
        "config.data.files.chat_template to a Jinja file.")
  return from_files(None, template_file=template_file, variables=variables,
                    eos_text=None)


def parse_variables(text: str, field: str = "config.data.files."
                    "chat_template_kwargs") -> Dict[str, Any]:
  """'{"enable_thinking": false}' -> {"enable_thinking": False}; '' -> {}."""
  if not text:
    return {}
  try:
    value = json.loads(text)
  except ValueError as e:
    raise ValueError(f"{field}: {text!r} is not JSON ({e}); write an object "
                     "such as '{\"enable_thinking\": false}'.") from None
  if not isinstance(value, dict):
    raise ValueError(f"{field}: {text!r} must be a JSON object of template "
                     "variables, such as '{\"enable_thinking\": false}'.")
  return value
