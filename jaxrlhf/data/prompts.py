"""Prompts for online RL: read once, fitted to the length, served in passes.

"N+ implementation details of RLHF with PPO", details 2 and 21: the prompt
split is read once; a prompt longer than `data.inputs_length` loses
trailing paragraphs until it fits (or is an error, per
`online.long_prompts`), keeping a suffix such as "\n\nTL;DR:"
(`online.prompt_suffix`); batches walk
through a fresh permutation of the split on every pass, without
replacement within a pass. (seqio's own shuffle does not do this: it repeats
the split, then shuffles through a 1000-example buffer, so no example comes
more than 1000 places before its file position, and passes mix at their
boundaries: of the first 3,000 examples served from a 3,000-example split,
339 were repeats.)

Host-side reward functions (`jaxrlhf.rewards`) score a completion from its
text, its prompt's text and the prompt's other fields (a reference answer,
unit tests): `Prompts.texts` and `Prompts.columns` hold them per prompt,
aligned with `Prompts.tokens`, so a batch's are looked up by prompt index.
The columns are the task's extra column features
(`alignment_kinds.column_feature`), decoded.
"""

import dataclasses
import functools
from typing import Callable, Dict, List, Optional, Tuple

import jax
import numpy as np

from jaxrlhf.data import alignment_kinds


# What to do with a prompt longer than the limit (`fit_prompt`).
LONG_PROMPT_POLICIES = ("cut_paragraph", "raise")


class PromptTooLongError(ValueError):
  """A prompt does not fit `data.inputs_length`."""


def fit_prompt(text: str, encode: Callable[[str], List[int]], max_tokens: int,
               *, on_long: str = "cut_paragraph", suffix: str = "",
               separator: str = "\n") -> Tuple[List[int], int]:
  """Tokens of `text`, with trailing paragraphs dropped until it fits.

  Detail 2 of "N+ implementation details": a query over the limit is cut at
  its last paragraph break (the last newline) rather than mid-sentence, and
  again until it fits. A `suffix` (the TL;DR query's "\\n\\nTL;DR:") is
  never cut: a long prompt must end with it, and it is put back after each
  cut. Without one, the text is cut at its last newline, whatever follows.

  Args:
    text: the prompt.
    encode: text -> token ids as the task stores them (EOS included if the
      task appends one).
    max_tokens: the limit.
    on_long: "cut_paragraph" or "raise".
    suffix: the ending kept through cuts ("" = none).
    separator: the paragraph break.

  Returns:
    (tokens, number of paragraphs removed).

  Raises:
    PromptTooLongError: on_long is "raise" and the prompt is too long, the
      prompt does not end with `suffix`, or no paragraph break is left to
      cut at.
  """
  tokens, cuts, _ = _fit_prompt(text, encode, max_tokens, on_long=on_long,
                                suffix=suffix, separator=separator)
  return tokens, cuts


def _fit_prompt(text: str, encode: Callable[[str], List[int]],
                max_tokens: int, *, on_long: str, suffix: str,
                separator: str = "\n") -> Tuple[List[int], int, str]:
  """`fit_prompt`, and the text it kept."""
  tokens = encode(text)
  if len(tokens) <= max_tokens:
    return tokens, 0, text
  if on_long == "raise":
    raise PromptTooLongError(f"it has {len(tokens)} tokens, more than "
                             f"{max_tokens}")
  if suffix and not text.endswith(suffix):
    raise PromptTooLongError(
        f"it has {len(tokens)} tokens, more than {max_tokens}, and does not "
        f"end with the suffix {suffix!r} (config.online.prompt_suffix) that "
        "cutting keeps; set the suffix your prompts end with, or ''")
  body = text[:len(text) - len(suffix)]
  cuts = 0
  while len(tokens) > max_tokens:
    cut = body.rfind(separator)
    if cut <= 0:
      raise PromptTooLongError(
          f"it still has {len(tokens)} tokens, more than {max_tokens}, after "
          f"dropping {cuts} trailing paragraph(s), and no paragraph break "
          "is left to cut at")
    body = body[:cut].rstrip()
    cuts += 1
    tokens = encode(body + suffix)
  return tokens, cuts, body + suffix


