"""Rollouts of online RL: sample, truncate, score, and shuffle into minibatches.

One rollout batch is assembled from the pure functions of `jaxrlhf.rl`, as
"The N+ implementation details of RLHF with PPO" (details 12, 22-23) does it:

  1. the policy samples a fixed number of tokens per prompt at the sampling
     temperature (it keeps sampling after an EOS; detail 23, step 1);
  2. everything after the first EOS becomes padding (step 2);
  3. the frozen reward model reads its score at the EOS (detail 12), and a
     response without an EOS gets a constant penalty instead (step 3, the
     "EOS trick");
  4. the policy and the frozen reference score the sampled tokens by teacher
     forcing at the same temperature, so that ratios and the KL penalty are
     those of the distribution that was sampled.

Everything here is a jittable function of arrays; models enter through the
scoring API (`jaxrlhf.models.scoring`). The architecture shows only in
`sample_responses` and `response_features` (encoder-decoder so far) and in
the position shift of `logprobs_and_entropy`.
"""

from typing import Dict, Optional

import flax
import jax
import jax.numpy as jnp

from jaxrlhf.losses.sft import token_logprobs
from jaxrlhf.models import heads
from jaxrlhf.models import sampling
from jaxrlhf.rl import kl as kl_lib
from jaxrlhf.rl import ppo as ppo_lib
from jaxrlhf.rl import rollout_rewards


@flax.struct.dataclass
class Rollout:
  """One scored batch of sampled responses.

  `features` holds the scoring API's features of the truncated responses
  (for T5: encoder_input_tokens [batch, Lp] and decoder_target_tokens,
  decoder_input_tokens, decoder_loss_weights [batch, L]).
  """
  features: Dict[str, jax.Array]
  logprobs: jax.Array      # [batch, L] log pi_old at the sampling temperature
  ref_logprobs: jax.Array  # [batch, L] log pi_ref at the same temperature
  entropy: jax.Array       # [batch, L] entropy of pi_old's next-token dist.
  mask: jax.Array          # [batch, L] float32, 1 up to and including the EOS
  has_eos: jax.Array       # [batch] bool
  raw_scores: jax.Array    # [batch] reward model output at the last token
  scores: jax.Array        # [batch] raw_scores with the EOS trick applied


def sample_responses(lm, params, prompt_tokens, rng, *, max_new_tokens: int,
                     temperature: float, eos_id: int):
  """[batch, max_new_tokens] sampled tokens (EOS kept, zeros after it).

  Args:
    lm: a scoring adapter (`scoring.EncoderDecoderLM`).
    params: the policy's parameters.
    prompt_tokens: [batch, Lp] int prompts, right-padded with 0.
    rng: PRNG key.
  """
  if not lm.is_encoder_decoder:
    raise NotImplementedError(
        "online RL samples from encoder-decoder (T5) policies; decoder-only "
        "policies need left-padded prompts and `sampling.sample_decoder_only` "
        "here, and prompt+response features in `response_features`.")
  samples = sampling.sample_encoder_decoder(
      lm.module, params, prompt_tokens, rng, max_new_tokens,
      temperature=temperature, eos_id=eos_id)
  return samples.tokens


def response_features(lm, prompt_tokens, response_tokens, response_mask):
  """Teacher-forcing features of responses to prompts (scoring API names).

  Args:
    prompt_tokens: [batch, Lp] int.
    response_tokens: [batch, L] int, truncated after the EOS.
    response_mask: [batch, L], 1 on real response tokens.
  """
  if not lm.is_encoder_decoder:
    raise NotImplementedError("decoder-only response features: see "
                              "`sample_responses`.")
  targets = response_tokens.astype(jnp.int32)
  # Decoder input t is target t - 1 (position 0 reads BOS = 0).
  inputs = jnp.pad(targets[:, :-1], ((0, 0), (1, 0)))
  return {"encoder_input_tokens": prompt_tokens.astype(jnp.int32),
          "decoder_target_tokens": targets,
          "decoder_input_tokens": inputs,
          "decoder_loss_weights": response_mask.astype(jnp.int32)}


def logprobs_and_entropy(lm, params, batch, name: Optional[str] = None,
                         temperature: float = 1.0):
  """Per-token log-probs and entropies of the completions, one forward pass.

  The log-probs equal `lm.completion_logprobs(params, batch, name,
  temperature)`; the entropy is that of the temperature-scaled next-token
  distribution at each completion position (a metric, and PPO's optional
  bonus). Dropout is always off (detail 7: PPO ratios must be exactly 1
  before the first update).

  Returns:
    (logprobs [batch, L], entropy [batch, L], mask [batch, L]), zero where
    the mask is 0.
  """
  key = (lambda s: s) if name is None else (lambda s: f"{name}_{s}")
  logits = lm.completion_logits(params, batch, name).astype(jnp.float32)
  logits = logits / temperature
  if lm.is_encoder_decoder:
    targets = batch[key("decoder_target_tokens")]
    mask = batch[key("decoder_loss_weights")].astype(jnp.float32)
    logprobs = token_logprobs(logits, targets)
    entropy = ppo_lib.entropy_from_logits(logits)
  else:
    # Position t predicts token t + 1; entry t scores token t.
    tokens = batch[key("tokens")]
    mask = batch[key("loss_weights")].astype(jnp.float32)
    pad = ((0, 0), (1, 0))
    logprobs = jnp.pad(token_logprobs(logits[:, :-1], tokens[:, 1:]), pad)
    entropy = jnp.pad(ppo_lib.entropy_from_logits(logits[:, :-1]), pad)
  return logprobs * mask, entropy * mask, mask


