"""seqio feature converters for the alignment data kinds.

A converter turns a task's examples of one kind (`alignment_kinds`) into the
fixed-shape features a model reads, for one architecture. Lengths come from
the task feature lengths: `prompt` (Lp) and each completion field (Lc), e.g.
{"prompt": 512, "chosen": 64, "rejected": 64}. Token id 0 is PAD; EOS is the
vocabulary's EOS (1 for T5), never used as padding ("N+ implementation
details of RLHF with PPO", detail 3: a model whose EOS is masked as padding
never learns to stop).

Encoder-decoder (t5x names), per completion field `f` (`chosen`, `rejected`,
`completion`, or `completions` for rankings):
  encoder_input_tokens      [Lp]   the prompt, right-padded
  f_decoder_target_tokens   [Lc]   the completion with its EOS, right-padded
  f_decoder_input_tokens    [Lc]   targets shifted right, BOS (0) first
  f_decoder_loss_weights    [Lc]   1 on target tokens (EOS included), 0 on PAD

Decoder-only, per completion field `f` (detail 5: right-pad prompt+completion
for training, left-pad prompts for generation):
  f_tokens          [Lp+Lc]  prompt then completion (with EOS), right-padded
  f_loss_weights    [Lp+Lc]  1 on completion tokens, EOS included; 0 on prompt
                             and PAD. Weights mark tokens to be predicted: the
                             logits at t-1 score token t.
  f_positions       [Lp+Lc]  0, 1, ... on real tokens; 0 on PAD
  f_attention_mask  [Lp+Lc]  1 on real tokens, 0 on PAD
  prompt_tokens          [Lp]  the prompt, left-padded (ends at the last slot)
  prompt_attention_mask  [Lp]  1 on prompt tokens
  prompt_positions       [Lp]  0, 1, ... from the first prompt token; 0 on PAD
A trailing EOS on the prompt (T5-style tasks append one) is dropped by default
so that EOS never sits between prompt and completion; with `prompt_bos_id`
set (Llama-style models), that id is put in front of every prompt and Lp
grows by one.

Rankings carry K = `num_completions` rows: every `completions_*` feature has
shape [K, length] and `completions_mask` [K] is 1 on the rows an example
has (best first); missing rows are all PAD with zero loss weights. An example
with more than K completions fails the pipeline instead of being cut.

Scalars of the kind (`margin`, `confidence`, `reward`, `label`) come out as
float32 scalars ([batch] after batching). They are rank 0, so seqio does not
check their length; `get_model_feature_lengths` lists them with length 1.
The converters lay out one example per row; packing several into a row is
the `Packer`'s work, after them (`pipeline.BatchIterator(pack=k)`).

SFT tasks (seqio `inputs`/`targets`) get the same decoder-only layout under
unprefixed names (`tokens`, `loss_weights`, ...) from `sft_feature_converter`
(`DecoderSFTFeatureConverter`); encoder-decoder SFT uses seqio's own
EncDecFeatureConverter.
"""

from typing import Dict, Mapping, Optional

import numpy as np
import seqio
import tensorflow as tf

from jaxrlhf.data import alignment_kinds as kinds_lib
from jaxrlhf.data import names

FeatureSpec = seqio.FeatureConverter.FeatureSpec


def _task_features(kind: kinds_lib.DataKind) -> Dict[str, FeatureSpec]:
  features = {kinds_lib.PROMPT: FeatureSpec(dtype=tf.int32)}
  for field in kind.completion_fields:
    features[field] = (FeatureSpec(dtype=tf.int32, rank=2, sequence_dim=1)
                       if kind.ranked else FeatureSpec(dtype=tf.int32))
  return features


def _sequence_spec(kind: kinds_lib.DataKind) -> FeatureSpec:
  if kind.ranked:
    return FeatureSpec(dtype=tf.int32, rank=2, sequence_dim=1)
  return FeatureSpec(dtype=tf.int32)


def _scalar_and_mask_features(kind: kinds_lib.DataKind):
  features = {name: FeatureSpec(dtype=tf.float32, rank=0)
              for name in kind.scalar_fields}
  if kind.ranked:
    features["completions_mask"] = FeatureSpec(dtype=tf.int32)
  return features


