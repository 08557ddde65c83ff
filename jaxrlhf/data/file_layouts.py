"""Row layouts of public alignment datasets, and a generic column layout.

A layout turns one row (a dict read from JSON lines or Parquet) into zero or
more raw examples of a data kind, or into `BadRow`s saying why it cannot.
`row_checks.check_example` then checks each example.

Layouts (what a row looks like). The layouts of demonstrations also give
the prompts kind (online RL's prompts): their examples without the
completion, which rows of "columns" and "messages" then need not have.

* "columns" (any kind, demonstrations too): a flat row; `column_mapping` maps each field of the
  kind to a column, e.g. {"prompt": "question", "chosen": "good",
  "rejected": "bad", "margin": "score_gap"}. Unmapped fields use their own
  name; a dotted column ("info.post") reads a nested object. For rankings the
  `completions` column is a list of strings, best first. Scalars missing from
  a row take the kind's default (`margin` 0, `confidence` 1,
  `annotation_batch` -1, `prompt_weight` 1, which the source then replaces by
  per-prompt weights unless told not to); `reward` and `label` are required;
  a label is true/false or 1/0. For demonstrations, any other name in the
  mapping is an extra column carried to the reward functions of online RL
  (`alignment_kinds`): {"prompt": "question", "completion": "solution",
  "answer": "final_answer"} gives every prompt an `answer`, read from the
  file's "final_answer" (a row without it is a bad row).
* "ultrafeedback" (trajectory, pairs, ranking): openbmb/UltraFeedback rows,
  {"instruction": str, "completions": [{"response": str, "overall_score":
  float, "fine-grained_score": float, "annotations": {aspect: {"Rating": "4",
  ...} or [{"Rating": ...}]}, ...}, ...]} (assumed from the dataset card's
  "Dataset Format" and the Hub rows: ratings are strings, "N/A" when the
  annotator gave none; `overall_score` is the critique score, 1-10, as fixed
  in the Dec 2023 revision; `fine-grained_score` the mean aspect rating,
  1-5). The prompt is the instruction
  alone (not the per-completion `custom_system_prompt` the responses were
  sampled with). A completion's score is `overall_score` (option
  `score="overall"`, the default) or `fine-grained_score`, falling back to
  the mean of the numeric aspect Ratings ("N/A" skipped) when that field is
  absent (`score="fine_grained"`). Kind trajectory: one example per
  completion, reward = score, normalised to mean 0 / variance 1 over the
  split by default as the DRO paper (section 4) does. Kind pairs: the
  best-scored completion (random among ties) against a random strictly worse
  one, margin = score difference (the ultrafeedback_binarized recipe); a row
  whose completions all score the same gives no pair and is reported as
  `no_worse_completion`. Kind ranking: completions sorted best first (stable
  among ties). A completion with an empty response or an unusable score is
  reported and left out; the row's other completions are kept.
* "hh_rlhf" (pairs): Anthropic HH-RLHF rows {"chosen": dialogue, "rejected":
  dialogue}, dialogues "\\n\\nHuman: ...\\n\\nAssistant: ...". The prompt is
  the dialogue up to and including the last "\\n\\nAssistant:", shared by
  both; the completions are the final assistant turns (with their leading
  space). Rows whose two prompts differ are reported as `prompts_differ`.
* "tldr" (pairs): OpenAI summarize_from_feedback comparison rows {"info":
  {"post", "title", "subreddit", ...}, "summaries": [{"text": ...}, {...}],
  "choice": 0 or 1, "extra": {"confidence": 1-9, optional}}. The prompt is
  "SUBREDDIT: r/{subreddit}\\n\\nTITLE: {title}\\n\\nPOST: {post}\\n\\nTL;DR:"
  ("N+ implementation details of RLHF with PPO", detail 2: no trailing
  space); a summary gets a leading space if it has none (detail 3). When
  the prompt exceeds `max_prompt_tokens` the post loses its last paragraph
  (from its last newline) until it fits (detail 2; option
  `truncate_post_paragraphs`, default True). confidence = extra.confidence /
  `confidence_scale` (default 9, the top of the raters' scale), 1 when
  absent. Rows without a post (the CNN/DM articles of the validation split)
  are reported as `missing_field`. The comparison's annotation batch
  ("batch": "batch6", ...) becomes `annotation_batch` = 6 (detail 16
  reports accuracy per batch); other batch names leave it unset (-1).
* "tldr_sft" (demonstrations): the TL;DR SFT rows (the filtered Reddit
  TL;DR of Stiennon et al. 2020), {"subreddit", "title", "post", "summary"}
  (a nested "info" object with the first three is read too). The prompt is
  the TL;DR query as above, with the same paragraph truncation (detail 2);
  the completion is the summary with a leading space (detail 3; the task
  appends the EOS).
* "gsm8k" (demonstrations): GSM8K rows {"question", "answer"}, the answer
  a worked solution ending in "#### <number>". The prompt is the question,
  the completion the whole answer as it is (calculator annotations
  "<<48/2=24>>" included), so SFT can train on it; the extra column
  `answer` is the number after the last "####", thousands separators
  dropped ("#### 1,200" -> "1200"). A row without one is reported as
  `no_final_answer`.
* "math" (demonstrations): MATH rows {"problem", "solution", "level",
  "type"}. The prompt is the problem, the completion the solution; the
  extra column `answer` is the content of the solution's last \\boxed{...}
  (nested braces kept: "\\frac{1}{2}"), and `level` and `type` are carried
  as they are (None where a row has none). A solution without a \\boxed{}
  answer is reported as `no_final_answer`.
* "messages" (demonstrations, pairs): conversations, lists of {"role",
  "content"} messages, rendered with the checkpoint's own chat template
  (`chat_templates`; the source's `chat_template`). A prompt is the
  conversation before an assistant reply rendered with the generation
  prompt (what the policy reads before it speaks); its completion is the
  reply as the template renders it, ending with the template's end-of-turn
  token, which is the task's EOS when it is the vocabulary's EOS
  (`chat_templates.ChatTemplate.reply_text`). Demonstrations: {"messages":
  [...]} (the TRL / H4 conversational layout) gives one example per
  assistant message (option `turns="all"`, the default; "last" keeps the
  last one), each with the conversation before it as the prompt, so SFT's
  loss is on every assistant turn and nowhere else; {"prompt": [...],
  "completion": [assistant message]} (TRL's prompt-completion layout)
  gives one. A demonstration row's "tools" column (TRL's: a list of the
  tools' JSON schemas, or that list as a JSON string) is the template's
  `tools=`, so the model learns from the prompt with the tools shown as the
  episodes of online RL show them (`online.tools`). Prompts (online RL): the
  conversation before each assistant
  message and, when it does not end with one, the whole conversation, each
  rendered with the generation prompt; TRL's prompt-only {"prompt": [...]}
  gives one. Demonstrations and prompts carry the conversation they render
  as the extra column `messages` (`alignment_kinds.CONVERSATION_COLUMN`):
  a multi-turn episode opens with those messages, and reward functions get
  them as `messages=`. Pairs: {"prompt": [...], "chosen": [assistant message],
  "rejected": [assistant message]} (TRL's explicit-prompt preference
  layout), or {"chosen": [...conversation], "rejected": [...conversation]}
  (HuggingFaceH4/ultrafeedback_binarized, Anthropic HH as messages), two
  conversations that must agree up to their last message, an assistant
  reply in both (`prompts_differ` otherwise); a string "prompt" beside
  them (H4's) is not read. A reply message may also be given as the object
  itself rather than a list of one. `column_mapping` may rename the
  columns ("messages=conversation") and, for demonstrations, name extra
  columns, as for "columns"; mapped scalar columns of pairs (margin, ...)
  are read too. Bad rows: `no_assistant_turn` (nothing to learn from),
  `chat_template_error` (the template refused the conversation, e.g.
  Gemma's "roles must alternate"), `template_not_prefix` (the template
  renders the history differently once the reply follows:
  `chat_templates.split_reply`); a conversation with several replies keeps
  its good ones.
"""

