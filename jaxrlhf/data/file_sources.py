"""seqio sources for alignment data in the file layouts researchers have.

A source reads JSON-lines or Parquet files once (local paths, globs, or any
path `tf.io.gfile` opens, e.g. gs://), turns each row into examples of one
data kind (`alignment_kinds`) following a *layout*, checks every example,
optionally normalises rewards, and serves the examples as a
`seqio.DataSource`. Tasks built on it (`alignment_data.register_file_task`)
read like any registered seqio task.

File formats: `.jsonl`, `.json` (one JSON object per line, as in the TL;DR
comparison files), `.parquet`; `.gz` after either JSON suffix is gunzipped.
Row numbers in messages count from 1 (the line number of a JSON-lines file).

The layouts ("columns", "ultrafeedback", "hh_rlhf", "tldr", "tldr_sft",
"gsm8k", "math", and "messages": conversations rendered with the
checkpoint's chat template, `chat_templates`) are described in
`file_layouts`; the bad-row policy and
reasons in `row_checks`: a bad row is never dropped silently; it raises
`BadRowError` with its file and row (`on_bad_row="raise"`, the default) or
is skipped, counted by reason
(`bad_row_counts(split)`), kept with its message (`bad_rows(split)`) and
summarised in a log line when the split is loaded
(`on_bad_row="skip_and_report"`).

Demonstrations and prompts may carry extra columns (`extra_columns`: the
GSM8K and MATH layouts' `answer`, the "messages" layout's conversation, or
names a "columns" mapping adds) as JSON-encoded string
features (`alignment_kinds.column_feature`), for the reward functions of
online RL; a value that JSON cannot hold is a `wrong_type` bad row.

Pairs get a `prompt_weight` per pair (`equal_prompt_weights`) under which
every prompt of a split weighs the same in a weighted mean, however many
pairs it has (InstructGPT; RLHF book section 7.4.2, eq. 6).
"""

import dataclasses
import functools
import gzip
import json
from typing import (Any, Dict, Iterator, List, Mapping, Optional, Sequence,
                    Tuple, Union)

import numpy as np
import seqio
import tensorflow as tf

from jaxrlhf import console
from jaxrlhf.data import alignment_kinds as kinds_lib
from jaxrlhf.data import chat_templates
from jaxrlhf.data import file_layouts
from jaxrlhf.data import layout_rows
from jaxrlhf.data import names
from jaxrlhf.data import row_checks

BadRow = row_checks.BadRow
BadRowError = row_checks.BadRowError
BadRowRecord = row_checks.BadRowRecord

ON_BAD_ROW = names.ON_BAD_ROW
FILE_FORMATS = ("jsonl", "parquet")
# How many bad-row messages a source keeps per split (all are counted).
MAX_KEPT_BAD_ROWS = 1000
LAYOUTS = file_layouts.LAYOUTS


# --- readers -----------------------------------------------------------------


def file_format_of(path: str, file_format: Optional[str] = None) -> str:
  if file_format is not None:
    if file_format not in FILE_FORMATS:
      raise ValueError(f"file_format={file_format!r}; expected one of "
                       f"{FILE_FORMATS}.")
    return file_format
  name = path[:-3] if path.endswith(".gz") else path
  if name.endswith((".jsonl", ".json")):
    return "jsonl"
  if name.endswith(".parquet"):
    return "parquet"
  raise ValueError(f"{path}: cannot tell the file format from the suffix; "
                   "use .jsonl/.json/.parquet or pass file_format='jsonl' or "
                   "'parquet'.")


class UnreadableFileError(ValueError):
  """A data file that cannot be read at all (damaged, truncated, or not in
  the format its suffix says), named in one line."""

  def __init__(self, path: str, file_format: str, error: BaseException,
               rows_read: int):
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
    after = f" after {rows_read} rows" if rows_read else ""
    super().__init__(
        f"{path}: cannot be read as {file_format}{after} ({reason}). The "
        "file is damaged or not in that format: replace it, or leave it out "
        "of the files the run reads.")


def _read_jsonl(path: str) -> Iterator[Tuple[int, Union[dict, BadRow]]]:
  line_number = 0
  try:
    for line_number, line in _jsonl_lines(path):
      yield line_number, line
  except (OSError, EOFError, tf.errors.OpError) as e:
    kind = "gzipped JSON lines" if path.endswith(".gz") else "JSON lines"
    raise UnreadableFileError(path, kind, e, line_number) from None