ENCDEC_SUFFIXES = names.ENCDEC_SUFFIXES
DECODER_SUFFIXES = names.DECODER_SUFFIXES
DECODER_PROMPT_FEATURES = ("prompt_tokens", "prompt_attention_mask",
                           "prompt_positions")


def _encdec_model_features(kind: kinds_lib.DataKind) -> Dict[str, FeatureSpec]:
  features = {"encoder_input_tokens": FeatureSpec(dtype=tf.int32)}
  for field in kind.completion_fields:
    for suffix in ENCDEC_SUFFIXES:
      features[f"{field}_{suffix}"] = _sequence_spec(kind)
  features.update(_scalar_and_mask_features(kind))
  return features


def _decoder_model_features(kind: kinds_lib.DataKind) -> Dict[str, FeatureSpec]:
  features = {}
  for field in kind.completion_fields:
    for suffix in DECODER_SUFFIXES:
      features[f"{field}_{suffix}"] = _sequence_spec(kind)
  for name in DECODER_PROMPT_FEATURES:
    features[name] = FeatureSpec(dtype=tf.int32)
  features.update(_scalar_and_mask_features(kind))
  return features


def _right_pad(x: tf.Tensor, length: int) -> tf.Tensor:
  """Right-pads (or trims) the last axis of `x` with 0 to `length`."""
  x = x[..., :length]
  rank = x.shape.rank
  paddings = [[0, 0]] * (rank - 1) + [[0, length - tf.shape(x)[-1]]]
  padded = tf.pad(x, paddings)
  padded.set_shape(x.shape[:-1].concatenate([length]))
  return padded


def _shift_right(targets: tf.Tensor, bos_id: int) -> tf.Tensor:
  """Decoder inputs for unpacked targets [..., L]: BOS, then targets[:-1]."""
  bos = tf.fill(tf.concat([tf.shape(targets)[:-1], [1]], 0),
                tf.constant(bos_id, targets.dtype))
  return tf.concat([bos, targets[..., :-1]], axis=-1)


def _as_rows(x) -> tf.RaggedTensor:
  """A completion [L] or ragged completions [n, None] as ragged [n, None]."""
  if isinstance(x, tf.RaggedTensor):
    return x
  if x.shape.rank == 1:
    return tf.RaggedTensor.from_tensor(x[tf.newaxis])
  return tf.RaggedTensor.from_tensor(x)