import dataclasses
import math
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Union

import numpy as np

from jaxrlhf.data import alignment_kinds as kinds_lib
from jaxrlhf.data import chat_layouts
from jaxrlhf.data import layout_rows
from jaxrlhf.data import names
from jaxrlhf.data import row_checks
from jaxrlhf import answers

BadRow = row_checks.BadRow
as_number = row_checks.as_number
RowContext = layout_rows.RowContext
RowResult = layout_rows.RowResult


def _columns_layout(record, ctx: RowContext) -> RowResult:
  example = {}
  for field in ctx.kind.fields:
    column = ctx.column_mapping.get(field, field)
    value = layout_rows.get_path(record, column)
    if value is None:
      if field in ctx.kind.scalar_fields:
        continue  # Validation fills the default or reports a required one.
      yield BadRow("missing_field", f"column {column!r} (field {field!r}) is "
                   "missing or null.")
      return
    example[field] = value
  for field in ctx.kind.scalar_fields:
    column = ctx.column_mapping.get(field, field)
    if field not in example and ctx.kind.scalar_defaults[field] is None:
      yield BadRow("missing_field", f"column {column!r} (field {field!r}) is "
                   "missing or null.")
      return
  if ctx.extra_columns:
    extras = layout_rows.extra_values(record, ctx)
    if isinstance(extras, BadRow):
      yield extras
      return
    example[layout_rows.EXTRA_COLUMNS] = extras
  yield example


