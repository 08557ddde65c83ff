"""KTO (Ethayarajh et al. 2024) on single trajectories or thumbs.

With trajectories, as in the DRO paper's KTO baseline, a completion is
desirable when its reward is above the batch mean. The KL baseline z0 uses
mismatched pairs: prompt i with the completion of example i+1, built in the
step from the batch's own features for either architecture.
"""

from typing import Dict

import jax
import jax.numpy as jnp

from jaxrlhf import config_schema
from jaxrlhf.algorithms import base
from jaxrlhf.algorithms.offline import training
from jaxrlhf.algorithms import policy_eval
from jaxrlhf.algorithms import reference
from jaxrlhf.data import names
from jaxrlhf.losses import preference
from jaxrlhf.models import scoring

Array = jax.Array
F = config_schema.Field

GROUP = config_schema.Group(
    "kto", "KTO (kto on trajectories, kto_thumbs on thumbs up/down).", [
        F("beta", 0.1, "beta of the implicit reward beta * log(pi / pi_ref).",
          bounds=">0"),
        F("desirable_weight", 1.0, "lambda_D of the KTO paper.",
          bounds=">=0"),
        F("undesirable_weight", 1.0, "lambda_U of the KTO paper.",
          bounds=">=0"),
    ])


def mismatched_decoder_sequences(tokens: Array, loss_weights: Array,
                                 attention_mask: Array,
                                 index: Array) -> Dict[str, Array]:
  """Row i's prompt followed by row index[i]'s completion, decoder-only.

  Decoder-only rows hold prompt and completion in one right-padded sequence
  (`feature_converters._DecoderConverter`), so swapping rows is not enough:
  the prompt of row i is cut at its own length and the completion of row
  index[i] is moved to start right after it. The result has the converter's
  layout (PAD 0 after the last real token; positions 0, 1, ... restart
  from the new sequence's start; loss weights on the completion only), so it
  equals what the converter builds for (prompt i, completion index[i]) as
  long as that completion is no longer than the sequence's completion part
  (the task trims completions to their length, so it is).

  Args:
    tokens: [batch, L] prompt then completion, right-padded.
    loss_weights: [batch, L] 1 on completion tokens (EOS included).
    attention_mask: [batch, L] 1 on real tokens.
    index: [batch] int, the row whose completion follows each prompt.
  Returns:
    {"tokens", "loss_weights", "positions", "attention_mask"}: [batch, L]
    each, in the dtypes of the inputs (positions as int32).
  """
  length = tokens.shape[1]
  real = jnp.sum(attention_mask.astype(jnp.int32), axis=-1)
  completion_length = jnp.sum((loss_weights > 0).astype(jnp.int32), axis=-1)
  prompt_length = real - completion_length
  t = jnp.arange(length, dtype=jnp.int32)[None]
  own_prompt = prompt_length[:, None]
  other_start = prompt_length[index][:, None]
  other_length = completion_length[index][:, None]
  # Slot t of the new row reads slot other_start + (t - own_prompt) of the
  # other row; out-of-range slots are masked below, so clipping is safe.
  source = jnp.clip(other_start + t - own_prompt, 0, length - 1)
  other_tokens = jnp.take_along_axis(tokens[index], source, axis=1)
  in_prompt = t < own_prompt
  in_completion = (t >= own_prompt) & (t < own_prompt + other_length)
  in_sequence = in_prompt | in_completion
  zero = jnp.zeros_like(tokens)
  new_tokens = jnp.where(in_prompt, tokens,
                         jnp.where(in_completion, other_tokens, zero))
  return {
      "tokens": new_tokens,
      "loss_weights": in_completion.astype(loss_weights.dtype),
      "positions": jnp.where(in_sequence, t, 0).astype(jnp.int32),
      "attention_mask": in_sequence.astype(attention_mask.dtype),
  }


def with_mismatched_completions(batch):
  """Adds `mismatched_*` completion features: example i's prompt with example
  i+1's completion (`preference.kto_mismatched_indices`).

  Encoder-decoder batches (`completion_decoder_*`) swap the completion rows;
  decoder-only batches (`completion_tokens`, ...) are re-concatenated by
  `mismatched_decoder_sequences`. The prompt features stay as they are.
  """
  out = dict(batch)
  if "completion_tokens" in batch:
    index = preference.kto_mismatched_indices(
        batch["completion_tokens"].shape[0])
    rebuilt = mismatched_decoder_sequences(
        batch["completion_tokens"], batch["completion_loss_weights"],
        batch["completion_attention_mask"], index)
    for suffix in names.DECODER_SUFFIXES:
      out[f"mismatched_{suffix}"] = rebuilt[suffix]
    return out
  if "completion_decoder_target_tokens" not in batch:
    raise ValueError(
        "KTO: the batch has neither decoder-only (completion_tokens) nor "
        "encoder-decoder (completion_decoder_target_tokens) completion "
        f"features; its keys are {sorted(batch)}. Read a trajectory or "
        "thumbs task through the recipe's feature converter.")
  index = preference.kto_mismatched_indices(
      batch["completion_decoder_target_tokens"].shape[0])
  for suffix in names.ENCDEC_SUFFIXES:
    out[f"mismatched_{suffix}"] = batch[f"completion_{suffix}"][index]
  return out


NAMES = ("completion", "mismatched")


def loss(trainer, params, state, batch, rng):
  del rng
  cfg = trainer.config.kto
  batch = with_mismatched_completions(batch)
  pi = scoring.sequence_logprobs(trainer.lm, params["policy"], batch, NAMES)
  ref = reference.reference_logprobs(
      trainer.lm, trainer.precomputed_reference, state, batch, NAMES)
  if "label" in batch:
    desirable = batch["label"] > 0.5
  else:
    desirable = preference.desirable_from_rewards(batch["reward"])
  return preference.kto_loss(
      pi["completion"], ref["completion"], desirable,
      pi["mismatched"], ref["mismatched"], beta=cfg.beta,
      desirable_weight=cfg.desirable_weight,
      undesirable_weight=cfg.undesirable_weight)


ALGORITHM = base.Algorithm(
    name="kto",
    summary="KTO on single trajectories (desirable = reward above the batch "
    "mean, the DRO paper's baseline).",
    data="trajectory",
    networks=reference.POLICY_AND_REFERENCE,
    training=training.Offline(loss=loss, batch_statistics=lambda c: (
        "its KL baseline z0 and which completions are desirable (reward "
        "above the batch mean)")),
    evaluation=policy_eval.AGAINST_REFERENCE,
    config_groups=(GROUP,),
    pipeline_stage=True,
)

THUMBS = base.Algorithm(
    name="kto_thumbs",
    summary="KTO on thumbs up/down labels.",
    data="thumbs",
    networks=reference.POLICY_AND_REFERENCE,
    training=training.Offline(loss=loss,
                             batch_statistics=lambda c: "its KL baseline z0"),
    evaluation=policy_eval.AGAINST_REFERENCE,
    config_groups=(GROUP,),
)

ALGORITHMS = (ALGORITHM, THUMBS)