class _AlignmentFeatureConverter(seqio.FeatureConverter):
  """Shared checks of the alignment converters; one subclass per kind+arch."""

  KIND: kinds_lib.DataKind
  PACKING_FEATURE_DTYPES = None

  def __init__(self, pack: bool = False, num_completions: Optional[int] = None,
               **kwargs):
    name = type(self).__name__
    if pack:
      raise ValueError(
          f"{name}: the converter lays out one example per row; pack "
          "several per row after it with feature_converters.Packer "
          "(pipeline.BatchIterator(pack=k), config.data.pack), which keeps "
          "an example's completions in one slot of their rows.")
    if self.KIND.ranked:
      if num_completions is None or num_completions < 1:
        raise ValueError(
            f"{name}: num_completions must be a positive int (the K of "
            f"K-wise rankings), got {num_completions!r}.")
    elif num_completions is not None:
      raise ValueError(f"{name}: num_completions only applies to rankings.")
    self.num_completions = num_completions
    super().__init__(pack=False, **kwargs)

  def _check_scalars_present(self, ds: tf.data.Dataset):
    for name, default in self.KIND.scalar_defaults.items():
      # A scalar with a default is optional; `_scalars` fills it in.
      if default is None and name not in ds.element_spec:
        raise ValueError(
            f"{type(self).__name__}: the task's examples have no {name!r} "
            f"feature, which kind {self.KIND.name!r} needs. Register the task "
            "with jaxrlhf.data.alignment_data.register_alignment_task (or "
            "register_file_task) for this kind.")

  def _check_ranking_lengths(self, task_feature_lengths: Mapping[str, int]):
    if not self.KIND.ranked:
      return
    length = task_feature_lengths["completions"]
    if self.num_completions > length:
      # seqio's Task trims a rank-2 feature's FIRST axis to its int length, so
      # with K > length it would drop completions before this converter sees
      # them.
      raise ValueError(
          f"{type(self).__name__}: num_completions={self.num_completions} "
          f"exceeds the 'completions' feature length {length}; seqio trims "
          "the first axis of rank-2 features to that length and would drop "
          "completions. Use a completions length >= num_completions.")

  def _completion_rows(self, x) -> tf.RaggedTensor:
    """[n, None] rows; asserts n <= K for rankings instead of cutting rows."""
    rows = _as_rows(x)
    if self.KIND.ranked:
      with tf.control_dependencies([tf.debugging.assert_less_equal(
          rows.nrows(), tf.cast(self.num_completions, rows.nrows().dtype),
          message=(f"{type(self).__name__}: an example has more completions "
                   f"than num_completions={self.num_completions}"))]):
        rows = tf.identity(rows)
    return rows

  def _scalars(self, features) -> Dict[str, tf.Tensor]:
    return {name: (tf.cast(features[name], tf.float32) if name in features
                   else tf.constant(default, tf.float32))
            for name, default in self.KIND.scalar_defaults.items()}

  def _mask(self, rows: tf.RaggedTensor) -> Dict[str, tf.Tensor]:
    if not self.KIND.ranked:
      return {}
    k = tf.range(self.num_completions, dtype=rows.nrows().dtype)
    return {"completions_mask": tf.cast(k < rows.nrows(), tf.int32)}

  @property
  def _num_rows(self) -> int:
    return self.num_completions if self.KIND.ranked else 1

  def _finish(self, value: tf.Tensor) -> tf.Tensor:
    """Rows [n, L] of a single-completion kind back to [L]."""
    return value if self.KIND.ranked else value[0]

  def _passthrough(self, features, task_feature_lengths):
    return {k: (_right_pad(features[k], task_feature_lengths[k])
                if spec.rank == 1 else features[k])
            for k, spec in self._passthrough_features.items()}

  def _convert_features(self, ds: tf.data.Dataset,
                        task_feature_lengths: Mapping[str, int]
                        ) -> tf.data.Dataset:
    self._check_scalars_present(ds)
    self._check_ranking_lengths(task_feature_lengths)
    lengths = dict(task_feature_lengths)
    return ds.map(lambda ex: self._convert_example(ex, lengths),
                  num_parallel_calls=tf.data.AUTOTUNE)

  def _convert_example(self, features, lengths):
    raise NotImplementedError

  def _scalar_and_mask_lengths(self) -> Dict[str, int]:
    out = {name: 1 for name in self.KIND.scalar_fields}
    if self.KIND.ranked:
      out["completions_mask"] = self.num_completions
    return out


class _EncDecConverter(_AlignmentFeatureConverter):
  """Encoder-decoder features of a kind; see the module docstring."""

  def _convert_example(self, features, lengths):
    out = {"encoder_input_tokens": _right_pad(features[kinds_lib.PROMPT],
                                              lengths[kinds_lib.PROMPT])}
    for field in self.KIND.completion_fields:
      rows = self._completion_rows(features[field])
      targets = self._finish(rows.to_tensor(
          default_value=0, shape=[self._num_rows, lengths[field]]))
      out[f"{field}_decoder_target_tokens"] = targets
      out[f"{field}_decoder_input_tokens"] = _shift_right(targets, self.bos_id)
      out[f"{field}_decoder_loss_weights"] = tf.cast(
          tf.not_equal(targets, 0), tf.int32)
      out.update(self._mask(rows))
    out.update(self._scalars(features))
    out.update(self._passthrough(features, lengths))
    return out

  def get_model_feature_lengths(self, task_feature_lengths: Mapping[str, int]
                                ) -> Mapping[str, int]:
    out = {"encoder_input_tokens": task_feature_lengths[kinds_lib.PROMPT]}
    for field in self.KIND.completion_fields:
      for suffix in ENCDEC_SUFFIXES:
        out[f"{field}_{suffix}"] = task_feature_lengths[field]
    out.update(self._scalar_and_mask_lengths())
    out.update({k: task_feature_lengths[k] for k in self._passthrough_features})
    return out