def _jsonl_lines(path: str) -> Iterator[Tuple[int, Union[dict, BadRow]]]:
  with tf.io.gfile.GFile(path, "rb") as raw:
    stream = gzip.GzipFile(fileobj=raw) if path.endswith(".gz") else raw
    for line_number, line in enumerate(stream, start=1):
      if not line.strip():
        continue  # Blank lines (e.g. a trailing newline) are not rows.
      try:
        record = json.loads(line)
      except ValueError as e:
        yield line_number, BadRow("invalid_json", f"not valid JSON ({e}).")
        continue
      if not isinstance(record, dict):
        yield line_number, BadRow(
            "invalid_json", f"a row must be a JSON object, got "
            f"{type(record).__name__}.")
        continue
      yield line_number, record


def _read_parquet(path: str) -> Iterator[Tuple[int, dict]]:
  try:
    # pylint: disable=g-import-not-at-top
    import pyarrow as pa
    import pyarrow.parquet as pq
  except ImportError as e:
    raise ImportError(f"{path}: reading Parquet needs pyarrow; "
                      "`pip install pyarrow`.") from e
  if "://" in path:
    # pyarrow cannot read through a GFile; remote files (gs://...) are read
    # into memory whole.
    with tf.io.gfile.GFile(path, "rb") as f:
      target = pa.BufferReader(f.read())
  else:
    target = path
  row = 0
  try:
    for batch in pq.ParquetFile(target).iter_batches(batch_size=1024):
      for record in batch.to_pylist():
        row += 1
        yield row, record
  except (pa.ArrowException, OSError) as e:
    raise UnreadableFileError(path, "Parquet", e, row) from None


def read_rows(path: str, file_format: Optional[str] = None
              ) -> Iterator[Tuple[int, Union[dict, BadRow]]]:
  """(row number from 1, row dict or BadRow) for each row of one file."""
  if file_format_of(path, file_format) == "jsonl":
    return _read_jsonl(path)
  return _read_parquet(path)


def expand_paths(paths: Union[str, Sequence[str]]) -> List[str]:
  """Files named by paths or glob patterns, each pattern's matches sorted."""
  if isinstance(paths, str):
    paths = [paths]
  files = []
  for pattern in paths:
    if any(c in pattern for c in "*?["):
      matches = sorted(tf.io.gfile.glob(pattern))
      if not matches:
        raise FileNotFoundError(f"no file matches {pattern!r}.")
      files.extend(matches)
    else:
      if not tf.io.gfile.exists(pattern):
        raise FileNotFoundError(f"{pattern}: no such file.")
      files.append(pattern)
  return files


# --- the source --------------------------------------------------------------