def _ultrafeedback_aspect_mean(annotations, what: str) -> Union[float, BadRow]:
  if not isinstance(annotations, Mapping) or not annotations:
    return BadRow("missing_field", f"{what}: no fine-grained_score and no "
                  "annotations to average.")
  ratings = []
  for aspect in annotations.values():
    entries = aspect if isinstance(aspect, list) else [aspect]
    for entry in entries:
      rating = entry.get("Rating") if isinstance(entry, Mapping) else None
      try:
        rating = float(rating)
      except (TypeError, ValueError):
        continue  # "N/A" and absent ratings do not count.
      if math.isfinite(rating):
        ratings.append(rating)
  if not ratings:
    return BadRow("non_finite_reward", f"{what}: no numeric aspect Rating to "
                  "average.")
  return sum(ratings) / len(ratings)


def _ultrafeedback_score(completion: Mapping[str, Any], index: int,
                         score: str) -> Union[float, BadRow]:
  if score == "overall":
    return as_number(completion.get("overall_score"),
                      f"completions[{index}].overall_score")
  value = completion.get("fine-grained_score")
  if value is None:
    return _ultrafeedback_aspect_mean(completion.get("annotations"),
                                      f"completions[{index}]")
  return as_number(value, f"completions[{index}].fine-grained_score")