class _DecoderConverter(_AlignmentFeatureConverter):
  """Decoder-only features of a kind; see the module docstring.

  Args:
    strip_prompt_eos: drop a trailing EOS from the prompt (on by default: a
      T5-style task appends EOS to prompts, and a decoder-only model must not
      read EOS in front of its completion); the prompt then takes one slot
      less than its task feature length (which counts that EOS), so a task
      length of L + 1 lays out prompts of up to L tokens in L slots
      (`models.prompt_feature_length`).
    eos_id: the EOS id to strip (T5's 1 by default).
    prompt_bos_id: when set, this id starts every prompt (Llama-style BOS);
      the prompt length grows by one.
  """

  # The task feature holding the prompt; SFT tasks call it "inputs".
  PROMPT_FEATURE = kinds_lib.PROMPT

  def __init__(self, strip_prompt_eos: bool = True, eos_id: int = 1,
               prompt_bos_id: Optional[int] = None, **kwargs):
    self.strip_prompt_eos = strip_prompt_eos
    self.eos_id = eos_id
    self.prompt_bos_id = prompt_bos_id
    super().__init__(**kwargs)

  def _prompt_length(self, task_feature_lengths) -> int:
    extra = ((0 if self.prompt_bos_id is None else 1)
             - (1 if self.strip_prompt_eos else 0))
    return task_feature_lengths[self.PROMPT_FEATURE] + extra

  def _output_key(self, field: str, suffix: str) -> str:
    """The model feature name of a completion field's sequence feature."""
    return f"{field}_{suffix}"

  def _prompt(self, prompt: tf.Tensor) -> tf.Tensor:
    if self.strip_prompt_eos:
      # prompt[-1:] is empty for an empty prompt, so reduce_any is False.
      ends_in_eos = tf.reduce_any(tf.equal(prompt[-1:], self.eos_id))
      prompt = prompt[:tf.size(prompt) - tf.cast(ends_in_eos, tf.int32)]
    if self.prompt_bos_id is not None:
      prompt = tf.concat([tf.constant([self.prompt_bos_id], prompt.dtype),
                          prompt], axis=0)
    return prompt

  def _convert_example(self, features, lengths):
    prompt_length = self._prompt_length(lengths)
    prompt = self._prompt(features[self.PROMPT_FEATURE])
    prompt = prompt[:prompt_length]
    num_prompt = tf.size(prompt)
    pad = prompt_length - num_prompt
    # Left-padded prompt for generation (detail 5): its last token sits in the
    # last slot, so every row starts sampling at the same index.
    out = {
        "prompt_tokens": tf.concat([tf.zeros([pad], prompt.dtype), prompt], 0),
        "prompt_attention_mask": tf.concat(
            [tf.zeros([pad], tf.int32), tf.ones([num_prompt], tf.int32)], 0),
        "prompt_positions": tf.concat(
            [tf.zeros([pad], tf.int32), tf.range(num_prompt, dtype=tf.int32)],
            0),
    }
    for name in DECODER_PROMPT_FEATURES:
      out[name].set_shape([prompt_length])
    for field in self.KIND.completion_fields:
      rows = self._completion_rows(features[field])
      total = prompt_length + lengths[field]
      prompt_rows = tf.RaggedTensor.from_tensor(
          tf.tile(prompt[tf.newaxis], [rows.nrows(), 1]))
      sequences = tf.concat([prompt_rows, rows], axis=1)
      weights = tf.concat([tf.zeros_like(prompt_rows, tf.int32),
                           tf.ones_like(rows, tf.int32)], axis=1)
      positions = tf.cast(tf.ragged.range(sequences.row_lengths()), tf.int32)
      mask = tf.ones_like(sequences, tf.int32)
      shape = [self._num_rows, total]
      for suffix, value in (("tokens", sequences), ("loss_weights", weights),
                            ("positions", positions),
                            ("attention_mask", mask)):
        out[self._output_key(field, suffix)] = self._finish(
            value.to_tensor(default_value=0, shape=shape))
      out.update(self._mask(rows))
    out.update(self._scalars(features))
    out.update(self._passthrough(features, lengths))
    return out

  def get_model_feature_lengths(self, task_feature_lengths: Mapping[str, int]
                                ) -> Mapping[str, int]:
    prompt_length = self._prompt_length(task_feature_lengths)
    out = {name: prompt_length for name in DECODER_PROMPT_FEATURES}
    for field in self.KIND.completion_fields:
      for suffix in DECODER_SUFFIXES:
        out[self._output_key(field, suffix)] = (
            prompt_length + task_feature_lengths[field])
    out.update(self._scalar_and_mask_lengths())
    out.update({k: task_feature_lengths[k] for k in self._passthrough_features})
    return out


