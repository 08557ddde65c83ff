"""Tasks registered from files at start-up (`config.data.files`).

What a run reads decides the kind its files are read as: the offline
losses read an alignment kind (pairs, ranking, trajectory, thumbs:
`alignment_data.register_file_task`); SFT and the prompts of online RL read
demonstrations, a prompt and its reference completion (the TL;DR SFT data,
layout "tldr_sft"), which become a seqio task with `inputs` and `targets`
like any SFT task (`register_demonstrations_task`). Either way the files'
vocabulary is `data.files.vocabulary`: a SentencePiece model or a Hugging
Face `tokenizer.json` (`vocab.from_file`). Conversations (layout
"messages") are rendered with that tokenizer's chat template, or the Jinja
file `data.files.chat_template` (`files_chat_template`).

Splits: `data.files.train` is "train", `data.files.validation` is
"validation" and `data.files.test` is "test". A dataset with no held-out
files (UltraFeedback has only a train split) can hold prompts out of its
training files instead (`data.files.holdout_validation_prompts`,
`holdout_test_prompts`; `HeldOutPrompts`): every row of a held-out prompt
goes to that split, so no prompt is both trained and evaluated on.
"""

import functools
import hashlib
from typing import Dict, Mapping, Optional

import numpy as np
import seqio
import tensorflow as tf

from jaxrlhf.data import alignment_data
from jaxrlhf.data import alignment_kinds
from jaxrlhf.data import chat_templates
from jaxrlhf.data import file_sources
from jaxrlhf.data import tasks
from jaxrlhf.data import vocab
from jaxrlhf.models import registry

DEMONSTRATIONS = alignment_kinds.DEMONSTRATIONS.name
PROMPTS = alignment_kinds.PROMPTS.name
# The held-out splits a source may carve out of "train", in the order their
# prompts are drawn (test first: it stays the same when validation grows).
HOLDOUT_SPLITS = ("test", "validation")


def files_vocabulary(config) -> seqio.Vocabulary:
  """The vocabulary of config.data.files: its `vocabulary` file, or the
  built-in synthetic task's."""
  path = config.data.files.vocabulary
  return vocab.from_file(path) if path else tasks.synthetic_vocabulary()


def files_chat_template(config, vocabulary: seqio.Vocabulary
                        ) -> Optional[chat_templates.ChatTemplate]:
  """The chat template config.data.files' conversations are rendered with
  (layout "messages"): `chat_template`'s file or the vocabulary's own, with
  the variables of `chat_template_kwargs`; None for other layouts."""
  files = config.data.files
  layout = file_sources.LAYOUTS.get(files.layout)
  if layout is None or not layout.uses_chat_template:
    if files.chat_template or files.chat_template_kwargs:
      raise ValueError(
          "config.data.files.chat_template / chat_template_kwargs: the "
          f"chat template renders conversations (layout 'messages'); layout "
          f"{files.layout!r} reads none.")
    return None
  return chat_templates.for_vocabulary(
      vocabulary, files.chat_template,
      chat_templates.parse_variables(files.chat_template_kwargs))


def parse_column_mapping(text: str) -> Optional[Dict[str, str]]:
  """"prompt=question,reward=score" -> {"prompt": "question", ...}."""
  if not text:
    return None
  mapping = {}
  for item in text.split(","):
    field, sep, column = item.partition("=")
    if not sep or not field.strip() or not column.strip():
      raise ValueError(f"config.data.files.column_mapping: {item!r} is not "
                       "field=column.")
    mapping[field.strip()] = column.strip()
  return mapping


def is_file_task(name: str) -> bool:
  """A registered task whose source reads files (which a run may replace)."""
  if name not in seqio.TaskRegistry.names():
    return False
  source = seqio.get_mixture_or_task(name).source
  return isinstance(source, (file_sources.AlignmentFileSource,
                             HeldOutPrompts))


def check_task_name(name: str, field: str, files_field: str) -> None:
  """Files may be registered under `name` unless another kind of task has
  it (a built-in task is not replaced silently)."""
  if name in seqio.MixtureRegistry.names() or (
      name in seqio.TaskRegistry.names() and not is_file_task(name)):
    raise ValueError(
        f"{field}: {name!r} is already a registered seqio task, and "
        f"{files_field} registers the files as a task under that name. Give "
        "your data its own name, e.g. --config.data.task=my_prefs (files "
        "registered by an earlier run of this process are replaced).")


# --- held-out prompts -----------------------------------------------------------


