"""Chat templates: rendered as transformers renders them, and conversations
read as SFT demonstrations, preference pairs and online prompts.

The expected texts, errors and token ids are transformers' own
(`apply_chat_template` on the Qwen 2.5, Qwen 3, Llama 3.1, Gemma 3 and
Mistral v0.3 templates), recorded in tests/fixtures/chat_templates/ by
experiments/make_chat_template_fixtures.py; the tiny Qwen- and Llama-3-style
tokenizers under tests/fixtures/tokenizers/chat_* come from the same
script."""

import json
import shutil

import flax.linen as nn
import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import seqio

from conftest import FIXTURES, evaluated_by, from_scratch, tiny_config
from conftest import trainer_of
from jaxrlhf import algorithms
from jaxrlhf import sharding
from jaxrlhf.data import alignment_data
from jaxrlhf.data import alignment_kinds
from jaxrlhf.data import chat_templates
from jaxrlhf.data import feature_converters
from jaxrlhf.data import file_sources
from jaxrlhf.data import file_tasks
from jaxrlhf.data import hf_tokenizer
from jaxrlhf.data import pipeline
from jaxrlhf.data import prompts as prompts_lib

TEMPLATES = FIXTURES / "chat_templates"
FAMILIES = ("qwen2_5", "qwen3", "llama3_1", "gemma3", "mistral_v0_3",
            "chatml_generation")
TOKENIZERS = ("chat_qwen", "chat_llama3")
TOKENIZER_CONFIG = (f"{FIXTURES}/tokenizers/chat_qwen/tokenizer_config.json "
                    "chat_template")
DEMONSTRATIONS = alignment_kinds.DEMONSTRATIONS


def family(name):
  return json.loads((TEMPLATES / f"{name}.json").read_text())


def template_of(name, **kwargs):
  """A family's template with its tokenizer's special tokens; the EOS text
  is its `eos_token`, as `from_files` takes it."""
  data = family(name)
  return chat_templates.ChatTemplate(
      data["template"], special_tokens=data["special_tokens"],
      eos_text=data["special_tokens"].get("eos_token"), origin=name, **kwargs)


def case(name, case_name):
  return next(c for c in family(name)["cases"] if c["name"] == case_name)


def vocabulary_of(folder, **kwargs):
  return hf_tokenizer.HFTokenizerVocabulary(
      str(FIXTURES / "tokenizers" / folder / "tokenizer.json"), **kwargs)