def _converter_class(base, kind: kinds_lib.DataKind, name: str, doc: str):
  model_features = (_encdec_model_features(kind) if base is _EncDecConverter
                    else _decoder_model_features(kind))
  return type(name, (base,), {
      "KIND": kind, "TASK_FEATURES": _task_features(kind),
      "MODEL_FEATURES": model_features, "__doc__": doc,
      "__module__": __name__})


EncDecPairsFeatureConverter = _converter_class(
    _EncDecConverter, kinds_lib.PAIRS, "EncDecPairsFeatureConverter",
    "Preference pairs for encoder-decoder models: `chosen_*`, `rejected_*`, "
    "`margin`, `confidence`.")
EncDecRankingFeatureConverter = _converter_class(
    _EncDecConverter, kinds_lib.RANKING, "EncDecRankingFeatureConverter",
    "K-wise rankings for encoder-decoder models: `completions_*` [K, Lc] and "
    "`completions_mask` [K]; needs num_completions=K.")
EncDecTrajectoryFeatureConverter = _converter_class(
    _EncDecConverter, kinds_lib.TRAJECTORY, "EncDecTrajectoryFeatureConverter",
    "Single trajectories for encoder-decoder models: `completion_*`, "
    "`reward`.")
EncDecThumbsFeatureConverter = _converter_class(
    _EncDecConverter, kinds_lib.THUMBS, "EncDecThumbsFeatureConverter",
    "Thumbs up/down for encoder-decoder models: `completion_*`, `label`.")
DecoderPairsFeatureConverter = _converter_class(
    _DecoderConverter, kinds_lib.PAIRS, "DecoderPairsFeatureConverter",
    "Preference pairs for decoder-only models: `chosen_*`, `rejected_*`, "
    "left-padded `prompt_*`, `margin`, `confidence`.")
DecoderRankingFeatureConverter = _converter_class(
    _DecoderConverter, kinds_lib.RANKING, "DecoderRankingFeatureConverter",
    "K-wise rankings for decoder-only models: `completions_*` [K, Lp+Lc], "
    "`completions_mask` [K], left-padded `prompt_*`; needs "
    "num_completions=K.")
DecoderTrajectoryFeatureConverter = _converter_class(
    _DecoderConverter, kinds_lib.TRAJECTORY,
    "DecoderTrajectoryFeatureConverter",
    "Single trajectories for decoder-only models: `completion_*`, left-padded "
    "`prompt_*`, `reward`.")
DecoderThumbsFeatureConverter = _converter_class(
    _DecoderConverter, kinds_lib.THUMBS, "DecoderThumbsFeatureConverter",
    "Thumbs up/down for decoder-only models: `completion_*`, left-padded "
    "`prompt_*`, `label`.")

_CONVERTERS = {
    ("encoder_decoder", "pairs"): EncDecPairsFeatureConverter,
    ("encoder_decoder", "ranking"): EncDecRankingFeatureConverter,
    ("encoder_decoder", "trajectory"): EncDecTrajectoryFeatureConverter,
    ("encoder_decoder", "thumbs"): EncDecThumbsFeatureConverter,
    ("decoder_only", "pairs"): DecoderPairsFeatureConverter,
    ("decoder_only", "ranking"): DecoderRankingFeatureConverter,
    ("decoder_only", "trajectory"): DecoderTrajectoryFeatureConverter,
    ("decoder_only", "thumbs"): DecoderThumbsFeatureConverter,
}
ARCHITECTURES = ("encoder_decoder", "decoder_only")