@dataclasses.dataclass
class Prompts:
  """A split's prompts, fitted and padded, with their texts and columns."""
  tokens: np.ndarray  # [num_prompts, max_tokens] int32, 0-padded
  num_cut: int        # prompts that lost paragraphs
  # [num_prompts] each prompt's text as the policy sees it (after any cut).
  texts: List[str] = dataclasses.field(default_factory=list)
  # Extra column name -> [num_prompts] values, e.g. {"answer": ["72", ...]};
  # {} for a task without extra columns.
  columns: Dict[str, list] = dataclasses.field(default_factory=dict)
  # [num_prompts] each prompt's own completion, the task's targets tokens
  # (EOS included), unpadded; None for a task without targets.
  completions: Optional[List[np.ndarray]] = None

  def padded_completions(self, length: int) -> np.ndarray:
    """[num_prompts, length] the prompts' completions, cut or 0-padded to
    `length`; refused for a task without targets."""
    if self.completions is None:
      raise ValueError(
          "config.data.task has no 'targets' feature, so its prompts have "
          "no completions of their own (GKD's dataset responses, a pairwise "
          "judge's references); give the task targets, or use "
          "algorithm='distill' (samples only) or another judge verdict.")
    out = np.zeros((len(self.completions), length), np.int32)
    for i, row in enumerate(self.completions):
      out[i, :min(len(row), length)] = row[:length]
    return out


def _prompt_feature(task) -> str:
  features = task.output_features
  for name in ("inputs", "prompt"):
    if name in features:
      return name
  raise ValueError(
      f"config.data.task {task.name!r}: online RL reads prompts from an "
      f"'inputs' or 'prompt' feature; the task has {sorted(features)}.")


@functools.lru_cache(maxsize=8)
def _load_prompts(task, split: str, max_tokens: int, on_long: str,
                  suffix: str) -> Prompts:
  # The task object itself is the cache key (not its name or id(): the cache
  # keeps it alive, so a re-registered task is a new key and is re-read).
  # The data stack loads where prompts are first read, not with the config.
  from jaxrlhf.data import pipeline  # pylint: disable=g-import-not-at-top
  return pipeline.traced_as_written(_read_prompts)(task, split, max_tokens,
                                                   on_long, suffix)


def _read_prompts(task, split: str, max_tokens: int, on_long: str,
                  suffix: str) -> Prompts:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  task_name = task.name
  name = _prompt_feature(task)
  feature = task.output_features[name]
  vocabulary = feature.vocabulary
  eos = [vocabulary.eos_id] if feature.add_eos else []
  encode = lambda text: list(vocabulary.encode(text)) + eos
  rows, texts, num_cut = [], [], 0
  text_key = f"{name}_pretokenized"
  ds = task.get_dataset(None, split=split, shuffle=False, num_epochs=1)
  has_text = text_key in ds.element_spec
  # "column:answer" -> "answer": the task's extra columns.
  column_features = {}
  for key in ds.element_spec:
    column = alignment_kinds.column_of_feature(key)
    if column is not None:
      column_features[key] = column
  has_targets = "targets" in ds.element_spec
  ds = ds.map(lambda ex: {"tokens": ex[name], "length": tf.size(ex[name]),
                          "text": ex[text_key] if has_text else "",
                          **({"targets": ex["targets"],
                              "targets_length": tf.size(ex["targets"])}
                             if has_targets else {}),
                          **{f: ex[f] for f in column_features}})
  columns = {column: [] for column in column_features.values()}
  completions = [] if has_targets else None
  # Batched reading: per-example iteration costs more than the rest.
  for batch in ds.padded_batch(1024).as_numpy_iterator():
    for i, (tokens, length, text) in enumerate(zip(
        batch["tokens"], batch["length"], batch["text"])):
      tokens = tokens[:length]
      if has_targets:
        completions.append(np.asarray(
            batch["targets"][i][:batch["targets_length"][i]], np.int32))
      for feature, column in column_features.items():
        columns[column].append(
            alignment_kinds.decode_column_value(batch[feature][i]))
      if has_text:
        text = text.decode()
      else:  # A task that keeps no text: its tokens say it.
        text = vocabulary.decode(
            [t for t in tokens.tolist() if t != vocabulary.eos_id])
      index = len(rows)
      if len(tokens) > max_tokens:
        try:
          tokens, cuts, text = _fit_prompt(text, encode, max_tokens,
                                           on_long=on_long, suffix=suffix)
        except PromptTooLongError as e:
          fixes = ("shorten or drop that row, or raise config.data."
                   "inputs_length" if on_long == "cut_paragraph" else
                   "set config.online.long_prompts='cut_paragraph' to drop "
                   "trailing paragraphs (detail 2), or raise "
                   "config.data.inputs_length")
          raise PromptTooLongError(
              f"config.data.task {task_name!r}, split {split!r}, row {index} "
              f"({text[:60]!r}...): {e} (config.data.inputs_length). "
              f"To fix: {fixes}.") from None
        num_cut += cuts > 0
      rows.append(np.asarray(tokens, np.int32))
      texts.append(text)
  if not rows:
    raise ValueError(f"config.data.task {task_name!r} has no prompts in split "
                     f"{split!r}.")
  padded = np.zeros((len(rows), max_tokens), np.int32)
  for i, row in enumerate(rows):
    padded[i, :len(row)] = row
  return Prompts(padded, num_cut, texts, columns, completions)