def _ultrafeedback_layout(record, ctx: RowContext) -> RowResult:
  score_kind = ctx.options["score"]
  instruction = record.get("instruction")
  completions = record.get("completions")
  if instruction is None:
    yield BadRow("missing_field", "'instruction' is missing or null.")
    return
  if not isinstance(completions, list):
    yield BadRow("missing_field", "'completions' is missing or not a list.")
    return
  scored = []  # (score, response) of the usable completions, in file order.
  for i, completion in enumerate(completions):
    if not isinstance(completion, Mapping):
      yield BadRow("wrong_type", f"completions[{i}] is not an object.")
      continue
    response = completion.get("response")
    if response is None:
      yield BadRow("missing_field", f"completions[{i}].response is missing.")
      continue
    if not isinstance(response, str):
      yield BadRow("wrong_type", f"completions[{i}].response is not a string.")
      continue
    if not response.strip():
      yield BadRow("empty_completion", f"completions[{i}].response is empty.")
      continue
    value = _ultrafeedback_score(completion, i, score_kind)
    if isinstance(value, BadRow):
      yield value
      continue
    scored.append((value, response))
  kind = ctx.kind.name
  if kind == "trajectory":
    for value, response in scored:
      yield {"prompt": instruction, "completion": response, "reward": value}
  elif kind == "ranking":
    order = sorted(range(len(scored)), key=lambda j: -scored[j][0])
    yield {"prompt": instruction, "completions": [scored[j][1] for j in order]}
  elif kind == "pairs":
    if len(scored) < 2:
      yield BadRow("too_few_completions", f"{len(scored)} usable "
                   "completion(s); a pair needs 2.")
      return
    scores = np.array([s for s, _ in scored])
    best = np.flatnonzero(scores == scores.max())
    worse = np.flatnonzero(scores < scores.max())
    if not worse.size:
      yield BadRow("no_worse_completion", f"all {len(scored)} completions "
                   f"score {scores.max():g}; no pair has a preference.")
      return
    chosen = int(ctx.rng.choice(best))
    rejected = int(ctx.rng.choice(worse))
    yield {"prompt": instruction, "chosen": scored[chosen][1],
           "rejected": scored[rejected][1],
           "margin": float(scores[chosen] - scores[rejected])}


HH_ASSISTANT = "\n\nAssistant:"


def split_hh_dialogue(dialogue: str) -> Optional[Tuple[str, str]]:
  """(prompt up to and including the last "\\n\\nAssistant:", final turn)."""
  cut = dialogue.rfind(HH_ASSISTANT)
  if cut < 0:
    return None
  cut += len(HH_ASSISTANT)
  return dialogue[:cut], dialogue[cut:]


def _hh_layout(record, ctx: RowContext) -> RowResult:
  del ctx
  parts = {}
  for field in ("chosen", "rejected"):
    dialogue = record.get(field)
    if dialogue is None:
      yield BadRow("missing_field", f"{field!r} is missing or null.")
      return
    if not isinstance(dialogue, str):
      yield BadRow("wrong_type", f"{field!r} is not a string.")
      return
    split = split_hh_dialogue(dialogue)
    if split is None:
      yield BadRow("unparsable_dialogue", f"{field!r} has no "
                   f"{HH_ASSISTANT!r} turn.")
      return
    parts[field] = split
  if parts["chosen"][0] != parts["rejected"][0]:
    yield BadRow("prompts_differ", "the chosen and rejected dialogues differ "
                 "before their last assistant turn.")
    return
  yield {"prompt": parts["chosen"][0], "chosen": parts["chosen"][1],
         "rejected": parts["rejected"][1]}


def format_tldr_prompt(subreddit: str, title: str, post: str) -> str:
  """The TL;DR query ("N+ implementation details", detail 2)."""
  return (f"SUBREDDIT: r/{subreddit}\n\nTITLE: {title}\n\nPOST: {post}"
          + names.TLDR_QUERY_SUFFIX)


def _tldr_query(source: Mapping[str, Any], ctx: RowContext,
                where: str = "") -> Union[str, BadRow]:
  """The TL;DR query of a row's subreddit, title and post, fitted to
  `ctx.max_prompt_tokens` by dropping the post's last paragraphs (detail 2).
  The query always ends in "TL;DR:": only the post is cut."""
  fields = {}
  for name in ("subreddit", "title", "post"):
    value = source.get(name)
    if value is None:
      return BadRow("missing_field", f"{where}{name} is missing or null.")
    if not isinstance(value, str):
      return BadRow("wrong_type", f"{where}{name} is not a string.")
    fields[name] = value
  post = fields["post"]
  prompt = format_tldr_prompt(fields["subreddit"], fields["title"], post)
  if (ctx.options["truncate_post_paragraphs"] and ctx.max_prompt_tokens
      and ctx.prompt_tokens is not None):
    # Detail 2: drop the post's last paragraph rather than cut a sentence.
    while (ctx.prompt_tokens(prompt) > ctx.max_prompt_tokens
           and "\n" in post):
      post = post[:post.rfind("\n")].rstrip()
      prompt = format_tldr_prompt(fields["subreddit"], fields["title"], post)
  return prompt