def feature_converter_for(kind, architecture: str, **kwargs
                          ) -> seqio.FeatureConverter:
  """The converter for a kind and an architecture.

  Args:
    kind: a DataKind or its name ("pairs", "ranking", "trajectory", "thumbs").
    architecture: "encoder_decoder" or "decoder_only".
    **kwargs: passed to the converter (num_completions for rankings;
      strip_prompt_eos, eos_id, prompt_bos_id for decoder-only).
  """
  kind = kinds_lib.get_kind(kind)
  if architecture not in ARCHITECTURES:
    raise ValueError(f"unknown architecture {architecture!r}; expected one of "
                     f"{ARCHITECTURES}.")
  return _CONVERTERS[(architecture, kind.name)](**kwargs)


# --- SFT: seqio tasks with `inputs` and `targets` -----------------------------

# The layout of an SFT example: the prompt is `inputs`, one completion
# `targets`. Not an alignment kind (there is no file source for it).
_SFT_KIND = kinds_lib.DataKind("sft", ("targets",), {})


class DecoderSFTFeatureConverter(_DecoderConverter):
  """Decoder-only SFT features of a seqio task with `inputs` and `targets`.

  The same layout as the alignment kinds' completions, under the unprefixed
  names the scoring API reads with `name=None`:
    tokens          [Li+Lt]  inputs (trailing EOS dropped) then targets (with
                             their EOS), right-padded
    loss_weights    [Li+Lt]  1 on target tokens, EOS included; 0 on the prompt
                             and PAD (the logits at t-1 score token t)
    positions       [Li+Lt]  0, 1, ... on real tokens; 0 on PAD
    attention_mask  [Li+Lt]  1 on real tokens
    prompt_tokens, prompt_attention_mask, prompt_positions  [Li]  the
                             prompt left-padded, for sampling
  (Li grows by one with `prompt_bos_id`.)

  seqio.PrefixLMFeatureConverter is not used: it keeps the prompt's EOS
  between prompt and target (so the model would read EOS before every
  completion, against PPO-paper detail 3), uses t5x's shifted
  decoder_input/decoder_target pair instead of the one sequence our
  decoder-only scoring adapter reads, and emits positions only when packing.
  """

  KIND = _SFT_KIND
  PROMPT_FEATURE = "inputs"
  TASK_FEATURES = {"inputs": FeatureSpec(dtype=tf.int32),
                   "targets": FeatureSpec(dtype=tf.int32)}
  MODEL_FEATURES = {name: FeatureSpec(dtype=tf.int32)
                    for name in DECODER_SUFFIXES + DECODER_PROMPT_FEATURES}

  def _output_key(self, field: str, suffix: str) -> str:
    del field  # one completion: the scoring API's unprefixed features
    return suffix


def sft_feature_converter(architecture: str, **kwargs
                          ) -> seqio.FeatureConverter:
  """The SFT converter of an architecture for `inputs`/`targets` tasks.

  Args:
    architecture: "encoder_decoder" (seqio.EncDecFeatureConverter, t5x's own
      features) or "decoder_only" (DecoderSFTFeatureConverter).
    **kwargs: for decoder-only: strip_prompt_eos, eos_id, prompt_bos_id.
  """
  if architecture == "encoder_decoder":
    if kwargs:
      raise ValueError(f"sft_feature_converter: {sorted(kwargs)} only apply "
                       "to decoder-only models.")
    return seqio.EncDecFeatureConverter(pack=False)
  if architecture == "decoder_only":
    return DecoderSFTFeatureConverter(**kwargs)
  raise ValueError(f"unknown architecture {architecture!r}; expected one of "
                   f"{ARCHITECTURES}.")