class HeldOutPrompts(seqio.DataSource):
  """A source's "train" split with prompts held out as other splits.

  The distinct prompts of the wrapped source's "train" split are ordered by
  a hash of (seed, prompt text), so the choice does not depend on file
  order; the first `counts["test"]` are the "test" split, the next
  `counts["validation"]` the "validation" split, and every row of any other
  prompt stays in "train". The turns of a conversation (layout "messages")
  go with its first prompt (`AlignmentFileSource.row_prompts`): a later
  turn's prompt holds the earlier replies. Reward normalisation and pair
  weights are the wrapped source's, over all its rows.

  Args:
    source: an `AlignmentFileSource` with a "train" split.
    counts: {"validation": n, "test": m} prompts to hold out (0 = none).
    seed: the hash's seed.
  """

  def __init__(self, source: file_sources.AlignmentFileSource,
               counts: Mapping[str, int], seed: int):
    self.inner = source
    self.counts = {s: int(counts.get(s, 0)) for s in HOLDOUT_SPLITS}
    self.seed = seed
    self._assignment = None
    splits = ("train",) + tuple(s for s in HOLDOUT_SPLITS if self.counts[s])
    super().__init__(splits=splits, num_input_examples=None,
                     caching_permitted=True, performs_internal_shuffling=True)

  def __getattr__(self, name):
    # layout, layout_options, kind, ...: the wrapped source's.
    if name == "inner":
      raise AttributeError(name)
    return getattr(self.inner, name)

  def _split_of_rows(self) -> np.ndarray:
    """[rows of the wrapped "train"] the split index (in `self.splits`)."""
    if self._assignment is None:
      # A conversation's turns go with its first prompt.
      prompts = self.inner.row_prompts("train")
      distinct = sorted(set(prompts), key=lambda p: hashlib.sha256(
          f"{self.seed}\0{p}".encode("utf-8")).hexdigest())
      wanted = sum(self.counts.values())
      if wanted >= len(distinct):
        raise ValueError(
            f"config.data.files.holdout_validation_prompts / "
            f"holdout_test_prompts: {wanted} prompts held out of "
            f"{len(distinct)} distinct training prompts would leave none "
            "to train on; hold out fewer.")
      split_of_prompt, start = {}, 0
      for split in HOLDOUT_SPLITS:
        for prompt in distinct[start:start + self.counts[split]]:
          split_of_prompt[prompt] = self.splits.index(split)
        start += self.counts[split]
      self._assignment = np.array([split_of_prompt.get(p, 0)
                                   for p in prompts], np.int32)
    return self._assignment

  def _rows(self, split: str) -> np.ndarray:
    if split not in self.splits:
      raise ValueError(f"split {split!r} not in this source's splits "
                       f"{list(self.splits)}.")
    return np.flatnonzero(self._split_of_rows() == self.splits.index(split))

  @property
  def supports_arbitrary_sharding(self) -> bool:
    return True

  def list_shards(self, split: str):
    return self.inner.list_shards("train")

  def num_input_examples(self, split: str) -> int:
    return len(self._rows(split))

  def get_dataset(self, split: str = "train", shuffle: bool = True,
                  seed: Optional[int] = None,
                  shard_info: Optional[seqio.ShardInfo] = None,
                  *, sequence_length=None, use_cached=False, num_epochs=1
                  ) -> tf.data.Dataset:
    del sequence_length, use_cached, num_epochs  # Unused by sources.
    rows = self._rows(split)
    if shard_info is not None:
      rows = rows[shard_info.index::shard_info.num_shards]
    keep = np.zeros(len(self._split_of_rows()), bool)
    keep[rows] = True
    keep = tf.constant(keep)
    ds = self.inner.get_dataset("train", shuffle=False)
    ds = ds.enumerate().filter(lambda i, ex: tf.gather(keep, i)).map(
        lambda i, ex: ex)
    if shuffle:
      ds = ds.shuffle(max(len(rows), 1),
                      seed=self.seed if seed is None else seed,
                      reshuffle_each_iteration=True)
    return ds

  def __repr__(self):
    return f"HeldOutPrompts({self.inner!r}, counts={self.counts})"


# --- demonstrations ----------------------------------------------------------------