def _with_leading_space(text: str) -> str:
  """Detail 3: a space between "TL;DR:" and the summary."""
  return text if text[:1].isspace() else " " + text


def _annotation_batch(name) -> Optional[float]:
  """6.0 for "batch6"; None for any other name (CNN/DM's "cnndm0", ...)."""
  if isinstance(name, str) and name.startswith("batch") and (
      name[len("batch"):].isdigit()):
    return float(name[len("batch"):])
  return None


def _tldr_layout(record, ctx: RowContext) -> RowResult:
  info = record.get("info")
  if not isinstance(info, Mapping):
    yield BadRow("missing_field", "'info' is missing or not an object.")
    return
  prompt = _tldr_query(info, ctx, where="info.")
  if isinstance(prompt, BadRow):
    yield prompt
    return
  summaries = record.get("summaries")
  if not isinstance(summaries, list) or len(summaries) != 2:
    yield BadRow("missing_field", "'summaries' must be a list of 2 objects.")
    return
  texts = []
  for i, summary in enumerate(summaries):
    text = summary.get("text") if isinstance(summary, Mapping) else None
    if not isinstance(text, str):
      yield BadRow("missing_field", f"summaries[{i}].text is missing.")
      return
    texts.append(_with_leading_space(text))
  choice = record.get("choice")
  if isinstance(choice, bool) or choice not in (0, 1):
    yield BadRow("bad_label", f"'choice' must be 0 or 1, got {choice!r}.")
    return
  example = {"prompt": prompt, "chosen": texts[choice],
             "rejected": texts[1 - choice]}
  extra = record.get("extra")
  confidence = extra.get("confidence") if isinstance(extra, Mapping) else None
  if confidence is not None:
    value = as_number(confidence, "extra.confidence")
    if isinstance(value, BadRow):
      yield value
      return
    example["confidence"] = value / ctx.options["confidence_scale"]
  batch = _annotation_batch(record.get("batch"))
  if batch is not None:
    example["annotation_batch"] = batch
  yield example


def _tldr_sft_layout(record, ctx: RowContext) -> RowResult:
  source = record.get("info") if isinstance(record.get("info"),
                                            Mapping) else record
  prompt = _tldr_query(source, ctx)
  if isinstance(prompt, BadRow):
    yield prompt
    return
  summary = record.get("summary")
  if summary is None:
    yield BadRow("missing_field", "summary is missing or null.")
    return
  if not isinstance(summary, str):
    yield BadRow("wrong_type", "summary is not a string.")
    return
  if not summary.strip():
    yield BadRow("empty_completion", "summary is empty.")
    return
  yield {"prompt": prompt, "completion": _with_leading_space(summary)}


def _text_fields(record, names) -> Union[Tuple[str, ...], BadRow]:
  """The row's string fields `names`, or why they cannot be read."""
  values = []
  for name in names:
    value = record.get(name)
    if value is None:
      return BadRow("missing_field", f"{name!r} is missing or null.")
    if not isinstance(value, str):
      return BadRow("wrong_type", f"{name!r} must be a string, got "
                    f"{type(value).__name__}.")
    values.append(value)
  return tuple(values)


def _worked_answer(record, fields, final_answer, missing: str,
                   columns=()) -> RowResult:
  """A problem and its worked solution (the text `fields`) as prompt and
  completion, with the solution's final answer (`final_answer(solution)`,
  None: the row is bad, `missing` says why) and `columns` of the record
  as extra columns."""
  texts = _text_fields(record, fields)
  if isinstance(texts, BadRow):
    yield texts
    return
  problem, solution = texts
  final = final_answer(solution)
  if final is None:
    yield BadRow("no_final_answer", missing)
    return
  yield {"prompt": problem, "completion": solution,
         layout_rows.EXTRA_COLUMNS: {"answer": final,
                         **{name: record.get(name) for name in columns}}}