def output_spec(converter: seqio.FeatureConverter, kind,
                task_feature_lengths: Mapping[str, int]
                ) -> Dict[str, tf.TensorSpec]:
  """The shape and dtype of each feature `converter` makes from one example
  of `kind` (a DataKind, its name, or None for seqio `inputs`/`targets`),
  without reading any data: the converter runs on a placeholder example of
  one token per text."""
  if kind is None:
    example = {"inputs": tf.constant([3]), "targets": tf.constant([3])}
  else:
    kind = kinds_lib.get_kind(kind)
    example = {kinds_lib.PROMPT: tf.constant([3])}
    for field in kind.completion_fields:
      example[field] = (tf.ragged.constant([[3]]) if kind.ranked
                        else tf.constant([3]))
    for name, default in kind.scalar_defaults.items():
      if default is None:  # a required scalar
        example[name] = tf.constant(0.0)
  dataset = converter(tf.data.Dataset.from_tensors(example),
                      task_feature_lengths)
  return dict(dataset.element_spec)


# --- Packing: several examples per row -----------------------------------------

# A packed row's slots: [rows, k], 1 where the slot holds an example.
EXAMPLE_MASK = "example_mask"
# Examples the packer reads at a time: each window is packed first-fit into
# as few rows as it needs, its last rows left as full as they came.
PACK_WINDOW = 1024


