r"""Makes the chat-template fixtures: transformers' renderings to test ours on.

Writes
  tests/fixtures/chat_templates/<family>.json   one per template below:
      {"family", "source", "template", "special_tokens", "cases": [
       {"name", "messages", "add_generation_prompt", "variables",
        "tools"?, "rendered" | "error", "generation_spans"?}]}
      rendered by transformers' own `apply_chat_template(..., tokenize=False)`
      (with the special tokens as that family's tokenizer_config.json
      declares them) on a fixed set of conversations; "error" is the
      message of the template's own `raise_exception` where it refuses one;
      "generation_spans" are transformers' `{% generation %}` spans
      (`render_jinja_template(..., return_assistant_tokens_mask=True)`).
  tests/fixtures/tokenizers/chat_qwen/    a tiny Qwen-style tokenizer
      (byte-level BPE with Qwen 2's pre-tokenizer regex; <|endoftext|>,
      <|im_start|>, <|im_end|> special; <think>, </think> added) and a
      tokenizer_config.json with the Qwen2.5-Instruct template
      (eos <|im_end|>, pad <|endoftext|>, no bos): what a tiny Qwen-style
      model is trained on in the tests.
  tests/fixtures/tokenizers/chat_llama3/  a tiny Llama-3-style one
      (byte-level BPE, ordinary tokens from id 0, then <|begin_of_text|>,
      <|end_of_text|>, <|start_header_id|>, <|end_header_id|>, <|eot_id|>,
      <|finetune_right_pad_id|>; a post-processor that prepends
      <|begin_of_text|>, as Llama 3's does) with the Llama 3.1 Instruct
      template (bos <|begin_of_text|>, eos <|eot_id|>).
  tests/fixtures/chat_templates/token_ids.json  for those two: the token ids
      transformers' `apply_chat_template(..., tokenize=True)` gives for some
      conversations (AutoTokenizer loaded from the folder).

The templates are data copied from the models' tokenizer_config.json files
(Qwen/Qwen2.5-7B-Instruct, Qwen/Qwen3-8B, meta-llama/Llama-3.1-8B-Instruct,
google/gemma-3-4b-it, mistralai/Mistral-7B-Instruct-v0.3), written here as
the Jinja text itself (JSON-decoded); nothing is downloaded.

  pip install transformers   # (torch is not needed)
  python experiments/make_chat_template_fixtures.py [--out tests/fixtures]
"""

import argparse
import json
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]

# --- the templates ----------------------------------------------------------

QWEN2_5_INSTRUCT = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

LLAMA3_1_INSTRUCT = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

GEMMA3_IT = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

MISTRAL_7B_INSTRUCT_V0_3 = r"""{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

# Not a model's: a ChatML template whose assistant replies are
# {% generation %} blocks (as TRL patches templates to get an assistant
# mask), to check the block's spans; its block tags are indented without
# "-", so that lstrip_blocks and trim_blocks shape its output.
CHATML_WITH_GENERATION = r"""{%- for message in messages %}
    {% if message['role'] != 'assistant' %}
        {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>assistant\n' }}
        {%- generation %}
            {{- message['content'] + '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\n' }}
    {%- endif %}
{% endfor %}
{% if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

QWEN_SPECIALS = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
LLAMA3_SPECIALS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}

FAMILIES = {
    "qwen2_5": ("Qwen/Qwen2.5-7B-Instruct tokenizer_config.json",
                QWEN2_5_INSTRUCT, QWEN_SPECIALS),
    "qwen3": ("Qwen/Qwen3-8B tokenizer_config.json", QWEN3, QWEN_SPECIALS),
    "llama3_1": ("meta-llama/Llama-3.1-8B-Instruct tokenizer_config.json",
                 LLAMA3_1_INSTRUCT, LLAMA3_SPECIALS),
    "gemma3": ("google/gemma-3-4b-it tokenizer_config.json", GEMMA3_IT,
               {"bos_token": "<bos>", "eos_token": "<eos>",
                "unk_token": "<unk>", "pad_token": "<pad>"}),
    "mistral_v0_3": ("mistralai/Mistral-7B-Instruct-v0.3 "
                     "tokenizer_config.json", MISTRAL_7B_INSTRUCT_V0_3,
                     {"bos_token": "<s>", "eos_token": "</s>",
                      "unk_token": "<unk>"}),
    "chatml_generation": ("written here: ChatML with {% generation %}",
                          CHATML_WITH_GENERATION, QWEN_SPECIALS),
}

# --- the conversations ---------------------------------------------------------


def _m(role, content, **extra):
  return {"role": role, "content": content, **extra}


U1 = _m("user", "what is the capital of france?")
A1 = _m("assistant", "the capital of france is paris.")
U2 = _m("user", "and of spain?")
A2 = _m("assistant", "madrid.")
SYSTEM = _m("system", "you are a terse assistant.")
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city, e.g. "
    "'café <b>&</b>' in zürich",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city"}},
                   "required": ["city"]}}}