def assemble_rollout(lm, policy_params, reference_params, reward_lm,
                     reward_params, prompt_tokens, response_tokens, *,
                     temperature: float, eos_id: int = 1, pad_id: int = 0,
                     missing_eos_penalty: Optional[float] = -1.0) -> Rollout:
  """Scores sampled responses: truncation, reward at EOS, EOS trick, log-probs.

  Args:
    lm: the policy's scoring adapter (the reference shares it).
    policy_params, reference_params: parameters of pi_old and pi_ref.
    reward_lm: the reward model's scoring adapter.
    reward_params: {"backbone", "head"} of the reward model.
    prompt_tokens: [batch, Lp] int.
    response_tokens: [batch, L] int, possibly with tokens after an EOS
      (they are replaced by `pad_id`, detail 23 step 2).
    temperature: the sampling temperature; both log-probs use it.
    missing_eos_penalty: the score of a response without EOS (detail 23:
      -1); None keeps the reward model's score at the last token.

  Returns:
    A `Rollout`; every array is a constant (no gradient flows into it).
  """
  tokens, mask, has_eos = rollout_rewards.truncate_after_eos(
      response_tokens, eos_id, pad_id)
  features = response_features(lm, prompt_tokens, tokens, mask)
  logprobs, entropy, fmask = logprobs_and_entropy(lm, policy_params, features,
                                                  None, temperature)
  ref_logprobs, _, _ = logprobs_and_entropy(lm, reference_params, features,
                                            None, temperature)
  # The reward head at the last real token: the EOS when there is one.
  raw_scores = heads.sequence_rewards(reward_lm, reward_params, features)
  if missing_eos_penalty is None:
    scores = raw_scores
  else:
    scores = rollout_rewards.replace_score_without_eos(
        raw_scores, has_eos, missing_eos_penalty)
  return jax.lax.stop_gradient(Rollout(
      features=features, logprobs=logprobs, ref_logprobs=ref_logprobs,
      entropy=entropy, mask=fmask, has_eos=has_eos, raw_scores=raw_scores,
      scores=scores))


def rollout_metrics(rollout: Rollout, kl_coef, kl_estimator="k1"):
  """Scalars that describe a rollout batch (the curves of Figure 12).

  "score" is the (EOS-penalised) reward-model score, "kl" the mean
  per-response KL(pi || pi_ref) estimate (k1, summed over tokens) and
  "rlhf_reward" = score - kl_coef * KL with the configured estimator, the
  objective PPO maximises.
  """
  kl_k1 = kl_lib.sequence_kl(rollout.logprobs, rollout.ref_logprobs,
                             rollout.mask, "k1")
  kl_used = kl_lib.sequence_kl(rollout.logprobs, rollout.ref_logprobs,
                               rollout.mask, kl_estimator)
  lengths = jnp.sum(rollout.mask, axis=-1)
  return {
      "score": jnp.mean(rollout.scores),
      "raw_score": jnp.mean(rollout.raw_scores),
      "kl": jnp.mean(kl_k1),
      "rlhf_reward": jnp.mean(rollout.scores - kl_coef * kl_used),
      "eos_rate": jnp.mean(rollout.has_eos.astype(jnp.float32)),
      "response_length": jnp.mean(lengths),
      "rollout_entropy": jnp.sum(rollout.entropy) / jnp.maximum(
          jnp.sum(rollout.mask), 1.0),
  }


def minibatch_indices(rng, num_rows: int, num_epochs: int,
                      num_minibatches: int):
  """Row indices of every minibatch of every epoch: [epochs * minibatches,
  num_rows / num_minibatches] int32.

  Each epoch is a fresh permutation of the rollout batch cut into
  `num_minibatches` consecutive pieces, so every row is used once per epoch.
  """
  if num_rows % num_minibatches:
    raise ValueError(
        f"minibatch_indices: {num_rows} rollout rows do not split into "
        f"{num_minibatches} equal minibatches.")
  keys = jax.random.split(rng, num_epochs)
  perms = jax.vmap(lambda k: jax.random.permutation(k, num_rows))(keys)
  return perms.reshape(num_epochs * num_minibatches,
                       num_rows // num_minibatches).astype(jnp.int32)