class Packer:
  """Packs converted examples (one per row) into rows of up to k examples.

  The sequences of one example that belong together (a decoder-only
  completion field's tokens, loss weights, positions and attention mask;
  an encoder-decoder's encoder inputs, and each completion field's decoder
  features) are cut to their real length and laid end to end with other
  examples' in a row of the same length, first-fit: an example goes into
  the first row where every one of its sequences fits and a slot is free.
  Every sequence of the example takes the same slot s of its row, so an
  example's chosen and rejected completions, and its prompt, stay aligned
  by (row, slot). Each sequence gets its segment ids, s + 1 on its tokens
  and 0 on padding (`{field}_segment_ids`; encoder-decoder
  `encoder_segment_ids` and `{field}_decoder_segment_ids`, with t5x's
  positions `encoder_positions`, `{field}_decoder_positions`); positions,
  and the decoder inputs' BOS, already restart at each example. The
  example's scalars (`reward`, `margin`, ...) go to slot s of [k] arrays,
  and `example_mask` [k] marks the slots in use. The left-padded
  `prompt_*` features of decoder-only rows (for sampling) are dropped: a
  packed prompt is read in its completion rows.

  Args:
    spec: {feature: tf.TensorSpec} of one converted example
      (`output_spec`).
    examples_per_row: k.
  """

  def __init__(self, spec: Mapping[str, tf.TensorSpec],
               examples_per_row: int):
    if examples_per_row < 1:
      raise ValueError(f"Packer: examples_per_row must be >= 1, got "
                       f"{examples_per_row}.")
    self.k = examples_per_row
    self.spec = dict(spec)
    # group -> (the feature whose nonzero entries count the real tokens,
    # the features laid out with it, the segment-id and position features).
    self.groups = {}
    self.scalars = []
    for name, value in self.spec.items():
      if name.startswith("prompt_") and value.shape.rank == 1:
        continue
      if value.shape.rank == 0:
        self.scalars.append(name)
      elif name == "completions_mask" or value.shape.rank != 1:
        raise ValueError(
            f"Packer: feature {name!r} of shape {value.shape} cannot be "
            "packed (rankings keep their K completions per row).")
    for name in self.spec:
      if name.startswith("prompt_"):
        continue
      if name.endswith("attention_mask"):
        prefix = name[:-len("attention_mask")]
        self.groups[prefix] = (name, [prefix + s for s in DECODER_SUFFIXES],
                               prefix + "segment_ids", None)
      elif name.endswith("decoder_target_tokens"):
        prefix = name[:-len("decoder_target_tokens")]
        self.groups[prefix + "decoder"] = (
            name, [prefix + s for s in ENCDEC_SUFFIXES],
            prefix + "decoder_segment_ids", prefix + "decoder_positions")
      elif name == "encoder_input_tokens":
        self.groups["encoder"] = (name, [name], "encoder_segment_ids",
                                  "encoder_positions")
    grouped = {f for _, members, _, _ in self.groups.values()
               for f in members}
    left = [n for n in self.spec
            if n not in grouped and n not in self.scalars
            and not n.startswith("prompt_")]
    if left:
      raise ValueError(f"Packer: features {left} belong to no sequence it "
                       "knows how to pack.")
    self.lengths = {g: self.spec[c].shape[0]
                    for g, (c, _, _, _) in self.groups.items()}

  def output_spec(self) -> Dict[str, tf.TensorSpec]:
    """{feature: tf.TensorSpec} of one packed row."""
    out = {}
    for group, (_, members, segments, positions) in self.groups.items():
      length = self.lengths[group]
      for name in members:
        out[name] = self.spec[name]
      for extra in (segments, positions):
        if extra is not None:
          out[extra] = tf.TensorSpec([length], tf.int32)
    for name in self.scalars:
      out[name] = tf.TensorSpec([self.k], self.spec[name].dtype)
    out[EXAMPLE_MASK] = tf.TensorSpec([self.k], tf.int32)
    return out

  def assign(self, real_lengths: Mapping[str, np.ndarray]):
    """First-fit: [(example indices by slot)] per row, for examples of
    `real_lengths` {group: [n]} tokens."""
    count = len(next(iter(real_lengths.values())))
    rows, used = [], []
    for i in range(count):
      need = {g: int(real_lengths[g][i]) for g in self.groups}
      for row, row_used in zip(rows, used):
        if len(row) < self.k and all(row_used[g] + need[g] <= self.lengths[g]
                                     for g in self.groups):
          break
      else:
        row, row_used = [], {g: 0 for g in self.groups}
        rows.append(row)
        used.append(row_used)
      row.append(i)
      for g in self.groups:
        row_used[g] += need[g]
    return rows

  def pack(self, examples: Mapping[str, np.ndarray]
           ) -> Dict[str, np.ndarray]:
    """Examples {feature: [n, ...]} (one per row) -> packed rows
    {feature: [rows, ...]} (`output_spec`)."""
    real = {g: np.count_nonzero(examples[counted], axis=1)
            for g, (counted, _, _, _) in self.groups.items()}
    rows = self.assign(real)
    spec = self.output_spec()
    out = {name: np.zeros((len(rows),) + tuple(value.shape),
                          value.dtype.as_numpy_dtype)
           for name, value in spec.items()}
    for r, row in enumerate(rows):
      for group, (_, members, segments, positions) in self.groups.items():
        start = 0
        for slot, i in enumerate(row):
          n = real[group][i]
          for name in members:
            out[name][r, start:start + n] = examples[name][i, :n]
          out[segments][r, start:start + n] = slot + 1
          if positions is not None:
            out[positions][r, start:start + n] = np.arange(n)
          start += n
      for slot, i in enumerate(row):
        for name in self.scalars:
          out[name][r, slot] = examples[name][i]
        out[EXAMPLE_MASK][r, slot] = 1
    return out

  def __call__(self, ds: tf.data.Dataset,
               window: int = PACK_WINDOW) -> tf.data.Dataset:
    """A dataset of converted examples -> one of packed rows; `window`
    consecutive examples are packed at a time (the last window of a finite
    dataset may be smaller)."""
    names = sorted(self.spec)
    spec = self.output_spec()
    out_names = sorted(spec)

    def pack(*arrays):
      packed = self.pack(dict(zip(names, arrays)))
      return [packed[n] for n in out_names]

    def pack_window(examples):
      values = tf.numpy_function(
          pack, [examples[n] for n in names],
          [spec[n].dtype for n in out_names], stateful=False)
      out = {}
      for name, value in zip(out_names, values):
        value.set_shape([None] + spec[name].shape.as_list())
        out[name] = value
      return out

    return ds.batch(window).map(pack_window).unbatch()


def padding_share(batch: Mapping[str, np.ndarray]) -> float:
  """The share of a batch's token slots that hold padding: over every
  sequence feature that says which tokens are real (decoder-only
  `*attention_mask`, encoder-decoder `encoder_input_tokens` and
  `*decoder_target_tokens`), the `prompt_*` sampling features left out."""
  real = total = 0
  for name, value in batch.items():
    if name.startswith("prompt_"):
      continue
    if name.endswith("attention_mask") or name in (
        "encoder_input_tokens",) or name.endswith("decoder_target_tokens"):
      real += int(np.count_nonzero(value))
      total += value.size
  return 1.0 - real / max(total, 1)