# (name, messages, add_generation_prompt, variables, tools); every family
# renders each, or records the error its template raises.
CASES = [
    ("user_prompt", [U1], True, {}, None),
    ("system_user_prompt", [SYSTEM, U1], True, {}, None),
    ("user_reply", [U1, A1], False, {}, None),
    ("system_user_reply", [SYSTEM, U1, A1], False, {}, None),
    ("two_turns_prompt", [U1, A1, U2], True, {}, None),
    ("two_turns", [U1, A1, U2, A2], False, {}, None),
    ("system_two_turns_prompt", [SYSTEM, U1, A1, U2], True, {}, None),
    ("system_two_turns", [SYSTEM, U1, A1, U2, A2], False, {}, None),
    ("whitespace_and_unicode", [
        _m("user", "  café, 東京 and {{ not jinja }} {% raw %}  \n"),
        _m("assistant", "  spaced reply \u00e9  \n")], False, {}, None),
    ("null_keys_dropped", [_m("user", "hi", name=None),
                           _m("assistant", "hello", tool_calls=None)],
     False, {}, None),
    ("two_users", [U1, U2], True, {}, None),
    ("assistant_first", [A1, U1], True, {}, None),
    ("thinking_in_content", [U1, _m(
        "assistant", "<think>\nparis is the capital.\n</think>\n\nparis.")],
     False, {}, None),
    ("reasoning_field", [U1, _m("assistant", "paris.",
                                reasoning_content="it is paris.")],
     False, {}, None),
    ("thinking_field", [U1, _m("assistant", "paris.",
                               thinking="it is paris.")], False, {}, None),
    ("history_thinking_dropped", [
        U1, _m("assistant", "<think>\nhmm\n</think>\n\nparis."), U2],
     True, {}, None),
    ("enable_thinking_false_prompt", [U1], True, {"enable_thinking": False},
     None),
    ("enable_thinking_false_reply", [U1, A1], False,
     {"enable_thinking": False}, None),
    ("date_string", [U1], True, {"date_string": "01 Jan 2025"}, None),
    ("tools_prompt", [U1], True, {}, [WEATHER_TOOL]),
]

# (name, folder, messages, add_generation_prompt): ids of the fixture
# tokenizers' renderings.
TOKEN_CASES = [
    ("user_prompt", [U1], True),
    ("user_reply", [U1, A1], False),
    ("system_user_prompt", [SYSTEM, U1], True),
    ("system_user_reply", [SYSTEM, U1, A1], False),
    ("two_turns_prompt", [U1, A1, U2], True),
    ("two_turns", [U1, A1, U2, A2], False),
]

# --- the tokenizers -------------------------------------------------------------

CORPUS = [
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    "system user assistant tool model",
    "what is the capital of france? the capital of france is paris.",
    "and of spain? madrid. you are a terse assistant.",
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n",
    "the cat sat on the mat. the dog sat on the log.",
    "red blue green gold fox owl sun cat dog one two three four five",
    "summarize the words in order: red blue green. answer: red blue green.",
    "how many? 3 + 4 = 7. the answer is 7.",
    "a policy samples a completion and a reward model scores it.",
]
# Qwen 2's pre-tokenizer (and, up to \p{N}{1,3}, Llama 3's).
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
              r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
                r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|"
                r"\s+")


def _byte_level_bpe(split: str, vocab_size: int):
  from tokenizers import (Regex, Tokenizer, decoders, models,  # pylint: disable=g-import-not-at-top
                          pre_tokenizers, trainers)
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(split), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
      vocab_size=vocab_size, show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  return tok


def qwen_style_tokenizer():
  """Qwen's layout, small: the special tokens first here (so that the
  padding <|endoftext|> is id 0), then byte-level BPE."""
  from tokenizers import AddedToken, Tokenizer, processors  # pylint: disable=g-import-not-at-top
  learnt = json.loads(_byte_level_bpe(QWEN_SPLIT, 400).to_str())
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  vocab = {t: i for i, t in enumerate(specials)}
  for token, _ in sorted(learnt["model"]["vocab"].items(), key=lambda kv: kv[1]):
    vocab.setdefault(token, len(vocab))
  learnt["model"]["vocab"] = vocab
  learnt["added_tokens"] = []
  tok = Tokenizer.from_str(json.dumps(learnt))
  tok.add_special_tokens([AddedToken(t, normalized=False) for t in specials])
  tok.add_tokens([AddedToken(t, normalized=False, special=False)
                  for t in ("<think>", "</think>")])
  tok.post_processor = processors.ByteLevel(trim_offsets=False)
  return tok