def _as_inputs_and_targets(dataset: tf.data.Dataset) -> tf.data.Dataset:
  """prompt -> inputs, completion -> targets; extra columns kept as they
  are (`alignment_kinds.column_feature`), for the prompts of online RL."""
  def convert(ex):
    # A prompts source has no completions: online RL reads the inputs only.
    out = {"inputs": ex[alignment_kinds.PROMPT],
           "targets": ex.get("completion", tf.constant(""))}
    out.update({key: value for key, value in ex.items()
                if alignment_kinds.column_of_feature(key) is not None})
    return out
  return dataset.map(convert, num_parallel_calls=tf.data.AUTOTUNE)


def register_demonstrations(name: str, source: seqio.DataSource,
                            vocabulary: seqio.Vocabulary, *,
                            max_prompt_tokens: Optional[int] = None
                            ) -> seqio.Task:
  """Registers (replacing) a seqio `inputs`/`targets` task over a source of
  demonstrations: SFT trains on it, online RL samples from its `inputs`
  (and hands its extra columns to the reward functions)."""
  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)
  return seqio.TaskRegistry.add(
      name, source=source,
      shuffle_buffer_size=alignment_data.shuffle_buffer_size_for(source),
      preprocessors=[
          _as_inputs_and_targets,
          functools.partial(alignment_data.check_prompt_length_limit,
                            max_prompt_tokens=max_prompt_tokens,
                            task_name=name, feature="inputs"),
          seqio.preprocessors.tokenize,
          seqio.preprocessors.append_eos_after_trim],
      output_features={
          "inputs": seqio.Feature(vocabulary, add_eos=True),
          "targets": seqio.Feature(vocabulary, add_eos=True)})


def register_demonstrations_task(name: str, paths, *,
                                 vocabulary: seqio.Vocabulary,
                                 layout: str = "columns", **source_options
                                 ) -> seqio.Task:
  """Registers demonstrations read from files (`file_sources`' layouts
  "tldr_sft", "gsm8k", "math" and "columns" with prompt/completion) as an
  `inputs`/`targets` task. `source_options` are `AlignmentFileSource`'s."""
  source = file_sources.AlignmentFileSource(
      paths, kind=alignment_kinds.DEMONSTRATIONS, layout=layout,
      vocabulary=vocabulary, **source_options)
  return register_demonstrations(
      name, source, vocabulary,
      max_prompt_tokens=source_options.get("max_prompt_tokens"))


# --- config.data.files ----------------------------------------------------------


def register_task_from_files(config, kind: str) -> None:
  """Registers config.data.task from config.data.files (see defaults.py):
  files of `kind`, an alignment kind, "demonstrations" or "prompts"."""
  files = config.data.files
  if kind not in alignment_kinds.KINDS and (
      kind not in alignment_kinds.WITH_EXTRA_COLUMNS):
    raise ValueError(
        f"config.data.files: {config.algorithm} reads a registered seqio "
        "task (config.data.task); file sources give the alignment data kinds "
        "(pairs, rankings, trajectories, thumbs) and demonstrations.")
  name = config.data.task
  check_task_name(name, "config.data.task", "config.data.files.train")
  for field in ("train", "validation", "test", "vocabulary", "chat_template"):
    pattern = files[field]
    if pattern and not tf.io.gfile.glob(pattern):
      raise ValueError(f"config.data.files.{field}: no file matches "
                       f"{pattern!r}.")
  vocabulary = files_vocabulary(config)
  # The prompt's tokens with the EOS the task appends to it.
  max_prompt_tokens = registry.prompt_feature_length(config.model,
                                                     config.data.inputs_length)
  paths = {split: files[split] for split in ("train", "validation", "test")
           if files[split]}
  source = file_sources.AlignmentFileSource(
      paths,
      kind=kind,
      layout=files.layout,
      column_mapping=parse_column_mapping(files.column_mapping),
      vocabulary=vocabulary,
      max_prompt_tokens=max_prompt_tokens,
      # Both lengths count the EOS the task appends.
      max_completion_tokens=(files.max_completion_tokens
                             or config.data.targets_length),
      normalize_rewards=files.normalize_rewards and kind == "trajectory",
      on_bad_row=files.on_bad_row, seed=config.seed,
      chat_template=files_chat_template(config, vocabulary))
  counts = {"validation": files.holdout_validation_prompts,
            "test": files.holdout_test_prompts}
  if any(counts.values()):
    source = HeldOutPrompts(source, counts, config.seed)
  if kind in alignment_kinds.WITH_EXTRA_COLUMNS:
    register_demonstrations(name, source, vocabulary,
                            max_prompt_tokens=max_prompt_tokens)
  else:
    alignment_data.register_alignment_task(
        name, source, kind, vocabulary,
        max_prompt_tokens=max_prompt_tokens, overwrite=True)