@dataclasses.dataclass
class SplitData:
  """The checked examples of one split and what was left out."""
  columns: Dict[str, Any]
  num_examples: int
  num_rows: int
  bad_row_counts: Dict[str, int]
  bad_rows: List[BadRowRecord]
  files: List[str]
  # (file index, row) each example came from.
  origins: List[Tuple[int, int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class RewardStats:
  """Mean and standard deviation (ddof 0) of the raw rewards of `split`."""
  mean: float
  std: float
  count: int
  split: str


def equal_prompt_weights(prompts: Sequence[str]) -> np.ndarray:
  """Per-pair weights under which every prompt counts once, averaging 1.

  InstructGPT weighs the C(K, 2) comparisons of a prompt ranked over K
  completions by 1 / C(K, 2), so that prompts with many comparisons do not
  dominate (and over-fit; RLHF book section 7.4.2, eq. 6). Over a whole split,
  pair i of prompt p gets

    w_i = (num_pairs / num_prompts) / (pairs of p),

  so a weighted mean of per-pair losses, sum_i w_i l_i / sum_i w_i, is the
  mean over prompts of each prompt's mean pair loss, and the weights average
  1 (a batch's weighted mean keeps the usual scale).

  Args:
    prompts: [num_pairs] the prompt text of each pair; equal strings are the
      same prompt.
  Returns:
    [num_pairs] float64 weights.
  """
  if not len(prompts):
    return np.zeros((0,), np.float64)
  _, prompt_index, counts = np.unique(np.asarray(prompts, dtype=object),
                                      return_inverse=True, return_counts=True)
  return (len(prompts) / len(counts)) / counts[prompt_index].astype(np.float64)


def _normalize_splits(paths) -> Dict[str, Union[str, Sequence[str]]]:
  if isinstance(paths, Mapping):
    if not paths:
      raise ValueError("paths: the split -> files mapping is empty.")
    return dict(paths)
  return {"train": paths}


class AlignmentFileSource(seqio.DataSource):
  """Examples of one kind read from files of one layout; see module doc.

  Args:
    paths: a file, a glob, a list of them (the "train" split), or a mapping
      split -> file(s).
    kind: the data kind ("pairs", "ranking", "trajectory", "thumbs"), or
      `alignment_kinds.DEMONSTRATIONS`.
    layout: a name in `LAYOUTS` ("columns", "ultrafeedback", "hh_rlhf",
      "tldr", "tldr_sft", "gsm8k", "math", "messages").
    column_mapping: for layouts "columns" and "messages": kind field (or
      the layout's own column, "messages") -> column name; for
      demonstrations, other names are extra columns (name -> column).
    layout_options: layout-specific options (see `file_layouts`).
    vocabulary: the task's vocabulary; needed for token limits and TL;DR
      paragraph truncation.
    prompt_add_eos: whether the task appends EOS to prompts (counted against
      `max_prompt_tokens`).
    max_prompt_tokens: prompts with more tokens are bad rows. Register the
      task with the same number as its "prompt" feature length.
    max_completion_tokens: completions with more tokens (EOS included) are
      bad rows; None lets seqio truncate them (and then append EOS).
    min_completions, max_completions: bounds on the K of a ranking.
    normalize_rewards: shift and scale rewards to mean 0 and variance 1, with
      statistics from the "train" split if there is one (applied to every
      split) and from the split itself otherwise. None: the layout's default
      (on for UltraFeedback trajectories, off otherwise).
    prompt_weights: kind pairs: set each pair's `prompt_weight` with
      `equal_prompt_weights` over its split, so every prompt counts once in
      a loss weighted by it. False keeps the file's `prompt_weight` column
      (layout "columns"), or 1 where there is none.
    on_bad_row: "raise" or "skip_and_report".
    seed: seed of the layouts' random choices (UltraFeedback pairs) and of
      the default shuffle.
    file_format: "jsonl" or "parquet" when the suffix does not say.
    chat_template: layout "messages": the `chat_templates.ChatTemplate` to
      render conversations with; None: the vocabulary's own
      (`chat_templates.for_vocabulary`).
  """

  def __init__(self, paths, *, kind, layout: str = "columns",
               column_mapping: Optional[Mapping[str, str]] = None,
               layout_options: Optional[Mapping[str, Any]] = None,
               vocabulary: Optional[seqio.Vocabulary] = None,
               prompt_add_eos: bool = True,
               max_prompt_tokens: Optional[int] = None,
               max_completion_tokens: Optional[int] = None,
               min_completions: int = 2,
               max_completions: Optional[int] = None,
               normalize_rewards: Optional[bool] = None,
               on_bad_row: str = "raise", seed: int = 0,
               file_format: Optional[str] = None,
               prompt_weights: bool = True,
               chat_template: Optional[chat_templates.ChatTemplate] = None):
    self.kind = kinds_lib.get_kind(kind)
    if layout not in LAYOUTS:
      raise ValueError(f"unknown layout {layout!r}; expected one of "
                       f"{sorted(LAYOUTS)}.")
    self.layout = LAYOUTS[layout]
    if self.kind.name not in self.layout.kinds:
      raise ValueError(f"layout {layout!r} gives kinds {self.layout.kinds}, "
                       f"not {self.kind.name!r}.")
    self.layout_options = file_layouts.check_layout_options(
        self.layout, dict(layout_options or {}))
    self.column_mapping = dict(column_mapping or {})
    if self.column_mapping and not self.layout.maps_columns:
      raise ValueError(f"column_mapping applies to layouts "
                       f"{[n for n, l in LAYOUTS.items() if l.maps_columns]}"
                       f", not {layout!r}.")
    # The names a mapping renames: the kind's fields and the layout's own.
    renamed = self.kind.fields + self.layout.own_columns
    unknown = set(self.column_mapping) - set(renamed)
    if unknown and self.kind.name not in kinds_lib.WITH_EXTRA_COLUMNS:
      raise ValueError(f"column_mapping: {sorted(unknown)} are not fields of "
                       f"kind {self.kind.name!r}; its fields are "
                       f"{list(renamed)} (extra columns are "
                       "carried for demonstrations only).")
    # Demonstrations: names other than the kind's fields are extra columns.
    self._mapped_extras = {name: column for name, column
                           in self.column_mapping.items()
                           if name not in renamed}
    for name in self._mapped_extras:
      kinds_lib.check_column_name(name, "column_mapping", taken=renamed)
    self.column_mapping = {field: column for field, column
                           in self.column_mapping.items()
                           if field in renamed}
    if chat_template is not None and not self.layout.uses_chat_template:
      raise ValueError(f"chat_template applies to layout 'messages', not "
                       f"{layout!r}.")
    self.chat_template = (
        (chat_template or chat_templates.for_vocabulary(vocabulary))
        if self.layout.uses_chat_template else None)
    # Extra columns go with demonstrations and prompts only (online RL's
    # reward functions and environments read them).
    carries = self.kind.name in kinds_lib.WITH_EXTRA_COLUMNS
    self.extra_columns = (self.layout.extra_columns if carries else ()) + (
        tuple(self._mapped_extras))
    if on_bad_row not in ON_BAD_ROW:
      raise ValueError(f"on_bad_row={on_bad_row!r}; expected one of "
                       f"{ON_BAD_ROW}.")
    if (max_prompt_tokens is not None or max_completion_tokens is not None
       ) and vocabulary is None:
      raise ValueError("max_prompt_tokens/max_completion_tokens need the "
                       "vocabulary to count tokens; pass vocabulary=.")
    if normalize_rewards is None:
      normalize_rewards = (self.layout.normalizes_rewards
                           and self.kind.name == "trajectory")
    if normalize_rewards and "reward" not in self.kind.scalar_fields:
      raise ValueError(f"normalize_rewards applies to kind 'trajectory', not "
                       f"{self.kind.name!r}.")
    self.normalize_rewards = normalize_rewards
    self.prompt_weights = (prompt_weights
                           and "prompt_weight" in self.kind.scalar_fields)
    self.on_bad_row = on_bad_row
    self.seed = seed
    self.file_format = file_format
    self.vocabulary = vocabulary
    self.prompt_add_eos = prompt_add_eos
    self.max_prompt_tokens = max_prompt_tokens
    self._limits = row_checks.ExampleLimits(
        prompt_tokens=self._count_prompt_tokens if vocabulary else None,
        completion_tokens=self._count_completion_tokens if vocabulary else None,
        max_prompt_tokens=max_prompt_tokens,
        max_completion_tokens=max_completion_tokens,
        min_completions=min_completions, max_completions=max_completions)
    self._split_paths = _normalize_splits(paths)
    self._raw: Dict[str, SplitData] = {}
    self._loaded: Dict[str, SplitData] = {}
    self._reward_stats: Dict[str, RewardStats] = {}
    # Each pass over a split is a fresh permutation of all of it
    # (`get_dataset`), so seqio adds no shuffle buffer of its own.
    super().__init__(splits=tuple(self._split_paths),
                     num_input_examples=None, caching_permitted=True,
                     performs_internal_shuffling=True)

  # --- token counts --------------------------------------------------------

  def _count_prompt_tokens(self, text: str) -> int:
    return len(self.vocabulary.encode(text)) + int(self.prompt_add_eos)

  def _count_completion_tokens(self, text: str) -> int:
    return len(self.vocabulary.encode(text)) + 1  # + EOS

  # --- reading -------------------------------------------------------------

  def _check_split(self, split: str):
    if split not in self._split_paths:
      raise ValueError(f"split {split!r} not in this source's splits "
                       f"{list(self._split_paths)}.")

  def _read_split(self, split: str) -> SplitData:
    """Reads, parses and checks every row of a split's files (one pass)."""
    files = expand_paths(self._split_paths[split])
    examples: List[dict] = []
    origins: List[Tuple[int, int]] = []
    counts: Dict[str, int] = {}
    kept: List[BadRowRecord] = []
    num_rows = 0
    for file_index, path in enumerate(files):
      for row, record in read_rows(path, self.file_format):
        num_rows += 1
        if isinstance(record, BadRow):
          results = [record]
        else:
          ctx = layout_rows.RowContext(
              kind=self.kind, column_mapping=self.column_mapping,
              options=self.layout_options,
              prompt_tokens=self._limits.prompt_tokens,
              max_prompt_tokens=self.max_prompt_tokens,
              rng_factory=functools.partial(
                  np.random.default_rng, [self.seed, file_index, row]),
              extra_columns=self._mapped_extras,
              chat_template=self.chat_template)
          results = [
              item if isinstance(item, BadRow) else self._check(item)
              for item in self.layout.parse(record, ctx)]
        for item in results:
          if isinstance(item, BadRow):
            record_ = BadRowRecord(path, row, item.reason, item.detail)
            if self.on_bad_row == "raise":
              raise BadRowError(
                  f"{record_} Fix the file, or pass "
                  "on_bad_row='skip_and_report' (on the command line: "
                  "--config.data.files.on_bad_row=skip_and_report) to skip "
                  "such rows and count them.")
            counts[item.reason] = counts.get(item.reason, 0) + 1
            if len(kept) < MAX_KEPT_BAD_ROWS:
              kept.append(record_)
          else:
            examples.append(item)
            origins.append((file_index, row))
    columns = {field: [ex[field] for ex in examples]
               for field in self.kind.fields + self.extra_columns}
    data = SplitData(columns=columns, num_examples=len(examples),
                     num_rows=num_rows, bad_row_counts=counts, bad_rows=kept,
                     files=files, origins=origins)
    self._log_summary(split, data)
    if not examples:
      raise ValueError(
          f"split {split!r} of {files}: no usable example in {num_rows} rows "
          f"(bad rows by reason: {counts}). Check the layout "
          f"({self.layout.name!r}) and kind ({self.kind.name!r}).")
    return data

  def _check(self, example: dict) -> Union[dict, BadRow]:
    """The checked example with its extra columns, or a BadRow."""
    extras = example.pop(layout_rows.EXTRA_COLUMNS, {})
    checked = row_checks.check_example(example, self.kind, self._limits)
    if isinstance(checked, BadRow):
      return checked
    for name in self.extra_columns:
      value = extras.get(name)
      try:
        kinds_lib.encode_column_value(value)
      except (TypeError, ValueError):
        return BadRow("wrong_type", f"extra column {name!r} holds a "
                      f"{type(value).__name__}, which JSON cannot hold.")
      checked[name] = value
    return checked

  def _log_summary(self, split: str, data: SplitData):
    if data.bad_row_counts:
      reasons = ", ".join(f"{k}={v}" for k, v in
                          sorted(data.bad_row_counts.items()))
      first = f" First: {data.bad_rows[0]}" if data.bad_rows else ""
      console.log(
          f"Data: {self.layout.name} split {split!r}: {data.num_examples} "
          f"examples from {data.num_rows} rows of {len(data.files)} "
          f"file(s); skipped {sum(data.bad_row_counts.values())} bad "
          f"rows/completions ({reasons}).{first}")
    else:
      console.log(
          f"Data: {self.layout.name} split {split!r}: {data.num_examples} "
          f"examples from {data.num_rows} rows of {len(data.files)} file(s).")

  def _raw_split(self, split: str) -> SplitData:
    self._check_split(split)
    if split not in self._raw:
      self._raw[split] = self._read_split(split)
    return self._raw[split]

  def reward_stats(self, split: str = "train") -> Optional[RewardStats]:
    """The statistics `split`'s rewards are normalised with (None when not
    normalising): the "train" split's if the source has one, else its own."""
    if not self.normalize_rewards:
      return None
    self._check_split(split)
    stats_split = "train" if "train" in self._split_paths else split
    if stats_split not in self._reward_stats:
      self._reward_stats[stats_split] = self._stats_of(stats_split)
    return self._reward_stats[stats_split]

  def _stats_of(self, split: str) -> RewardStats:
    rewards = np.asarray(self._raw_split(split).columns["reward"], np.float64)
    std = float(rewards.std())
    if not std > 0:
      raise ValueError(f"normalize_rewards: the rewards of split {split!r} "
                       f"all equal {rewards[0]:g}; they cannot be scaled to "
                       "variance 1. Pass normalize_rewards=False (on the "
                       "command line: --config.data.files.normalize_rewards="
                       "False).")
    return RewardStats(mean=float(rewards.mean()), std=std,
                       count=int(rewards.size), split=split)

  def load(self, split: str) -> SplitData:
    """The checked (and normalised, and prompt-weighted) examples of a split;
    read once."""
    if split not in self._loaded:
      data = self._raw_split(split)
      if self.normalize_rewards:
        stats = self.reward_stats(split)
        rewards = np.asarray(data.columns["reward"], np.float64)
        data = dataclasses.replace(data, columns={
            **data.columns, "reward": list((rewards - stats.mean) / stats.std)})
      if self.prompt_weights:
        # Counted after bad rows are dropped: the weights are over the pairs
        # training will see.
        weights = equal_prompt_weights(data.columns["prompt"])
        data = dataclasses.replace(data, columns={
            **data.columns, "prompt_weight": [float(w) for w in weights]})
      self._loaded[split] = data
    return self._loaded[split]

  def row_prompts(self, split: str = "train") -> List[str]:
    """Per example, the prompt of the first example its file row gave: the
    prompt it is held out with (`file_tasks.HeldOutPrompts`), so that the
    turns of one conversation, whose later prompts hold the earlier
    replies, stay in one split. Other layouts' rows give one prompt."""
    data = self.load(split)
    first: Dict[Tuple[int, int], str] = {}
    return [first.setdefault(origin, prompt) for origin, prompt
            in zip(data.origins, data.columns[kinds_lib.PROMPT])]

  def bad_row_metrics(self) -> Dict[str, float]:
    """The bad-row counts of every split read so far, as metrics:
    "data/bad_rows/<split>" (all reasons) and
    "data/bad_rows/<split>/<reason>"."""
    out = {}
    for split, data in sorted(self._raw.items()):
      if data.bad_row_counts:
        out[f"data/bad_rows/{split}"] = float(sum(
            data.bad_row_counts.values()))
        for reason, count in sorted(data.bad_row_counts.items()):
          out[f"data/bad_rows/{split}/{reason}"] = float(count)
    return out

  def bad_row_counts(self, split: str = "train") -> Dict[str, int]:
    """Bad rows (or completions) of a split by reason."""
    return dict(self._raw_split(split).bad_row_counts)

  def bad_rows(self, split: str = "train") -> List[BadRowRecord]:
    """The first MAX_KEPT_BAD_ROWS bad rows of a split, with messages."""
    return list(self._raw_split(split).bad_rows)

  def examples(self, split: str = "train") -> List[dict]:
    """The split's examples as dicts of Python values, in file order."""
    columns = self.load(split).columns
    return [dict(zip(columns, values)) for values in zip(*columns.values())]

  # --- seqio.DataSource ----------------------------------------------------

  @property
  def supports_arbitrary_sharding(self) -> bool:
    return True

  def list_shards(self, split: str) -> Sequence[str]:
    self._check_split(split)
    return expand_paths(self._split_paths[split])

  def num_input_examples(self, split: str) -> Optional[int]:
    return self.load(split).num_examples

  def get_dataset(self, split: str = "train", shuffle: bool = True,
                  seed: Optional[int] = None,
                  shard_info: Optional[seqio.ShardInfo] = None,
                  *, sequence_length=None, use_cached=False, num_epochs=1
                  ) -> tf.data.Dataset:
    del sequence_length, use_cached, num_epochs  # Unused by sources.
    data = self.load(split)
    index = np.arange(data.num_examples)
    if shard_info is not None:
      index = index[shard_info.index::shard_info.num_shards]
    tensors = {}
    for field in self.kind.fields:
      values = data.columns[field]
      if field in self.kind.scalar_fields:
        tensors[field] = np.asarray(values, np.float32)[index]
      elif self.kind.ranked and field in self.kind.completion_fields:
        rows = [values[i] for i in index]
        tensors[field] = tf.RaggedTensor.from_row_lengths(
            np.array([t for r in rows for t in r], dtype=object),
            np.array([len(r) for r in rows], np.int64))
      else:
        tensors[field] = np.array([values[i] for i in index], dtype=object)
    for name in self.extra_columns:
      values = data.columns[name]
      tensors[kinds_lib.column_feature(name)] = np.array(
          [kinds_lib.encode_column_value(values[i]) for i in index],
          dtype=object)
    ds = tf.data.Dataset.from_tensor_slices(tensors)
    if self.kind.ranked:
      # Slices of a ragged tensor come out as ragged_rank-0 specs; an identity
      # map makes them plain [n] string tensors for seqio's tokenizer.
      ds = ds.map(lambda ex: dict(ex))
    if shuffle:
      ds = ds.shuffle(max(len(index), 1),
                      seed=self.seed if seed is None else seed,
                      reshuffle_each_iteration=True)
    return ds

  def __repr__(self):
    return (f"{type(self).__name__}(kind={self.kind.name!r}, "
            f"layout={self.layout.name!r}, splits={self._split_paths})")