def llama3_style_tokenizer():
  """Llama 3's layout, small: byte-level BPE from id 0 ("!"), then the
  special tokens, and a post-processor that prepends <|begin_of_text|>."""
  from tokenizers import AddedToken, processors  # pylint: disable=g-import-not-at-top
  tok = _byte_level_bpe(LLAMA3_SPLIT, 400)
  specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
              "<|end_header_id|>", "<|eot_id|>", "<|finetune_right_pad_id|>"]
  tok.add_special_tokens([AddedToken(t, normalized=False) for t in specials])
  bos = specials[0]
  tok.post_processor = processors.Sequence([
      processors.ByteLevel(trim_offsets=False),
      processors.TemplateProcessing(
          single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
          special_tokens=[(bos, tok.token_to_id(bos))])])
  return tok


def _write_tokenizer(folder: pathlib.Path, tok, template: str,
                     specials: dict):
  folder.mkdir(parents=True, exist_ok=True)
  tok.save(str(folder / "tokenizer.json"))
  config = {"tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,
            "model_max_length": 4096, **specials,
            "chat_template": template}
  if "bos_token" not in specials:
    config["bos_token"] = None
  (folder / "tokenizer_config.json").write_text(
      json.dumps(config, indent=2, ensure_ascii=False) + "\n")


# --- rendering with transformers --------------------------------------------------


def _hf_tokenizer(template: str, specials: dict):
  """A transformers tokenizer whose special tokens are `specials`: the
  template's variables are exactly those a model's tokenizer gives."""
  from tokenizers import Tokenizer, models, pre_tokenizers  # pylint: disable=g-import-not-at-top
  from transformers import PreTrainedTokenizerFast  # pylint: disable=g-import-not-at-top
  tokens = sorted(set(specials.values()) | {"<unk>"})
  tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)},
                                   unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens(tokens)
  return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template,
                                 **specials)


def render_family(name: str) -> dict:
  from transformers.utils import chat_template_utils  # pylint: disable=g-import-not-at-top
  source, template, specials = FAMILIES[name]
  hf = _hf_tokenizer(template, specials)
  cases = []
  for case, messages, generation_prompt, variables, tools in CASES:
    entry = {"name": case, "messages": messages,
             "add_generation_prompt": generation_prompt,
             "variables": variables}
    if tools is not None:
      entry["tools"] = tools
    try:
      entry["rendered"] = hf.apply_chat_template(
          messages, tools=tools, tokenize=False,
          add_generation_prompt=generation_prompt, **variables)
    except Exception as e:  # pylint: disable=broad-except
      # The template's raise_exception is a jinja2 TemplateError.
      entry["error"] = str(e)
    if re.search(r"\{%-?\s*generation\s*-?%\}", template) and (
        "rendered" in entry):
      _, spans = chat_template_utils.render_jinja_template(
          conversations=[messages], chat_template=template,
          return_assistant_tokens_mask=True,
          add_generation_prompt=generation_prompt,
          **hf.special_tokens_map, **variables)
      entry["generation_spans"] = [list(s) for s in spans[0]]
    cases.append(entry)
  return {"family": name, "source": source, "template": template,
          "special_tokens": specials, "cases": cases}


def token_ids(folder: pathlib.Path) -> dict:
  from transformers import AutoTokenizer  # pylint: disable=g-import-not-at-top
  hf = AutoTokenizer.from_pretrained(str(folder))
  out = {}
  for case, messages, generation_prompt in TOKEN_CASES:
    ids = hf.apply_chat_template(messages, tokenize=True, return_dict=False,
                                 add_generation_prompt=generation_prompt)
    out[case] = {"messages": messages,
                 "add_generation_prompt": generation_prompt,
                 "rendered": hf.apply_chat_template(
                     messages, tokenize=False,
                     add_generation_prompt=generation_prompt),
                 "ids": list(ids)}
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default=str(REPO / "tests" / "fixtures"))
  out = pathlib.Path(parser.parse_args().out)
  templates = out / "chat_templates"
  templates.mkdir(parents=True, exist_ok=True)
  for name in FAMILIES:
    (templates / f"{name}.json").write_text(json.dumps(
        render_family(name), indent=1, ensure_ascii=False) + "\n")
  folders = {"chat_qwen": (qwen_style_tokenizer(), QWEN2_5_INSTRUCT,
                           QWEN_SPECIALS),
             "chat_llama3": (llama3_style_tokenizer(), LLAMA3_1_INSTRUCT,
                             LLAMA3_SPECIALS)}
  ids = {}
  for folder_name, (tok, template, specials) in folders.items():
    folder = out / "tokenizers" / folder_name
    _write_tokenizer(folder, tok, template, specials)
    ids[folder_name] = token_ids(folder)
  (templates / "token_ids.json").write_text(json.dumps(
      ids, indent=1, ensure_ascii=False) + "\n")
  print(f"wrote {len(FAMILIES)} templates and {len(folders)} tokenizers "
        f"under {out}")


if __name__ == "__main__":
  main()
