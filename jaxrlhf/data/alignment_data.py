"""Offline alignment data as seqio tasks: kinds, task builders, converters.

The four data kinds (`alignment_kinds`: pairs, ranking, trajectory, thumbs)
become seqio tasks whose features are the kind's fields: text fields are
tokenized with the task's vocabulary (completions end with EOS; prompts too
unless `prompt_add_eos=False`), scalars stay float32. A recipe reads such a
task through `jaxrlhf.data.pipeline.BatchIterator` with the converter for its
kind and architecture (`feature_converter_for`), e.g.

  task = register_file_task(
      "uf_dro", "/data/ultrafeedback/*.parquet", layout="ultrafeedback",
      kind="trajectory", vocabulary=vocab, max_prompt_tokens=512,
      on_bad_row="skip_and_report")
  batches = pipeline.BatchIterator(
      "uf_dro", "train", {"prompt": 512, "completion": 256},
      feature_converter_for("trajectory", "encoder_decoder"),
      global_batch_size=32, seed=0)

`task.source` is the `AlignmentFileSource`, with `bad_row_counts(split)`,
`bad_rows(split)` and `reward_stats(split)`.
"""

import functools
from typing import Any, Mapping, Optional, Sequence, Union

import seqio
import tensorflow as tf

from jaxrlhf.data import alignment_kinds as kinds_lib
from jaxrlhf.data import feature_converters
from jaxrlhf.data import file_sources

# Re-exported: the public surface of alignment data lives here.
DataKind = kinds_lib.DataKind
KINDS = kinds_lib.KINDS
get_kind = kinds_lib.get_kind
AlignmentFileSource = file_sources.AlignmentFileSource
BadRowError = file_sources.BadRowError
LAYOUTS = file_sources.LAYOUTS
feature_converter_for = feature_converters.feature_converter_for
EncDecPairsFeatureConverter = feature_converters.EncDecPairsFeatureConverter
EncDecRankingFeatureConverter = feature_converters.EncDecRankingFeatureConverter
EncDecTrajectoryFeatureConverter = (
    feature_converters.EncDecTrajectoryFeatureConverter)
EncDecThumbsFeatureConverter = feature_converters.EncDecThumbsFeatureConverter
DecoderPairsFeatureConverter = feature_converters.DecoderPairsFeatureConverter
DecoderRankingFeatureConverter = (
    feature_converters.DecoderRankingFeatureConverter)
DecoderTrajectoryFeatureConverter = (
    feature_converters.DecoderTrajectoryFeatureConverter)
DecoderThumbsFeatureConverter = feature_converters.DecoderThumbsFeatureConverter


def output_features(kind, vocabulary: seqio.Vocabulary,
                    prompt_add_eos: bool = True
                    ) -> Mapping[str, seqio.Feature]:
  """The seqio output features of a task of `kind`."""
  kind = kinds_lib.get_kind(kind)
  features = {kinds_lib.PROMPT: seqio.Feature(vocabulary,
                                              add_eos=prompt_add_eos)}
  for field in kind.completion_fields:
    features[field] = seqio.Feature(vocabulary, add_eos=True,
                                    rank=2 if kind.ranked else 1)
  for field, default in kind.scalar_defaults.items():
    # A scalar with a default may be absent; the converters fill it in.
    features[field] = seqio.ContinuousFeature(
        dtype=tf.float32, rank=0, required=default is None)
  return features


def check_prompt_length_limit(dataset: tf.data.Dataset,
                              sequence_length: Optional[Mapping[str, int]],
                              max_prompt_tokens: Optional[int],
                              task_name: str,
                              feature: str = kinds_lib.PROMPT
                              ) -> tf.data.Dataset:
  """Fails when the prompt feature length would cut prompts the source kept.

  The source reports prompts longer than `max_prompt_tokens`; a shorter
  prompt feature length (of `feature`: "prompt", or "inputs" for
  demonstrations) would make seqio truncate the ones in between silently.
  """
  length = (sequence_length or {}).get(feature)
  if max_prompt_tokens is not None and length is not None and (
      length < max_prompt_tokens):
    raise ValueError(
        f"task {task_name!r} keeps prompts of up to max_prompt_tokens="
        f"{max_prompt_tokens} tokens, but the {feature!r} feature length is "
        f"{length}: longer prompts would be truncated silently. Use a prompt "
        f"length >= {max_prompt_tokens}, or register the task with "
        f"max_prompt_tokens={length}.")
  return dataset


def preprocessors(task_name: str, max_prompt_tokens: Optional[int] = None):
  """Tokenize the text fields, then trim and append EOS where asked."""
  return [
      functools.partial(check_prompt_length_limit,
                        max_prompt_tokens=max_prompt_tokens,
                        task_name=task_name),
      seqio.preprocessors.tokenize,
      seqio.preprocessors.append_eos_after_trim,
  ]


def shuffle_buffer_size_for(source: seqio.DataSource,
                            requested: Optional[int] = None
                            ) -> Optional[int]:
  """seqio's example shuffle buffer for a task over `source`: `requested`,
  or none for a source that permutes a whole split afresh every pass
  (`performs_internal_shuffling`, as the file sources do: a buffer after
  the repeat would mix neighbouring passes), else seqio's default."""
  if requested is not None or source.performs_internal_shuffling:
    return requested
  return seqio.SHUFFLE_BUFFER_SIZE