def load_prompts(task_name: str, split: str, max_tokens: int, *,
                 on_long: str = "cut_paragraph", suffix: str = "") -> Prompts:
  """The prompts of a split of a registered task, fitted to `max_tokens`
  (`fit_prompt`), with their texts and extra columns; read once per
  process and task object."""
  from jaxrlhf.data import pipeline  # pylint: disable=g-import-not-at-top
  return _load_prompts(pipeline.get_task(task_name), split, max_tokens,
                       on_long, suffix)


# The features of an online batch: the prompts [batch, prompt length],
# right-padded, with T5's name (`jaxrlhf.rl.rollout` left-pads them for a
# decoder-only policy inside the step), and each prompt's index in the
# split's `Prompts`, where the host finds its text and columns.
PROMPT_FEATURE = "encoder_input_tokens"
PROMPT_INDEX = "prompt_index"
# The prompts' own completions [batch, max_new_tokens] (the task's targets,
# `Prompts.completions`), in the batches of a run that reads them (GKD's
# dataset responses, a pairwise judge's reference).
COMPLETIONS = "completion_tokens"


def prompt_batch_spec(global_batch_size: int, length: int):
  """{feature: jax.ShapeDtypeStruct} of a global batch of prompts."""
  return {PROMPT_FEATURE: jax.ShapeDtypeStruct((global_batch_size, length),
                                               np.int32),
          PROMPT_INDEX: jax.ShapeDtypeStruct((global_batch_size,), np.int32)}


