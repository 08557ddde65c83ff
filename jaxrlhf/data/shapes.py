"""What an ahead-of-time plan knows of the data without reading it: a
built-in task's vocabulary size, and the shape and dtype of every feature of
a training example, one per row or packed.

A shapes-only trainer (`jaxrlhf.plan`) lays its model and batches out from
these; a run reads the same from its seqio task and feature converters
(`tasks`, `feature_converters`, whose layouts the module docstring of
`feature_converters` describes). tests/test_plan.py holds the two to the
same answers for every kind, architecture and packing, so they cannot
drift. Nothing here imports TensorFlow or seqio: a plan does not load the
data stack.
"""

from typing import Dict, Mapping, Optional, Tuple

import numpy as np

from jaxrlhf.data import alignment_kinds as kinds_lib
from jaxrlhf.data import names
from jaxrlhf.data import synthetic
from jaxrlhf.data import synthetic_arithmetic
from jaxrlhf.data import vocab

# {feature: (shape, dtype)} of one example or packed row (no batch axis).
Spec = Dict[str, Tuple[Tuple[int, ...], np.dtype]]

INT, FLOAT = np.dtype(np.int32), np.dtype(np.float32)
# The left-padded prompt of decoder-only rows, for sampling.
DECODER_PROMPT_FEATURES = ("prompt_tokens", "prompt_attention_mask",
                           "prompt_positions")
# Slots of a packed row in use, [k] (`feature_converters.Packer`).
EXAMPLE_MASK = "example_mask"
ARCHITECTURES = ("encoder_decoder", "decoder_only")


def builtin_vocab_size(task: str) -> Optional[int]:
  """The vocabulary size of the built-in task `task` (`tasks`): its word
  model's pieces, counted without building the seqio vocabulary; None for
  any other task."""
  if task in (names.SYNTHETIC_SUMMARIZE, names.SYNTHETIC_SUMMARIZE_GRADED):
    return vocab.word_vocab_size(synthetic.VOCABULARY_WORDS)
  if task == names.SYNTHETIC_ARITHMETIC:
    return synthetic_arithmetic.vocab_size()
  return None


def files_vocab_size() -> int:
  """The vocabulary size of config.data.files without a vocabulary file:
  the synthetic task's (`file_tasks.files_vocabulary`)."""
  return builtin_vocab_size(names.SYNTHETIC_SUMMARIZE)


def example_spec(kind: Optional[str], architecture: str,
                 lengths: Mapping[str, int],
                 num_completions: Optional[int] = None,
                 strip_prompt_eos: bool = True,
                 prompt_bos_id: Optional[int] = None,
                 eos_id: int = vocab.EOS_ID) -> Spec:
  """{feature: (shape, dtype)} of one example as the feature converter of
  `kind` and `architecture` lays it out (`feature_converters.
  feature_converter_for`, or for `kind` None an SFT task's `inputs` and
  `targets`, `sft_feature_converter`).

  Args:
    kind: a data kind's name ("pairs", "ranking", ...) or None for SFT.
    architecture: "encoder_decoder" or "decoder_only".
    lengths: the task feature lengths: the prompt's ("prompt", or "inputs"
      for SFT) Lp and each completion field's Lc.
    num_completions: K of a ranking (its rows are [K, L]).
    strip_prompt_eos, prompt_bos_id, eos_id: the decoder-only converter's
      options: its prompt takes Lp - 1 slots with the EOS stripped, one more
      with a BOS (`eos_id` changes values only).
  """
  del eos_id
  if architecture not in ARCHITECTURES:
    raise ValueError(f"unknown architecture {architecture!r}; expected one "
                     f"of {ARCHITECTURES}.")
  if kind is None:  # SFT: prompt `inputs`, one completion `targets`
    prompt_field, fields, scalars, rows = "inputs", ("targets",), (), None
  else:
    kind = kinds_lib.get_kind(kind)
    prompt_field, fields = kinds_lib.PROMPT, kind.completion_fields
    scalars = kind.scalar_fields
    rows = num_completions if kind.ranked else None
    if kind.ranked and not num_completions:
      raise ValueError(f"example_spec: kind {kind.name!r} needs "
                       "num_completions (the K of K-wise rankings).")

  def sequence(length):
    return ((length,) if rows is None else (rows, length)), INT

  out = {}
  if architecture == "encoder_decoder":
    out["encoder_input_tokens"] = ((lengths[prompt_field],), INT)
    for field in fields:
      for suffix in names.ENCDEC_SUFFIXES:
        key = suffix if kind is None else f"{field}_{suffix}"
        out[key] = sequence(lengths[field])
  else:
    prompt = (lengths[prompt_field] - (1 if strip_prompt_eos else 0)
              + (0 if prompt_bos_id is None else 1))
    for name in DECODER_PROMPT_FEATURES:
      out[name] = ((prompt,), INT)
    for field in fields:
      for suffix in names.DECODER_SUFFIXES:
        key = suffix if kind is None else f"{field}_{suffix}"
        out[key] = sequence(prompt + lengths[field])
  for name in scalars:
    out[name] = ((), FLOAT)
  if rows is not None:
    out["completions_mask"] = ((rows,), INT)
  return out


def packed_spec(spec: Spec, examples_per_row: int) -> Spec:
  """{feature: (shape, dtype)} of a row packing up to k =
  `examples_per_row` examples of layout `spec` (`feature_converters.
  Packer.output_spec`): each sequence feature keeps its length, with
  segment ids (and an encoder-decoder's positions) beside it; scalars
  become [k]; `example_mask` [k]; the decoder-only `prompt_*` are dropped."""
  out = {}
  for name, (shape, dtype) in spec.items():
    if name.startswith("prompt_") and len(shape) == 1:
      continue
    if len(shape) == 0:
      out[name] = ((examples_per_row,), dtype)
      continue
    if name == "completions_mask" or len(shape) != 1:
      raise ValueError(f"packed_spec: feature {name!r} of shape {shape} "
                       "cannot be packed (rankings keep their K completions "
                       "per row).")
    out[name] = (shape, dtype)
    if name.endswith("attention_mask"):
      out[name[:-len("attention_mask")] + "segment_ids"] = (shape, INT)
    elif name.endswith("decoder_target_tokens"):
      prefix = name[:-len("target_tokens")]
      out[prefix + "segment_ids"] = (shape, INT)
      out[prefix + "positions"] = (shape, INT)
    elif name == "encoder_input_tokens":
      out["encoder_segment_ids"] = (shape, INT)
      out["encoder_positions"] = (shape, INT)
  out[EXAMPLE_MASK] = ((examples_per_row,), INT)
  return out
