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
scoring API (`jaxrlhf.models.scoring`), so the policy and the reward model
may each be encoder-decoder (T5) or decoder-only (Llama, GPT-NeoX, t5x
decoder-only). Prompts always arrive encoder-style (right-padded, ending in
EOS); `response_features` lays them out for each architecture:

  encoder-decoder  the prompt feeds the encoder; the response is the decoder
                   target, every per-token array is [batch, L] as sampled.
  decoder-only     the prompt loses its EOS and is left-padded (detail 5),
                   inside the jitted step, so the response starts at the same
                   column Lp in every row; the scored sequence is
                   [prompt | response] with positions counted from the first
                   real token (left padding shifts no RoPE/learned position).
                   Per-token log-probs, values and masks are returned for the
                   response columns only, so every Rollout array is [batch,
                   L] for both architectures and the losses never see the
                   layout.
"""

from typing import Dict, Optional

import flax
import jax
import jax.numpy as jnp

from jaxrlhf.models import heads
from jaxrlhf.models import engine as engine_lib
from jaxrlhf.models import sampling
from jaxrlhf.models.layers import rotary
from jaxrlhf.rl import kl as kl_lib
from jaxrlhf.rl import rollout_rewards


@flax.struct.dataclass
class Rollout:
  """One scored batch of sampled responses.

  `features` holds the policy's scoring-API features of the truncated
  responses (T5: encoder_input_tokens [batch, Lp] and decoder_target_tokens,
  decoder_input_tokens, decoder_loss_weights [batch, L]; decoder-only:
  tokens, positions, attention_mask, loss_weights [batch, Lp + L] of the
  left-padded prompt followed by the response). `reward_features` are the
  same responses laid out for the reward model's architecture (the same
  dict when it is the policy's). Keys of the two layouts never collide, so
  `dict(reward_features, **features)` carries both into a minibatch.
  """
  features: Dict[str, jax.Array]
  logprobs: jax.Array      # [batch, L] log pi_old at the sampling temperature
  # [batch, L] log pi_ref at the same temperature; a step that weighs no
  # KL term (`kl_control.scores_reference`) puts `logprobs` here (KL 0).
  ref_logprobs: jax.Array
  entropy: jax.Array       # [batch, L] entropy of pi_old's next-token dist.
  mask: jax.Array          # [batch, L] float32, 1 up to and including the EOS
  has_eos: jax.Array       # [batch] bool
  raw_scores: jax.Array    # [batch] reward model output at the last token
  scores: jax.Array        # [batch] raw_scores with the EOS trick applied
  reward_features: Dict[str, jax.Array] = None
  # [batch, num rewards] each reward source's value (NaN: it does not
  # apply); `scores` is then their weighted sum. None = the reward model's
  # score alone.
  rewards: jax.Array = None
  # int32 [] decode steps the sampler ran (fewer than the response length
  # when it stopped once every response had ended); None = not recorded.
  decode_steps: jax.Array = None
  # int32 [] sequences the continuous engine preempted for pages
  # (`Samples.preemptions`); None = not counted.
  preemptions: jax.Array = None
  # [batch, L] the sampler's own log-probs of the tokens it drew (at the
  # sampling temperature, 0 where `mask` is 0), beside `logprobs`, the
  # trainer's scoring of the same tokens: their gap is what importance
  # sampling corrects (`jaxrlhf.rl.importance_sampling`). None = not kept.
  sample_logprobs: jax.Array = None
  # [batch, L] a distillation teacher's log-probs of the tokens at the
  # sampling temperature (0 where `mask` is 0); None = no teacher.
  teacher_logprobs: jax.Array = None
  # The responses laid out for the teacher's architecture when it is not
  # the policy's (None: `features` serve it).
  teacher_features: Dict[str, jax.Array] = None
  # int32 [batch, Lp + L, moe layers, top_k]: the experts the sampler
  # routed each token of `features` to, which the policy's scoring
  # (`logprobs`) and the updates replay (router replay,
  # `sampling.Samples.routes`); None = each forward pass routes itself.
  routes: jax.Array = None
  # [batch, L] the policy's scoring without replaying `routes`
  # (`online.router_replay_gap`: the gap replay closes); None = not made.
  unreplayed_logprobs: jax.Array = None


# The update rows' key of the routes the policy's forward passes replay
# (`Rollout.routes`, `policy_logprobs`).
ROUTES = "routes"


def left_pad_prompts(prompt_tokens, eos_id: int = 1, pad_id: int = 0):
  """Encoder-style prompts as decoder-only prompts, traceable inside jit.

  The trailing EOS is dropped (a decoder-only model must not read EOS
  between prompt and response) and each row is shifted right so that its
  last token sits in the last column ("N+ implementation details", detail
  5: left-pad the queries for generation). The same layout as
  `jaxrlhf.eval.evaluation.left_pad_prompts`, at a fixed shape.

  Args:
    prompt_tokens: [batch, Lp] int, right-padded with `pad_id`.
    eos_id: the EOS id a prompt may end with.
    pad_id: the padding id.

  Returns:
    (tokens [batch, Lp] int32 left-padded, attention_mask [batch, Lp] int32,
    1 on prompt tokens).
  """
  tokens = jnp.asarray(prompt_tokens).astype(jnp.int32)
  if tokens.ndim != 2:
    raise ValueError(f"left_pad_prompts: prompt_tokens must be [batch, "
                     f"length], got shape {tokens.shape}.")
  width = tokens.shape[1]
  columns = jnp.arange(width, dtype=jnp.int32)
  # Real length: one past the last non-pad token (right padding).
  length = jnp.max(jnp.where(tokens != pad_id, columns + 1, 0), axis=-1)
  last = jnp.take_along_axis(tokens, jnp.maximum(length - 1, 0)[:, None],
                             axis=-1)[:, 0]
  length = length - ((length > 0) & (last == eos_id)).astype(jnp.int32)
  # Column j of the result is column j - (Lp - length) of the input.
  source = columns[None, :] - (width - length)[:, None]
  real = source >= 0
  gathered = jnp.take_along_axis(tokens, jnp.maximum(source, 0), axis=-1)
  return (jnp.where(real, gathered, jnp.int32(pad_id)),
          real.astype(jnp.int32))


def counts_preemptions(engine: str, engine_pages: Optional[int]) -> bool:
  """Whether `sample_responses` returns `Samples.preemptions`: the
  continuous engine on a pool of `engine_pages` (below the default pool
  it may preempt)."""
  return engine == "continuous" and engine_pages is not None


def sample_responses(lm, params, prompt_tokens, rng, *, max_new_tokens: int,
                     temperature: float, eos_id: int, num_samples: int = 1,
                     stop_when_done: bool = False,
                     cache_segments: Optional[int] = None,
                     record_routes: bool = False,
                     engine: str = "lockstep",
                     engine_slots: Optional[int] = None,
                     engine_page_size: Optional[int] = None,
                     engine_pages: Optional[int] = None
                     ) -> sampling.Samples:
  """The policy's samples for the prompts, with their log-probs and stats.

  Args:
    lm: a scoring adapter (`scoring.EncoderDecoderLM` or `DecoderOnlyLM`).
    params: the policy's parameters.
    prompt_tokens: [batch, Lp] int prompts, right-padded with 0
      (encoder-style; decoder-only policies see them left-padded without
      their EOS, see `left_pad_prompts`).
    rng: PRNG key.
    num_samples: static k, responses per prompt: each prompt is prefilled
      once; row i * k + j is response j to prompt i, the same draws as
      sampling `jnp.repeat(prompt_tokens, k, axis=0)` with num_samples=1.
    stop_when_done: static; stop decoding once every response has ended
      (same outputs; `Samples.num_steps` counts the columns drawn).
    cache_segments: static; the decode loop's segments, each reading the
      KV cache written so far (`sampling.sample_encoder_decoder`; None:
      `sampling.default_cache_segments`).
    record_routes: static; a decoder-only mixture-of-experts policy
      records its routing (`sampling.sample_decoder_only`), over the
      columns of `response_features`' rows.
    engine: static; 'lockstep' (`sampling`) or 'continuous'
      (`engine.generate` over the prompts repeated num_samples times, the
      same draws as lockstep's; decoder-only, routes recorded
      as lockstep's, a mixture-of-experts policy on pages only;
      stop_when_done and cache_segments do not apply, and `num_steps`
      counts the engine's decode steps).
    engine_slots: static; continuous: the decode slots (None:
      `engine.default_slots`, a quarter of the batch * num_samples rows).
    engine_page_size: static; continuous: the slots' caches as pages of
      this many positions (`engine.generate`'s page_size; None:
      contiguous); a prompt's num_samples samples then share its prefill
      and pages (`group_size`) when they divide the slots.
    engine_pages: static; continuous on pages: the pool's pages
      (`engine.generate`'s num_pages; None: enough for every slot's
      longest sequence); fewer preempt the youngest sequences.

  Returns:
    `sampling.Samples` of [batch * num_samples, max_new_tokens].
  """
  if engine == "continuous":
    if lm.is_encoder_decoder:
      raise ValueError(
          "online.engine='continuous' decodes decoder-only policies; set "
          "online.engine='lockstep'.")
    tokens, mask = left_pad_prompts(prompt_tokens, eos_id)
    tokens, mask = (jnp.repeat(x, num_samples, axis=0)
                    for x in (tokens, mask))
    group = num_samples if engine_page_size else 1
    slots = engine_slots or engine_lib.default_slots(tokens.shape[0], group)
    group = group if slots % group == 0 else 1
    if engine_pages is not None:
      least = engine_lib.least_pages(tokens.shape[1], max_new_tokens,
                                     engine_page_size, group)
      if engine_pages < least:
        raise ValueError(
            f"online.engine_pages={engine_pages}: the continuous engine's "
            f"pool needs at least {least} pages of {engine_page_size} "
            f"positions for a prompt of {tokens.shape[1]} tokens and "
            f"{max_new_tokens} new ones (one longest sequence, which goes "
            "on when every other is preempted); give it that many or "
            "more, or unset it.")
    samples, stats = engine_lib.generate(
        lm.module, params, tokens, mask, rng, slots, max_new_tokens,
        temperature=temperature, eos_id=eos_id, page_size=engine_page_size,
        num_pages=engine_pages, group_size=group,
        record_routes=record_routes)
    return samples.replace(
        num_steps=stats.decode_steps,
        preemptions=(stats.preemptions if counts_preemptions(
            engine, engine_pages) else None))
  options = dict(temperature=temperature, eos_id=eos_id,
                 num_samples=num_samples, stop_when_done=stop_when_done,
                 cache_segments=cache_segments)
  if lm.is_encoder_decoder:
    return sampling.sample_encoder_decoder(
        lm.module, params, prompt_tokens, rng, max_new_tokens, **options)
  tokens, mask = left_pad_prompts(prompt_tokens, eos_id)
  return sampling.sample_decoder_only(
      lm.module, params, tokens, mask, rng, max_new_tokens,
      record_routes=record_routes, **options)


def response_features(lm, prompt_tokens, response_tokens, response_mask,
                      eos_id: int = 1, *, response_attention=None,
                      prompt_mask=None):
  """Teacher-forcing features of responses to prompts (scoring API names).

  Args:
    lm: the scoring adapter the features are for.
    prompt_tokens: [batch, Lp] int, encoder-style (right-padded).
    response_tokens: [batch, L] int, truncated after the EOS.
    response_mask: [batch, L], 1 on real response tokens.
    eos_id: the EOS a prompt may end with (dropped for decoder-only).
    response_attention: decoder-only: [batch, L], 1 on every response
      token the model reads, of which `response_mask` marks those that
      carry loss (a multi-turn episode's: its environment's tokens are
      read, not trained); None = `response_mask`.
    prompt_mask: decoder-only: given, `prompt_tokens` are already
      left-padded (an episode's opening, which may end in any id) with this
      [batch, Lp] mask, and are taken as they are.

  Returns:
    encoder-decoder: encoder_input_tokens [batch, Lp], decoder_target_tokens,
      decoder_input_tokens, decoder_loss_weights [batch, L].
    decoder-only: tokens, positions, attention_mask, loss_weights
      [batch, Lp + L]; the response occupies the last L columns.
  """
  targets = response_tokens.astype(jnp.int32)
  weights = response_mask.astype(jnp.int32)
  if lm.is_encoder_decoder:
    if response_attention is not None or prompt_mask is not None:
      raise ValueError("response_features: multi-turn features are "
                       "decoder-only; an encoder-decoder reads its prompt "
                       "in the encoder.")
    # Decoder input t is target t - 1 (position 0 reads BOS = 0).
    inputs = jnp.pad(targets[:, :-1], ((0, 0), (1, 0)))
    return {"encoder_input_tokens": prompt_tokens.astype(jnp.int32),
            "decoder_target_tokens": targets,
            "decoder_input_tokens": inputs,
            "decoder_loss_weights": weights}
  if prompt_mask is None:
    prompt, prompt_mask = left_pad_prompts(prompt_tokens, eos_id)
  else:
    prompt = prompt_tokens.astype(jnp.int32)
    prompt_mask = prompt_mask.astype(jnp.int32)
  read = weights if response_attention is None else (
      response_attention.astype(jnp.int32))
  attention_mask = jnp.concatenate([prompt_mask, read], axis=1)
  return {"tokens": jnp.concatenate([prompt, targets], axis=1),
          # From the mask: the first real token is position 0 however much
          # left padding precedes it (the RM and SFT saw right-padded rows
          # starting at 0; detail 14).
          "positions": rotary.positions_from_mask(attention_mask),
          "attention_mask": attention_mask,
          "loss_weights": jnp.concatenate([jnp.zeros_like(prompt_mask),
                                           weights], axis=1)}


def response_tokens(lm, features, length: int):
  """[batch, L] the response tokens of `response_features` for `lm` (the
  last L = `length` columns of a decoder-only row)."""
  if lm.is_encoder_decoder:
    return features["decoder_target_tokens"]
  return features["tokens"][:, -length:]


def logprobs_and_entropy(lm, params, batch, name: Optional[str] = None,
                         temperature: float = 1.0,
                         response_length: Optional[int] = None,
                         routes: Optional[jax.Array] = None):
  """Per-token log-probs and entropies of the completions, one forward pass.

  The log-probs equal `lm.completion_logprobs(params, batch, name,
  temperature)`; the entropy is that of the temperature-scaled next-token
  distribution at each completion position (a metric, and PPO's optional
  bonus). Dropout is always off (detail 7: PPO ratios must be exactly 1
  before the first update).

  Args:
    response_length: for decoder-only models, keep only the last this many
      columns (the response of `response_features`); None keeps all.
    routes: routes a mixture-of-experts model replays (`Rollout.routes`),
      or None.

  Returns:
    (logprobs [batch, L], entropy [batch, L], mask [batch, L]), zero where
    the mask is 0; L is the whole feature length unless `response_length`.
  """
  key = (lambda s: s) if name is None else (lambda s: f"{name}_{s}")
  if lm.is_encoder_decoder:
    if routes is not None:
      raise ValueError("logprobs_and_entropy: routes are replayed by "
                       "decoder-only mixture-of-experts models only.")
    mask = batch[key("decoder_loss_weights")].astype(jnp.float32)
    stats = lm.next_token_stats(params, batch, name, temperature,
                                with_entropy=True)
    logprobs, entropy = stats.logprobs, stats.entropy
  else:
    # Position t predicts token t + 1; entry t scores token t. The logits
    # are formed a chunk of positions at a time (`next_token_stats`): a
    # rollout's [batch, L, vocab] float32 logits would be the largest
    # array of an online step with a large vocabulary.
    mask = batch[key("loss_weights")].astype(jnp.float32)
    stats = lm.next_token_stats(params, batch, name, temperature,
                                with_entropy=True, last=response_length,
                                routes=routes)
    logprobs, entropy = stats.logprobs, stats.entropy
    if response_length is None:
      pad = ((0, 0), (1, 0))
      logprobs, entropy = jnp.pad(logprobs, pad), jnp.pad(entropy, pad)
    else:
      # Only the response's columns (saves the entropy's softmax over the
      # prompt).
      mask = mask[:, mask.shape[1] - response_length:]
  return logprobs * mask, entropy * mask, mask


def update_rows(rollout: Rollout) -> Dict[str, jax.Array]:
  """The policy's part of the rows the updates train on: the rollout's
  features, and the routes its forward passes replay (`ROUTES`) where the
  sampler recorded them."""
  if rollout.routes is None:
    return dict(rollout.features)
  return dict(rollout.features, **{ROUTES: rollout.routes})


def policy_logprobs(lm, params, rows, temperature: float,
                    response_length: int):
  """The policy's `logprobs_and_entropy` of update rows (a minibatch of
  `Rollout.features` and the targets), replaying the sampler's routing
  where the rows carry it (`ROUTES`)."""
  return logprobs_and_entropy(lm, params, rows, None, temperature,
                              response_length, routes=rows.get(ROUTES))


def response_values(lm, value_params, features, response_length: int):
  """V(s_t) of every response token t, from a value network (PPO). [batch, L].

  s_t is the state that produced token t: it has read the prompt and the
  response tokens before t. An encoder-decoder's decoder state t has read
  exactly that (its input is the target shifted right). A decoder-only
  state at column c has read tokens <= c, so the value of the response
  token at column Lp + t is read at column Lp + t - 1, one position before
  it (for t = 0 the last prompt token); as `values[:, context_length - 1:
  -1]` in the PPO implementation-details reference code.

  Args:
    lm: the value network's scoring adapter (the reward model's
      architecture: it is initialised from the reward model, detail 22).
    value_params: {"backbone", "head"}.
    features: `response_features` for `lm`.
    response_length: L.
  """
  if lm.is_encoder_decoder:
    return heads.token_values(lm, value_params, features)
  hidden, mask = lm.completion_hidden(value_params["backbone"], features)
  start = hidden.shape[1] - response_length
  states = hidden[:, start - 1:-1]
  return heads.apply_scalar_head(value_params["head"], states) * mask[:, start:]


def assemble_rollout(lm, policy_params, reference_params, reward_lm,
                     reward_params, prompt_tokens, response_tokens, *,
                     temperature: float, eos_id: int = 1, pad_id: int = 0,
                     missing_eos_penalty: Optional[float] = -1.0,
                     episodes=None, routes=None) -> Rollout:
  """Scores sampled responses: truncation, reward at EOS, EOS trick, log-probs.

  Args:
    lm: the policy's scoring adapter (the reference shares it).
    policy_params, reference_params: parameters of pi_old and pi_ref;
      reference_params None when no KL term is weighed: the reference's
      forward pass is skipped and `ref_logprobs` are pi_old's (every KL 0).
    reward_lm: the reward model's scoring adapter (either architecture), or
      None for a run without one (its raw scores and scores are then 0:
      the caller adds the rewards it has).
    reward_params: {"backbone", "head"} of the reward model (or None).
    prompt_tokens: [batch, Lp] int, encoder-style (right-padded).
    response_tokens: [batch, L] int, possibly with tokens after an EOS
      (they are replaced by `pad_id`, detail 23 step 2).
    temperature: the sampling temperature; both log-probs use it.
    missing_eos_penalty: the score of a response without EOS (detail 23:
      -1); None keeps the reward model's score at the last token.
    episodes: multi-turn episodes instead of responses, (opening mask
      [batch, Lp], read [batch, L], model [batch, L], ended [batch]):
      `prompt_tokens` are their left-padded openings and
      `response_tokens` their conversations, taken as they are (no cut
      after an EOS: a turn ends at its end-of-turn id); the log-probs and
      the mask cover the model's tokens, the environment's are read
      (`jaxrlhf.agents.episodes.Assembled`).
    routes: the sampler's routing of the rows (`sampling.Samples.routes`),
      which the policy's scoring replays (a mixture-of-experts policy), or
      None; kept in `Rollout.routes` for the updates.

  Returns:
    A `Rollout` whose per-token arrays are [batch, L]; every array is a
    constant (no gradient flows into it).
  """
  layout = {}
  if episodes is None:
    tokens, mask, has_eos = rollout_rewards.truncate_after_eos(
        response_tokens, eos_id, pad_id)
  else:
    opening_mask, read, mask, has_eos = episodes
    tokens = response_tokens
    layout = dict(response_attention=read, prompt_mask=opening_mask)
  length = tokens.shape[1]
  features = response_features(lm, prompt_tokens, tokens, mask, eos_id,
                               **layout)
  if reward_lm is None or (
      reward_lm.is_encoder_decoder == lm.is_encoder_decoder):
    reward_features = features
  elif episodes is not None:
    raise ValueError("assemble_rollout: a reward model of another "
                     "architecture cannot score multi-turn episodes.")
  else:
    reward_features = response_features(reward_lm, prompt_tokens, tokens, mask,
                                        eos_id)
  logprobs, entropy, fmask = logprobs_and_entropy(lm, policy_params, features,
                                                  None, temperature, length,
                                                  routes=routes)
  if reference_params is None:
    ref_logprobs = logprobs
  else:
    ref_logprobs, _, _ = logprobs_and_entropy(lm, reference_params, features,
                                              None, temperature, length)
  # The reward head at the last real token: the EOS when there is one.
  if reward_lm is None:
    raw_scores = jnp.zeros(has_eos.shape, jnp.float32)
  else:
    raw_scores = heads.sequence_rewards(reward_lm, reward_params,
                                        reward_features)
  if missing_eos_penalty is None or reward_lm is None:
    scores = raw_scores
  else:
    scores = rollout_rewards.replace_score_without_eos(
        raw_scores, has_eos, missing_eos_penalty)
  return jax.lax.stop_gradient(Rollout(
      features=features, logprobs=logprobs, ref_logprobs=ref_logprobs,
      entropy=entropy, mask=fmask, has_eos=has_eos, raw_scores=raw_scores,
      scores=scores, reward_features=reward_features, routes=routes))


def rollout_metrics(rollout: Rollout, kl_coef=None, kl_estimator="k1",
                    reference_scored: bool = True):
  """Scalars that describe a rollout batch (the curves of Figure 12).

  "score" is the (EOS-penalised) score, "kl" the mean per-response
  KL(pi || pi_ref) estimate (k1, summed over tokens; left out when the
  reference did not score the rollout: `reference_scored` False) and, for
  an algorithm with a KL coefficient, "rlhf_reward" = score - kl_coef * KL
  with the configured estimator, the objective PPO maximises.
  """
  lengths = jnp.sum(rollout.mask, axis=-1)
  metrics = {} if rollout.decode_steps is None else {
      "decode_steps": rollout.decode_steps.astype(jnp.float32)}
  if rollout.preemptions is not None:
    metrics["engine/preemptions"] = rollout.preemptions.astype(jnp.float32)
  metrics.update({
      "score": jnp.mean(rollout.scores),
      "raw_score": jnp.mean(rollout.raw_scores),
      "eos_rate": jnp.mean(rollout.has_eos.astype(jnp.float32)),
      "response_length": jnp.mean(lengths),
      "rollout_entropy": jnp.sum(rollout.entropy) / jnp.maximum(
          jnp.sum(rollout.mask), 1.0),
  })
  if reference_scored:
    metrics["kl"] = jnp.mean(kl_lib.sequence_kl(
        rollout.logprobs, rollout.ref_logprobs, rollout.mask, "k1"))
  if kl_coef is not None:
    kl_used = kl_lib.sequence_kl(rollout.logprobs, rollout.ref_logprobs,
                                 rollout.mask, kl_estimator)
    metrics["rlhf_reward"] = jnp.mean(rollout.scores - kl_coef * kl_used)
  return metrics


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