def _gsm8k_layout(record, ctx: RowContext) -> RowResult:
  del ctx
  yield from _worked_answer(
      record, ("question", "answer"), answers.gsm8k_answer,
      "'answer' has no final answer '#### <number>'.")


def _math_layout(record, ctx: RowContext) -> RowResult:
  del ctx
  yield from _worked_answer(
      record, ("problem", "solution"), answers.last_boxed,
      "'solution' has no \\boxed{...} final answer.", ("level", "type"))


# --- conversations (layout "messages") -----------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
  name: str
  parse: Callable[[Mapping[str, Any], RowContext], RowResult]
  kinds: Tuple[str, ...]
  option_defaults: Mapping[str, Any]
  # Normalise rewards unless told otherwise (DRO paper on UltraFeedback).
  normalizes_rewards: bool = False
  # The extra columns every example of the layout carries (a row's value
  # may be None); layout "columns" adds those its column mapping names.
  extra_columns: Tuple[str, ...] = ()
  # Whether a column mapping may rename the columns it reads: the kind's
  # fields and these names of its own (extra columns too, for
  # demonstrations).
  maps_columns: bool = False
  own_columns: Tuple[str, ...] = ()
  # Whether rows are conversations rendered with a chat template.
  uses_chat_template: bool = False


# Demonstrations, and the prompts online RL reads from the same rows.
_DEMONSTRATIONS = kinds_lib.WITH_EXTRA_COLUMNS

LAYOUTS: Dict[str, Layout] = {
    layout.name: layout for layout in (
        Layout("columns", _columns_layout,
               tuple(kinds_lib.KINDS) + _DEMONSTRATIONS, {},
               maps_columns=True),
        Layout("ultrafeedback", _ultrafeedback_layout,
               ("trajectory", "pairs", "ranking"), {"score": "overall"},
               normalizes_rewards=True),
        Layout("hh_rlhf", _hh_layout, ("pairs",), {}),
        Layout("tldr", _tldr_layout, ("pairs",),
               {"truncate_post_paragraphs": True, "confidence_scale": 9.0}),
        Layout("tldr_sft", _tldr_sft_layout, _DEMONSTRATIONS,
               {"truncate_post_paragraphs": True}),
        Layout("gsm8k", _gsm8k_layout, _DEMONSTRATIONS, {},
               extra_columns=("answer",)),
        Layout("math", _math_layout, _DEMONSTRATIONS, {},
               extra_columns=("answer", "level", "type")),
        Layout("messages", chat_layouts.messages_layout,
               _DEMONSTRATIONS + (kinds_lib.PAIRS.name,),
               {"turns": "all"},
               extra_columns=(kinds_lib.CONVERSATION_COLUMN,),
               maps_columns=True,
               own_columns=(kinds_lib.CONVERSATION_COLUMN, "tools"),
               uses_chat_template=True),
    )}


# The layouts that give demonstrations (prompt and reference completion).
DEMONSTRATION_LAYOUTS = tuple(
    name for name, layout in LAYOUTS.items()
    if kinds_lib.DEMONSTRATIONS.name in layout.kinds)


def check_layout_options(layout: Layout, options: Mapping[str, Any]):
  unknown = set(options) - set(layout.option_defaults)
  if unknown:
    raise ValueError(
        f"layout_options: {sorted(unknown)} not understood by layout "
        f"{layout.name!r}; its options are {sorted(layout.option_defaults)}.")
  merged = {**layout.option_defaults, **options}
  if layout.name == "ultrafeedback" and merged["score"] not in (
      "overall", "fine_grained"):
    raise ValueError("layout_options['score'] must be 'overall' or "
                     f"'fine_grained', got {merged['score']!r}.")
  if layout.name == "tldr" and not merged["confidence_scale"] > 0:
    raise ValueError("layout_options['confidence_scale'] must be > 0.")
  if layout.name == "messages" and merged["turns"] not in ("all", "last"):
    raise ValueError("layout_options['turns'] must be 'all' (every assistant "
                     "message is a completion) or 'last', got "
                     f"{merged['turns']!r}.")
  return merged