class PromptBatches:
  """This process's share of consecutive global batches of prompts.

  The prompts are served as one stream: pass e is the permutation of the
  split drawn from (seed, e), and batch b is stream entries [b * B, (b + 1)
  * B) (detail 21: sample without replacement, reshuffle once the split is
  used up). The position is the number of batches served, so a resumed run
  continues with exactly the next batch.
  """

  def __init__(self, prompts: np.ndarray, global_batch_size: int, seed: int,
               position: int = 0):
    self.prompts = prompts
    self.global_batch_size = global_batch_size
    from jaxrlhf.data import pipeline  # pylint: disable=g-import-not-at-top
    self.local_batch_size = pipeline.local_batch_size(global_batch_size)
    self.seed = seed
    self.position = position
    self._permutations: Dict[int, np.ndarray] = {}

  def _permutation(self, epoch: int) -> np.ndarray:
    if epoch not in self._permutations:
      if len(self._permutations) > 4:
        self._permutations.pop(min(self._permutations))
      rng = np.random.default_rng([self.seed, epoch])
      self._permutations[epoch] = rng.permutation(len(self.prompts))
    return self._permutations[epoch]

  def global_indices(self, position: int) -> np.ndarray:
    """Prompt indices of global batch `position`."""
    n = len(self.prompts)
    stream = np.arange(position * self.global_batch_size,
                       (position + 1) * self.global_batch_size)
    return np.array([self._permutation(int(s // n))[s % n] for s in stream])

  def __iter__(self):
    return self

  def batch_at(self, position: int) -> Dict[str, np.ndarray]:
    """This process's share of global batch `position`; the stream does not
    move (an overlapped step samples the next batch ahead)."""
    indices = self.global_indices(position)
    start = jax.process_index() * self.local_batch_size
    local = indices[start:start + self.local_batch_size]
    return {PROMPT_FEATURE: self.prompts[local],
            PROMPT_INDEX: local.astype(np.int32)}

  def __next__(self) -> Dict[str, np.ndarray]:
    batch = self.batch_at(self.position)
    self.position += 1
    return batch


class WithColumn:
  """A prompt stream whose batches also carry `column[prompt_index]` as
  feature `name` (GKD's dataset completions); it moves as its stream
  does."""

  def __init__(self, stream: PromptBatches, name: str, column: np.ndarray):
    self.stream, self.name, self.column = stream, name, column

  @property
  def position(self) -> int:
    return self.stream.position

  def batch_at(self, position: int) -> Dict[str, np.ndarray]:
    return self._with_column(self.stream.batch_at(position))

  def _with_column(self, batch):
    return dict(batch, **{self.name: self.column[batch[PROMPT_INDEX]]})

  def __iter__(self):
    return self

  def __next__(self) -> Dict[str, np.ndarray]:
    return self._with_column(next(self.stream))


def held_out_prompts(task_name: str, split: str, max_tokens: int,
                     num_prompts: int, field: str = "config.eval.split"
                     ) -> Tuple[np.ndarray, List[str]]:
  """This process's share of the first `num_prompts` distinct prompts of a
  split, in file order, for evaluation: a task of an alignment kind holds a
  prompt once per completion (four rows per UltraFeedback prompt), and a
  policy is judged once per prompt.

  Every process reads the whole split (held-out splits are small), so the
  distinct prompts are the same everywhere; process p takes the p-th of
  `process_count` consecutive blocks.

  Returns:
    (tokens [n, max_tokens] int32: each prompt as the task stores it (EOS
    appended), right-padded with 0; their texts).
  """
  # The data stack loads where prompts are first read, not with the config.
  from jaxrlhf.data import pipeline  # pylint: disable=g-import-not-at-top
  return pipeline.traced_as_written(_read_held_out_prompts)(
      pipeline.get_task(task_name), split, max_tokens, num_prompts, field)


def _read_held_out_prompts(task, split, max_tokens, num_prompts, field):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  task_name = task.name
  name = _prompt_feature(task)
  text_key = f"{name}_pretokenized"
  try:
    ds = task.get_dataset(None, split=split, shuffle=False, num_epochs=1)
  except (ValueError, KeyError) as e:
    raise ValueError(f"{field}: task {task_name!r} has no split {split!r} "
                     f"to evaluate on ({e}).") from None
  ds = ds.map(lambda ex: {"tokens": ex[name], "length": tf.size(ex[name]),
                          "text": ex[text_key]})
  seen, rows, texts = set(), [], []
  for batch in ds.padded_batch(1024).as_numpy_iterator():
    for tokens, length, text in zip(batch["tokens"], batch["length"],
                                    batch["text"]):
      text = text.decode()
      if text in seen:
        continue
      if length > max_tokens:
        raise PromptTooLongError(
            f"{field}: a prompt of task {task_name!r}, split {split!r}, has "
            f"{length} tokens, more than config.data.inputs_length "
            f"({max_tokens}): {text[:60]!r}...")
      seen.add(text)
      rows.append(tokens[:length])
      texts.append(text)
      if len(rows) == num_prompts:
        break
    if len(rows) == num_prompts:
      break
  if not rows:
    raise ValueError(f"{field}: split {split!r} of task {task_name!r} has "
                     "no prompts.")
  share = len(rows) // jax.process_count()
  start = jax.process_index() * share
  padded = np.zeros((share, max_tokens), np.int32)
  for i, row in enumerate(rows[start:start + share]):
    padded[i, :len(row)] = row
  return padded, texts[start:start + share]