def write_rows(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def msg(role, content, **extra):
  return {"role": role, "content": content, **extra}


U1, A1 = msg("user", "what is the capital of france?"), msg(
    "assistant", "the capital of france is paris.")
U2, A2 = msg("user", "and of spain?"), msg("assistant", "madrid.")


# --- rendering -----------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_renders_every_case_as_transformers_does(name):
  data = family(name)
  template = template_of(name)
  for c in data["cases"]:
    kwargs = dict(add_generation_prompt=c["add_generation_prompt"],
                  **c["variables"])
    if "error" in c:
      # The template's own raise_exception, with its message.
      with pytest.raises(chat_templates.ChatTemplateError) as raised:
        template.render(c["messages"], tools=c.get("tools"), **kwargs)
      assert str(raised.value) == c["error"], c["name"]
      continue
    assert template.render(c["messages"], tools=c.get("tools"),
                           **kwargs) == c["rendered"], c["name"]
    if "generation_spans" in c:
      text, spans = template.render_with_generation_spans(c["messages"],
                                                          **kwargs)
      assert text == c["rendered"]
      assert spans == [tuple(s) for s in c["generation_spans"]], c["name"]


def test_the_sandbox_refuses_internals_and_mutation():
  for source in ("{{ ''.__class__.__mro__ }}",
                 "{% set ns = namespace() %}{% set ns._x = 1 %}",
                 "{{ messages.append(1) }}"):
    with pytest.raises(chat_templates.ChatTemplateError):
      chat_templates.ChatTemplate(source).render([U1])
  with pytest.raises(ValueError, match=r"bad\.jinja: the chat template is "
                     r"not valid Jinja \(line 1"):
    chat_templates.ChatTemplate("{% if %}", origin="bad.jinja")


# --- where the template comes from ------------------------------------------------


def test_the_template_comes_from_the_tokenizer_files(tmp_path):
  vocabulary = vocabulary_of("chat_qwen")
  own = chat_templates.for_vocabulary(vocabulary)
  assert own.source == family("qwen2_5")["template"]
  assert own.special_tokens == {"eos_token": "<|im_end|>",
                                "pad_token": "<|endoftext|>"}
  assert own.eos_text == "<|im_end|>"  # the vocabulary's EOS
  folder = tmp_path / "tok"
  shutil.copytree(FIXTURES / "tokenizers" / "chat_qwen", folder)
  config = json.loads((folder / "tokenizer_config.json").read_text())
  tokenizer = str(folder / "tokenizer.json")

  def source_of(**kwargs):
    return chat_templates.from_files(tokenizer, **kwargs).source

  # A list of named templates: "default" (transformers' choice).
  config["chat_template"] = [{"name": "tool_use", "template": "T"},
                             {"name": "default", "template": "D"}]
  (folder / "tokenizer_config.json").write_text(json.dumps(config))
  assert source_of() == "D"
  # chat_template.jinja beside the tokenizer wins over the config's.
  (folder / "chat_template.jinja").write_text("J")
  assert source_of() == "J"
  # An explicit file wins over both.
  (tmp_path / "mine.jinja").write_text("M")
  assert source_of(template_file=str(tmp_path / "mine.jinja")) == "M"
  (folder / "chat_template.jinja").unlink()
  config["chat_template"] = [{"name": "tool_use", "template": "T"}]
  (folder / "tokenizer_config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match=r"tokenizer_config.json: "
                     r"chat_template is a list of named templates "
                     r"\['tool_use'\] with none named 'default'"):
    source_of()
  del config["chat_template"]
  (folder / "tokenizer_config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match=r"no chat template beside .*"
                     r"tokenizer.json: neither a chat_template.jinja nor a "
                     r"chat_template in tokenizer_config.json"):
    source_of()


def test_template_variables_and_their_config_field():
  assert chat_templates.parse_variables('{"enable_thinking": false}') == {
      "enable_thinking": False}
  assert chat_templates.parse_variables("") == {}
  for text in ("{enable_thinking: false}", "[1]"):
    with pytest.raises(ValueError, match=r"config.data.files."
                       r"chat_template_kwargs: .* object"):
      chat_templates.parse_variables(text)
  # Qwen 3 without thinking: the empty think block ends the prompt.
  template = template_of("qwen3", variables={"enable_thinking": False})
  prompt, completion = chat_templates.split_reply(template, [U1], A1)
  assert prompt == case("qwen3", "enable_thinking_false_prompt")["rendered"]
  assert completion == A1["content"]


# --- tokens ----------------------------------------------------------------------


def _tokenizer_ids(vocabulary, text):
  """The tokenizer's ids of `text` as the vocabulary encodes it (the model's
  ids with 0 and the padding exchanged back, where they are)."""
  return [vocabulary.to_model_id(i) for i in vocabulary.encode(text)]


@pytest.mark.parametrize("folder", TOKENIZERS)
def test_rendered_text_encodes_to_transformers_ids(folder):
  vocabulary = vocabulary_of(folder)
  template = chat_templates.for_vocabulary(vocabulary)
  for name, c in json.loads((TEMPLATES / "token_ids.json").read_text()
                            )[folder].items():
    text = template.render(c["messages"],
                           add_generation_prompt=c["add_generation_prompt"])
    assert text == c["rendered"]
    # Special tokens are single ids, and the BOS the template writes comes
    # once: the vocabulary encodes without the post-processor's BOS.
    assert _tokenizer_ids(vocabulary, text) == c["ids"], name


def test_a_vocabulary_that_adds_a_bos_is_refused_for_chat_text():
  adding = vocabulary_of("chat_llama3", add_special_tokens=True)
  text = chat_templates.for_vocabulary(vocabulary_of("chat_llama3")).render(
      [U1], add_generation_prompt=True)
  bos = adding.bos_id
  assert vocabulary_of("chat_llama3").encode(text).count(bos) == 1
  assert adding.encode(text).count(bos) == 2  # what would go wrong
  with pytest.raises(ValueError, match=r"adds the tokenizer's special "
                     r"tokens .* would come twice"):
    chat_templates.for_vocabulary(adding)


@pytest.mark.parametrize("folder", TOKENIZERS)
def test_each_assistant_turn_is_transformers_tokens_with_the_eos(
    tmp_path, folder):
  """SFT's examples of a two-turn conversation: example k's prompt is
  transformers' tokens of the conversation before reply k with the
  generation prompt; prompt + completion + EOS are its tokens of the
  conversation through reply k, less the whitespace between turns."""
  vocabulary = vocabulary_of(folder)
  source = file_sources.AlignmentFileSource(
      write_rows(tmp_path / "c.jsonl", [{"messages": [U1, A1, U2, A2]}]),
      kind=DEMONSTRATIONS, layout="messages", vocabulary=vocabulary)
  examples = source.examples()
  assert [e["completion"] for e in examples] == ["the capital of france is "
                                                 "paris.", "madrid."]
  ids = json.loads((TEMPLATES / "token_ids.json").read_text())[folder]
  for example, (before, through) in zip(examples, [
      ("user_prompt", "user_reply"), ("two_turns_prompt", "two_turns")]):
    prompt = vocabulary.encode(example["prompt"])
    completion = vocabulary.encode(example["completion"]) + [
        vocabulary.eos_id]
    assert _tokenizer_ids(vocabulary, example["prompt"]) == ids[before]["ids"]
    full = [vocabulary.to_model_id(i) for i in ids[through]["ids"]]
    assert full[:len(prompt) + len(completion)] == prompt + completion
    tail = full[len(prompt) + len(completion):]
    assert not vocabulary.decode(tail).strip(), tail
  # turns="last": the last reply only.
  last = file_sources.AlignmentFileSource(
      source.list_shards("train"), kind=DEMONSTRATIONS, layout="messages",
      vocabulary=vocabulary, layout_options={"turns": "last"}).examples()
  assert last == examples[1:]


@pytest.mark.parametrize("name,reply,completion", [
    # The EOS text ends the turn: the task's EOS id stands for it.
    ("qwen2_5", "paris.", "paris."),
    ("llama3_1", "  paris. ", "paris."),
    ("mistral_v0_3", "paris.", " paris."),
    # Another end-of-turn token stays, and the EOS (<eos>) follows it.
    ("gemma3", "paris.", "paris.<end_of_turn>"),
    # Qwen 3 learns to close an empty think block where thinking is on.
    ("qwen3", "paris.", "<think>\n\n</think>\n\nparis."),
])
def test_the_reply_ends_where_the_template_ends_the_turn(name, reply,
                                                         completion):
  template = template_of(name)
  prompt, got = chat_templates.split_reply(template, [U1],
                                           msg("assistant", reply))
  assert prompt == case(name, "user_prompt")["rendered"]
  assert got == completion


def test_each_turn_is_scored_in_the_context_the_model_sees_it_in():
  """Qwen 3 drops an earlier turn's reasoning once a later question comes:
  the second reply's prompt is the history as the template renders it
  then, not the first reply as it was learnt."""
  first = msg("assistant", "<think>\nhmm\n</think>\n\nparis.")
  template = template_of("qwen3")
  prompt, completion = chat_templates.split_reply(template, [U1], first)
  assert completion == "<think>\nhmm\n</think>\n\nparis."
  prompt, _ = chat_templates.split_reply(template, [U1, first, U2], A2)
  assert prompt == case("qwen3", "history_thinking_dropped")["rendered"]
  assert "hmm" not in prompt


# --- rows ---------------------------------------------------------------------------


def test_pairs_from_a_prompt_and_replies_or_from_two_conversations(tmp_path):
  vocabulary = vocabulary_of("chat_qwen")
  rejected = msg("assistant", "lyon.")
  rows = [
      # TRL's explicit prompt, replies as lists of one or as the object.
      {"prompt": [U1], "chosen": [A1], "rejected": rejected,
       "gap": 2.0},
      # Two whole conversations (H4's ultrafeedback_binarized; its string
      # prompt is not read).
      {"prompt": U1["content"], "chosen": [U1, A1], "rejected": [U1, rejected],
       "gap": 1.0},
  ]
  source = file_sources.AlignmentFileSource(
      write_rows(tmp_path / "p.jsonl", rows), kind="pairs", layout="messages",
      vocabulary=vocabulary, column_mapping={"margin": "gap"})
  first, second = source.examples()
  assert first["prompt"] == case("qwen2_5", "user_prompt")["rendered"]
  assert (first["chosen"], first["rejected"]) == (A1["content"], "lyon.")
  assert {k: v for k, v in first.items() if k != "margin"} == {
      k: v for k, v in second.items() if k != "margin"}
  assert (first["margin"], second["margin"]) == (2.0, 1.0)


def test_conversations_in_parquet_read_as_in_json_lines(tmp_path):
  # Parquet gives every message of a column the same keys, null where a
  # message has none: a null key is no key (as transformers drops them).
  rows = [{"messages": [U1, A1, U2, A2]},
          {"messages": [msg("user", "hi", name="ann"), A1]}]
  path = tmp_path / "c.parquet"
  pq.write_table(pa.Table.from_pylist(rows), str(path))
  vocabulary = vocabulary_of("chat_qwen")

  def read(path):
    return file_sources.AlignmentFileSource(
        str(path), kind=DEMONSTRATIONS, layout="messages",
        vocabulary=vocabulary).examples()

  assert read(path) == read(write_rows(tmp_path / "c.jsonl", rows))
  pairs = [{"chosen": [U1, A1], "rejected": [msg("user", U1["content"],
                                                 name=None), A2]}]
  pq.write_table(pa.Table.from_pylist(pairs), str(tmp_path / "p.parquet"))
  [pair] = file_sources.AlignmentFileSource(
      str(tmp_path / "p.parquet"), kind="pairs", layout="messages",
      vocabulary=vocabulary).examples()
  assert (pair["chosen"], pair["rejected"]) == (A1["content"], A2["content"])


def test_held_out_conversations_keep_all_their_turns(tmp_path):
  """A later turn's prompt holds the earlier turns: a conversation is held
  out whole, so no trained prompt is a prefix of a held-out one."""
  rows = [{"messages": [msg("user", f"count to {n}."), msg("assistant", "one"),
                        U2, A2]} for n in range(6)]
  source = file_sources.AlignmentFileSource(
      write_rows(tmp_path / "c.jsonl", rows), kind=DEMONSTRATIONS,
      layout="messages", vocabulary=vocabulary_of("chat_qwen"))
  held = file_tasks.HeldOutPrompts(source, {"validation": 2}, seed=0)

  def prompts(split):
    return [ex["prompt"].decode() for ex in held.get_dataset(
        split, shuffle=False).as_numpy_iterator()]

  train, validation = prompts("train"), prompts("validation")
  assert (len(train), len(validation)) == (8, 4)
  assert not any(a.startswith(b) or b.startswith(a)
                 for a in train for b in validation)


def test_bad_conversations_are_reported_with_file_row_and_fix(tmp_path):
  vocabulary = vocabulary_of("chat_qwen")
  rows = [
      {"messages": "hello"},
      {"messages": [U1, {"content": "no role"}]},
      {"messages": [U1]},
      {"chosen": [U1, A1], "rejected": [U2, A1]},
      {"prompt": [U1], "chosen": [A1, A2], "rejected": [A1]},
      {"messages": [U1, A1, U2, A2]},
      {"prompt": [U1], "chosen": [A1], "rejected": [A2]},
      {"messages": [A1, U1, A2]},
  ]
  path = write_rows(tmp_path / "bad.jsonl", rows)
  demos = file_sources.AlignmentFileSource(
      path, kind=DEMONSTRATIONS, layout="messages", vocabulary=vocabulary,
      on_bad_row="skip_and_report")
  # Row 6's two replies and row 8's second.
  assert len(demos.examples()) == 3
  assert [str(b) for b in demos.bad_rows()] == [
      f"{path}: row 1: wrong_type: column 'messages' must be a non-empty "
      "list of messages, objects with a 'role' and a 'content'.",
      f"{path}: row 2: wrong_type: messages[1] is not a message: an object "
      "with a string 'role' (and its 'content').",
      f"{path}: row 3: no_assistant_turn: column 'messages' has no assistant "
      "message to learn from (roles ['user']).",
      f"{path}: row 4: missing_field: no conversation: neither column "
      "'messages' nor both 'prompt' and 'completion'.",
      f"{path}: row 5: missing_field: no conversation: neither column "
      "'messages' nor both 'prompt' and 'completion'.",
      f"{path}: row 7: missing_field: no conversation: neither column "
      "'messages' nor both 'prompt' and 'completion'.",
      f"{path}: row 8: chat_template_error: messages[0]: the chat template "
      f"({TOKENIZER_CONFIG}) refused the conversation: no message to render "
      "(an assistant reply needs a message before it)."]
  pairs = file_sources.AlignmentFileSource(
      path, kind="pairs", layout="messages", vocabulary=vocabulary,
      on_bad_row="skip_and_report")
  assert len(pairs.examples()) == 1  # row 7
  assert pairs.bad_row_counts() == {"missing_field": 5, "prompts_differ": 1,
                                    "wrong_type": 1}
  assert str(pairs.bad_rows()[4]) == (
      f"{path}: row 5: wrong_type: column 'chosen' must hold one assistant "
      "message (the reply), got roles ['assistant', 'assistant'].")
  with pytest.raises(file_sources.BadRowError,
                     match=rf"{path}: row 1: wrong_type: .* Fix the file"):
    file_sources.AlignmentFileSource(
        path, kind=DEMONSTRATIONS, layout="messages",
        vocabulary=vocabulary).examples()


def test_a_template_that_refuses_or_rewrites_history_is_a_bad_row(tmp_path):
  vocabulary = vocabulary_of("chat_qwen")
  rows = [{"messages": [U1, U2, A2]},                        # two users
          {"messages": [msg("system", "be terse."), U1, A1]},
          {"messages": [U1, A1]}]
  path = write_rows(tmp_path / "c.jsonl", rows)

  def read(name):
    source = file_sources.AlignmentFileSource(
        path, kind=DEMONSTRATIONS, layout="messages", vocabulary=vocabulary,
        on_bad_row="skip_and_report", chat_template=template_of(name))
    return source.examples(), [str(b) for b in source.bad_rows()]

  examples, bad = read("gemma3")
  assert len(examples) == 2
  assert bad == [f"{path}: row 1: chat_template_error: messages[2]: the chat "
                 "template (gemma3) refused the conversation: Conversation "
                 "roles must alternate user/assistant/user/assistant/..."]
  # Mistral's v3 template shows the system message only after the last
  # user turn: the reply would be learnt in a context the model never sees.
  examples, bad = read("mistral_v0_3")
  assert [e["completion"] for e in examples] == [
      " " + A1["content"]]
  assert bad[0].startswith(f"{path}: row 1: chat_template_error")
  assert bad[1].startswith(
      f"{path}: row 2: template_not_prefix: messages[2]: the chat template "
      "renders the 2 message(s) before this assistant reply differently "
      "once the reply follows: from character 10 the prompt reads 'be "
      "terse.")


# --- the run's config, batches and one tiny SFT run ----------------------------------


CONVERSATIONS = [
    {"messages": [msg("user", f"count to {n}."),
                  msg("assistant", " ".join(["one", "two", "three", "four",
                                             "five"][:n]))],
     "answer": n} for n in range(1, 6)
] + [{"messages": [U1, A1, U2, A2], "answer": 0}]


def _chat_config(tmp_path, algorithm, name, rows, **overrides):
  config = tiny_config(**{
      "algorithm": algorithm, "data__task": name, "model__arch": "llama",
      "model__size": "tiny", "model__num_encoder_layers": None,
      "data__inputs_length": 96, "data__targets_length": 16,
      "train__batch_size": 4, **overrides})
  config.data.files.train = write_rows(tmp_path / f"{name}.jsonl", rows)
  config.data.files.layout = "messages"
  config.data.files.vocabulary = str(FIXTURES / "tokenizers" / "chat_qwen" /
                                     "tokenizer.json")
  return config


def _batch(name, lengths, converter, size):
  return next(pipeline.BatchIterator(
      name, "train", lengths, converter, global_batch_size=size, seed=0,
      shuffle=False, num_epochs=1))


def test_a_tools_column_is_rendered_as_the_templates_tools(tmp_path):
  """A tool-using conversation with TRL's "tools" column: each example's
  prompt is the template's own rendering with `tools=` (the schemas in
  Qwen 2.5's system message), its completion what follows it there; a
  column that is no list of schemas is a bad row."""
  vocabulary = vocabulary_of("chat_qwen")
  template = chat_templates.for_vocabulary(vocabulary)
  tools = [{"type": "function", "function": {
      "name": "multiply", "description": "Multiplies two integers.",
      "parameters": {"type": "object", "properties": {
          "a": {"type": "integer"}, "b": {"type": "integer"}},
                     "required": ["a", "b"]}}}]
  call = msg("assistant", "", tool_calls=[{"type": "function", "function": {
      "name": "multiply", "arguments": {"a": 12, "b": 34}}}])
  conversation = [msg("user", "What is 12 times 34?"), call,
                  msg("tool", "408"), msg("assistant", "408")]
  rows = [{"messages": conversation, "tools": tools},
          {"messages": conversation, "tools": json.dumps(tools)},
          {"messages": conversation, "tools": "not json"}]
  source = file_sources.AlignmentFileSource(
      write_rows(tmp_path / "t.jsonl", rows), kind=DEMONSTRATIONS,
      layout="messages", vocabulary=vocabulary,
      on_bad_row="skip_and_report")
  examples = source.examples()
  assert len(examples) == 4
  for example, end in zip(examples, [1, 3, 1, 3]):
    prompt = template.render(conversation[:end], add_generation_prompt=True,
                             tools=tools)
    full = template.render(conversation[:end + 1], tools=tools)
    assert example["prompt"] == prompt
    assert full.startswith(prompt + example["completion"])
    assert not full[len(prompt + example["completion"]):].replace(
        template.eos_text, "").strip()
  assert '"name": "multiply"' in examples[0]["prompt"]
  assert "<tool_call>" in examples[0]["completion"]
  assert examples[1]["completion"] == "408"
  assert [str(b) for b in source.bad_rows()] == [
      f"{tmp_path / 't.jsonl'}: row 3: wrong_type: column 'tools' must be a "
      "list of tool JSON schemas (objects), or that list as a JSON string."]


def test_config_gives_online_prompts_and_pairs_batches(tmp_path):
  vocabulary = vocabulary_of("chat_qwen")
  eos = vocabulary.eos_id
  name = "chat_prompts"
  # Besides conversations, prompt-only rows (TRL's {"prompt": [...]}, or a
  # conversation that ends with the user's turn) as GRPO files hold them.
  rows = CONVERSATIONS + [
      {"prompt": [msg("user", "count to 6.")], "answer": 6},
      {"messages": [U1, A1, msg("user", "count to 7.")], "answer": 7}]
  config = _chat_config(tmp_path, "grpo", name, rows)
  config.data.files.column_mapping = "answer=answer"
  file_tasks.register_task_from_files(config, file_tasks.PROMPTS)
  try:
    # Online RL samples after the generation prompt, and its reward
    # functions get the row's other columns.
    prompts = prompts_lib.load_prompts(name, "train", 97)
    assert len(prompts.texts) == 10
    assert all(t.endswith("<|im_start|>assistant\n") for t in prompts.texts)
    assert prompts.columns["answer"] == [1, 2, 3, 4, 5, 0, 0, 6, 7, 7]
    template = template_of("qwen2_5")
    assert prompts.texts[7] == template.render(
        rows[6]["prompt"], add_generation_prompt=True)
    assert prompts.texts[9] == template.render(
        rows[7]["messages"], add_generation_prompt=True)
    # Each prompt carries the conversation it renders (an episode opens
    # with it): the messages before the reply, or the whole prompt.
    conversations = prompts.columns["messages"]
    assert conversations[7] == rows[6]["prompt"]
    assert conversations[8] == [U1] and conversations[9] == rows[7][
        "messages"]
    for text, messages in zip(prompts.texts, conversations):
      assert text == template.render(messages, add_generation_prompt=True)
    for text, tokens in zip(prompts.texts, prompts.tokens):
      assert tokens[tokens != 0].tolist() == vocabulary.encode(text) + [eos]
  finally:
    seqio.TaskRegistry.remove(name)
  name = "chat_pairs"
  rows = [{"prompt": [msg("user", f"count to {n}.")],
           "chosen": [msg("assistant", "one two")],
           "rejected": [msg("assistant", "two")]} for n in (1, 2)]
  config = _chat_config(tmp_path, "dpo", name, rows)
  file_tasks.register_task_from_files(config, "pairs")
  try:
    # The batches DPO trains on: the loss only on each reply and its EOS
    # (<|im_end|>, where sampling stops).
    batch = _batch(name, {"prompt": 97, "chosen": 16, "rejected": 16},
                   alignment_data.feature_converter_for(
                       "pairs", "decoder_only", eos_id=eos), 2)
    for field, reply in (("chosen", "one two"), ("rejected", "two")):
      tokens, weights = batch[f"{field}_tokens"], batch[
          f"{field}_loss_weights"]
      for row in range(2):
        assert tokens[row][weights[row] == 1].tolist() == (
            vocabulary.encode(reply) + [eos])
        real = tokens[row][batch[f"{field}_attention_mask"][row] == 1]
        assert vocabulary.token_text(real[-1]) == "<|im_end|>"
  finally:
    seqio.TaskRegistry.remove(name)
  # The template's fields belong to layout "messages".
  config.data.files.layout = "columns"
  config.data.files.chat_template_kwargs = '{"enable_thinking": false}'
  with pytest.raises(ValueError, match=r"chat_template_kwargs: the chat "
                     r"template renders conversations .* layout 'columns' "
                     r"reads none"):
    file_tasks.register_task_from_files(config, "pairs")


def test_sft_learns_every_assistant_turn_of_chat_data(tmp_path):
  """One tiny Qwen-style run (a tiny llama with the Qwen-style tokenizer
  and template): the batches' loss is on the assistant replies and their
  EOS only, and a few steps lower it."""
  vocabulary = vocabulary_of("chat_qwen")
  config = _chat_config(tmp_path, "sft", "chat_sft", CONVERSATIONS,
                        optimizer__warmup_steps=0)
  mesh = sharding.create_mesh((1, 1), ("data", "model"), jax.devices()[:1])
  rules = sharding.as_rules(config.sharding.logical_axis_rules)
  try:
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      trainer = trainer_of(evaluated_by(from_scratch(algorithms.get("sft"))),
                           config, mesh)
      assert isinstance(trainer.feature_converter,
                        feature_converters.DecoderSFTFeatureConverter)
      batch = next(trainer.train_batches(0))
      replies = {" ".join(["one", "two", "three", "four", "five"][:n])
                 for n in range(1, 6)} | {A1["content"], A2["content"]}
      for tokens, weights in zip(batch["tokens"], batch["loss_weights"]):
        learnt = tokens[weights == 1].tolist()
        assert learnt[-1] == vocabulary.eos_id
        assert vocabulary.decode(learnt[:-1]) in replies
        # Nothing of the prompt (the template's turns) is learnt.
        assert vocabulary.token_text(tokens[weights == 0][0]) == (
            "<|im_start|>")
      state = trainer.init_state()
      losses = []
      for _ in range(4):
        state, metrics = trainer.train_step(
            state, sharding.global_batch(batch, mesh, rules))
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
  finally:
    seqio.TaskRegistry.remove("chat_sft")


PAIRS = [{"prompt": [msg("user", f"count to {n}.")],
          "chosen": [msg("assistant", " ".join(["one", "two", "three"][:n]))],
          "rejected": [msg("assistant", "five")]} for n in (1, 2, 3, 1)]


@pytest.mark.parametrize("algorithm", ["dpo", "grpo"])
def test_dpo_and_grpo_train_a_qwen2_model_on_chat_data(tmp_path, algorithm):
  """A tiny Qwen2 (q/k/v biases) with the Qwen tokenizer and template:
  DPO on chat pairs lowers its loss on a batch; GRPO samples after the
  generation prompt and is rewarded by a function of the decoded reply."""
  online = algorithm == "grpo"
  name = f"chat_{algorithm}"
  extra = dict(rewards__reward_model__weight=0.0,
               rewards__functions="reward_functions:word_count",
               online__samples_per_prompt=2,
               online__max_new_tokens=8) if online else {}
  config = _chat_config(tmp_path, algorithm, name,
                        CONVERSATIONS if online else PAIRS,
                        model__arch="qwen2", optimizer__warmup_steps=0,
                        **extra)
  mesh = sharding.create_mesh((1, 1), ("data", "model"), jax.devices()[:1])
  rules = sharding.as_rules(config.sharding.logical_axis_rules)
  try:
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      trainer = trainer_of(evaluated_by(from_scratch(algorithms.get(
          algorithm))), config, mesh)
      state = trainer.init_state()
      paths = [jax.tree_util.keystr(path) for path, _ in
               jax.tree_util.tree_flatten_with_path(state.params)[0]]
      assert any("query" in p and "bias" in p for p in paths)
      batch = sharding.global_batch(next(trainer.train_batches(0)), mesh,
                                    rules)
      metrics = []
      for _ in range(3):
        state, out = trainer.train_step(state, batch)
        metrics.append(jax.device_get(out))
  finally:
    seqio.TaskRegistry.remove(name)
  losses = [float(m["loss"]) for m in metrics]
  assert np.all(np.isfinite(losses))
  if online:
    # Every reply was decoded and counted: at most max_new_tokens words.
    words = [float(m["reward/word_count"]) for m in metrics]
    assert all(0 < w <= 8 for w in words)
  else:
    assert losses[-1] < losses[0]