def register_alignment_task(name: str, source: seqio.DataSource, kind,
                            vocabulary: seqio.Vocabulary, *,
                            prompt_add_eos: bool = True,
                            max_prompt_tokens: Optional[int] = None,
                            shuffle_buffer_size: Optional[int] = None,
                            overwrite: bool = False) -> seqio.Task:
  """Registers a seqio task of `kind` over any source of raw examples.

  Args:
    name: the task name.
    source: a seqio.DataSource whose examples hold the kind's fields as raw
      values: strings for prompt and completions (a [n] string tensor, best
      first, for `completions` of a ranking) and float32 scalars.
    kind: "pairs", "ranking", "trajectory", "thumbs" or a DataKind.
    vocabulary: tokenizes every text field.
    prompt_add_eos: append EOS to prompts (T5 convention; decoder-only
      converters drop it again).
    max_prompt_tokens: the prompt limit the source enforces; a smaller
      "prompt" feature length is then an error instead of a silent cut.
    shuffle_buffer_size: seqio's example shuffle buffer after the source
      (`shuffle_buffer_size_for`: by default none for a source that
      permutes each pass itself, such as the file sources).
    overwrite: replace a task already registered under `name`.
  """
  kind = kinds_lib.get_kind(kind)
  if name in seqio.TaskRegistry.names():
    if not overwrite:
      raise ValueError(f"a seqio task named {name!r} is already registered; "
                       "pass overwrite=True to replace it.")
    seqio.TaskRegistry.remove(name)
  return seqio.TaskRegistry.add(
      name, source=source,
      preprocessors=preprocessors(name, max_prompt_tokens),
      output_features=output_features(kind, vocabulary, prompt_add_eos),
      shuffle_buffer_size=shuffle_buffer_size_for(source,
                                                  shuffle_buffer_size))


def register_file_task(name: str,
                       paths: Union[str, Sequence[str],
                                    Mapping[str, Union[str, Sequence[str]]]],
                       *, kind, vocabulary: seqio.Vocabulary,
                       layout: str = "columns",
                       column_mapping: Optional[Mapping[str, str]] = None,
                       layout_options: Optional[Mapping[str, Any]] = None,
                       prompt_add_eos: bool = True,
                       max_prompt_tokens: Optional[int] = None,
                       max_completion_tokens: Optional[int] = None,
                       min_completions: int = 2,
                       max_completions: Optional[int] = None,
                       normalize_rewards: Optional[bool] = None,
                       on_bad_row: str = "raise", seed: int = 0,
                       file_format: Optional[str] = None,
                       shuffle_buffer_size: Optional[int] = None,
                       overwrite: bool = False) -> seqio.Task:
  """Registers a seqio task that reads alignment data from files.

  Files are read when a split is first used, in one pass: rows are parsed by
  the layout, checked (bad rows raise or are counted, per `on_bad_row`),
  and rewards optionally normalised. See `file_sources` for the layouts, the
  file formats and the bad-row reasons.

  Args:
    name: the task name.
    paths: a file, a glob, or a list of them (all "train"), or a mapping
      split -> file(s)/glob(s).
    kind: "pairs", "ranking", "trajectory" or "thumbs".
    vocabulary: the task's vocabulary.
    layout: "columns", "ultrafeedback", "hh_rlhf" or "tldr".
    column_mapping: layout "columns": kind field -> column, e.g.
      {"prompt": "question", "completion": "answer", "reward": "score"}.
    layout_options: e.g. {"score": "fine_grained"} for UltraFeedback,
      {"truncate_post_paragraphs": False} for TL;DR.
    prompt_add_eos: append EOS to prompts.
    max_prompt_tokens: longer prompts are bad rows; use the "prompt" feature
      length you will read the task with.
    max_completion_tokens: longer completions (EOS included) are bad rows.
    min_completions, max_completions: bounds on rankings' K.
    normalize_rewards: mean 0 / variance 1 rewards (None: on for
      UltraFeedback trajectories, as in the DRO paper).
    on_bad_row: "raise" or "skip_and_report".
    seed: seed of random choices in layouts and of the source's shuffle.
    file_format: "jsonl" or "parquet" when the suffix does not say.
    shuffle_buffer_size: seqio's example shuffle buffer after the source
      (`shuffle_buffer_size_for`: by default none for a source that
      permutes each pass itself, such as the file sources).
    overwrite: replace a task already registered under `name`.

  Returns:
    The registered seqio.Task; its `source` is the AlignmentFileSource.
  """
  source = file_sources.AlignmentFileSource(
      paths, kind=kind, layout=layout, column_mapping=column_mapping,
      layout_options=layout_options, vocabulary=vocabulary,
      prompt_add_eos=prompt_add_eos, max_prompt_tokens=max_prompt_tokens,
      max_completion_tokens=max_completion_tokens,
      min_completions=min_completions, max_completions=max_completions,
      normalize_rewards=normalize_rewards, on_bad_row=on_bad_row, seed=seed,
      file_format=file_format)
  return register_alignment_task(
      name, source, kind, vocabulary, prompt_add_eos=prompt_add_eos,
      max_prompt_tokens=max_prompt_tokens,
      shuffle_buffer_size=shuffle_buffer_size, overwrite=overwrite)
