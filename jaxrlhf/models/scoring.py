"""One scoring API for encoder-decoder and decoder-only language models.

Every alignment loss consumes per-token log-probs of completions given
prompts, and a mask. `LanguageModel` adapters give both architectures that
one interface, reading the feature names of `jaxrlhf.data.feature_converters`
for a completion field `name` ("chosen", "rejected", "completion", ...; None
for the unprefixed SFT features):

  encoder-decoder: encoder_input_tokens, {name}_decoder_target_tokens,
                   {name}_decoder_input_tokens, {name}_decoder_loss_weights
  decoder-only:    {name}_tokens, {name}_positions, {name}_attention_mask,
                   {name}_loss_weights

Algorithms never branch on architecture: they call `completion_logprobs`,
`completion_hidden` and `prompt_hidden`, and use `score_many` to put several
completions of the same prompts (chosen and rejected) through one
concatenated forward pass.
"""

from typing import Dict, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp


def token_logprobs(logits, targets):
  """log p(target_t) under softmax(logits_t), in float32.

  Args:
    logits: [batch, length, vocab].
    targets: [batch, length] int token ids.
  Returns:
    [batch, length] log-probabilities.
  """
  logits = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return target_logits - log_z


def _key(name: Optional[str], suffix: str) -> str:
  return suffix if name is None else f"{name}_{suffix}"


class _Adapter:
  """Adapters of equal modules (the same family and config) are equal, so
  functions jitted per adapter (evaluation samplers, reward scoring) are
  shared by every run of one model in a process, e.g. a pipeline's stages."""

  def __init__(self, module):
    self.module = module

  def __eq__(self, other):
    return type(other) is type(self) and other.module == self.module

  def __hash__(self):
    return hash((type(self), self.module))


class EncoderDecoderLM(_Adapter):
  """Scoring adapter for `jaxrlhf.models.t5.T5`."""
  is_encoder_decoder = True

  def completion_keys(self, name):
    return [_key(name, s) for s in ("decoder_target_tokens",
                                    "decoder_input_tokens",
                                    "decoder_loss_weights")]

  prompt_keys = ("encoder_input_tokens",)

  def _apply(self, params, batch, name, return_hidden, rng=None):
    deterministic = rng is None
    return self.module.apply(
        {"params": params}, batch["encoder_input_tokens"],
        batch[_key(name, "decoder_input_tokens")],
        batch[_key(name, "decoder_target_tokens")],
        deterministic=deterministic, return_hidden=return_hidden,
        rngs=None if deterministic else {"dropout": rng})

  def completion_logits(self, params, batch, name=None, rng=None):
    """[batch, Lc, vocab] logits; position t predicts target token t."""
    return self._apply(params, batch, name, False, rng)

  def completion_logprobs(self, params, batch, name=None, temperature=1.0,
                          rng=None) -> Tuple[jax.Array, jax.Array]:
    """(log p(target_t | prompt, targets_<t) [batch, Lc], mask [batch, Lc]).

    Logits are divided by `temperature` first, so the log-probs are those of
    the distribution a sampler at that temperature draws from.
    """
    logits = self.completion_logits(params, batch, name, rng)
    logprobs = token_logprobs(logits / temperature,
                              batch[_key(name, "decoder_target_tokens")])
    mask = batch[_key(name, "decoder_loss_weights")].astype(jnp.float32)
    return logprobs * mask, mask

  def completion_hidden(self, params, batch, name=None, rng=None):
    """(states [batch, Lc, emb], mask [batch, Lc]); state t has read target
    tokens < t and, at the last real target (the EOS), the whole completion."""
    hidden = self._apply(params, batch, name, True, rng)
    return hidden, batch[_key(name, "decoder_loss_weights")].astype(jnp.float32)

  def prompt_hidden(self, params, batch, rng=None):
    """(encoder states [batch, Lp, emb], mask [batch, Lp]) of the prompt."""
    tokens = batch["encoder_input_tokens"]
    hidden = self.module.apply({"params": params}, tokens,
                               deterministic=rng is None,
                               rngs=None if rng is None else {"dropout": rng},
                               method=self.module.encode)
    return hidden, (tokens > 0).astype(jnp.float32)


class DecoderOnlyLM(_Adapter):
  """Scoring adapter for decoder-only modules with `hidden_states` and
  `logits_from_hidden` (jaxrlhf.models.llama, gpt_neox, t5x_decoder_only)."""
  is_encoder_decoder = False

  def completion_keys(self, name):
    return [_key(name, s) for s in ("tokens", "positions", "attention_mask",
                                    "loss_weights")]

  prompt_keys = ("prompt_tokens", "prompt_positions", "prompt_attention_mask")

  def _hidden(self, params, tokens, positions, mask):
    return self.module.apply({"params": params}, tokens, positions, mask,
                             method=self.module.hidden_states)

  def completion_logits(self, params, batch, name=None, rng=None):
    """[batch, L, vocab] logits of prompt+completion; position t predicts t+1."""
    del rng  # decoder-only models here have no dropout
    return self.module.apply(
        {"params": params}, batch[_key(name, "tokens")],
        batch[_key(name, "positions")], batch[_key(name, "attention_mask")])

  def completion_logprobs(self, params, batch, name=None, temperature=1.0,
                          rng=None):
    """(log p(token_t | tokens_<t) [batch, L], mask [batch, L]).

    Entry t scores token t (0 at t = 0); the mask is 1 on completion tokens
    (EOS included), so prompt and padding never count.
    """
    logits = self.completion_logits(params, batch, name, rng)
    tokens = batch[_key(name, "tokens")]
    lp = token_logprobs(logits[:, :-1] / temperature, tokens[:, 1:])
    lp = jnp.pad(lp, ((0, 0), (1, 0)))
    mask = batch[_key(name, "loss_weights")].astype(jnp.float32)
    return lp * mask, mask

  def completion_hidden(self, params, batch, name=None, rng=None):
    """(states [batch, L, emb], mask): state t has read tokens <= t, so the
    state at the last completion token (EOS) has read the whole completion."""
    del rng
    hidden = self._hidden(params, batch[_key(name, "tokens")],
                          batch[_key(name, "positions")],
                          batch[_key(name, "attention_mask")])
    return hidden, batch[_key(name, "loss_weights")].astype(jnp.float32)

  def prompt_hidden(self, params, batch, rng=None):
    del rng
    hidden = self._hidden(params, batch["prompt_tokens"],
                          batch["prompt_positions"],
                          batch["prompt_attention_mask"])
    return hidden, batch["prompt_attention_mask"].astype(jnp.float32)


def adapter_for(module):
  """The scoring adapter of a model: EncoderDecoderLM for T5 (anything with
  `encode` and `decode`), DecoderOnlyLM for the decoder-only families."""
  if hasattr(module, "encode") and hasattr(module, "decode"):
    return EncoderDecoderLM(module)
  return DecoderOnlyLM(module)


def concatenate_completions(lm, batch, names: Sequence[str],
                            joined: str = "joined"):
  """A batch with the completions `names` stacked along the batch axis.

  The prompt features are repeated once per name; the result has completion
  field `joined` and len(names) * batch rows, chosen rows first.
  """
  out = {}
  for suffix_key in lm.completion_keys(None):
    parts = [batch[_key(n, suffix_key)] for n in names]
    width = max(p.shape[1] for p in parts)
    parts = [jnp.pad(p, ((0, 0), (0, width - p.shape[1]))) for p in parts]
    out[_key(joined, suffix_key)] = jnp.concatenate(parts, axis=0)
  for key in lm.prompt_keys:
    if key in batch:
      out[key] = jnp.concatenate([batch[key]] * len(names), axis=0)
  return out


def score_many(lm, params, batch, names: Sequence[str], temperature=1.0,
               rng=None) -> Dict[str, Tuple[jax.Array, jax.Array]]:
  """Per-token log-probs and masks of several completions of the same
  prompts, from one forward pass over their concatenation.

  Returns {name: (logprobs [batch, L], mask [batch, L])}, L the longest
  completion length among `names`.
  """
  joined = concatenate_completions(lm, batch, names)
  logprobs, mask = lm.completion_logprobs(params, joined, "joined",
                                          temperature, rng)
  n = len(names)
  return {name: (lp, m) for name, lp, m in zip(
      names, jnp.split(logprobs, n), jnp.split(mask, n))}


def sequence_logprobs(lm, params, batch, names: Sequence[str], rng=None
                      ) -> Dict[str, jax.Array]:
  """{name: [batch] log pi(completion | prompt)} of the completions `names`
  (chosen and rejected, ...) from one forward pass (`score_many`)."""
  scored = score_many(lm, params, batch, names, rng=rng)
  return {n: jnp.sum(lp, axis=-1) for n, (lp, _) in scored.items()}


def completion_lengths(lm, batch, names: Sequence[str]
                       ) -> Dict[str, jax.Array]:
  """{name: [batch] completion tokens (EOS included)}, any architecture."""
  suffix = ("decoder_loss_weights" if lm.is_encoder_decoder
            else "loss_weights")
  return {n: jnp.sum(batch[_key(n, suffix)], axis=-1) for n in names}


def last_token_states(hidden, mask):
  """States at each row's last masked position: [batch, L, E] -> [batch, E].

  For completions this is the EOS, where a reward model reads its score
  (PPO implementation details, detail 12).
  """
  length = mask.shape[-1]
  last = length - 1 - jnp.argmax(mask[:, ::-1] > 0, axis=-1)
  return jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]


def masked_mean_states(hidden, mask):
  """Mean of the states over masked positions: [batch, L, E] -> [batch, E]."""
  m = mask[..., None].astype(hidden.dtype)
  return jnp.sum(hidden * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1)
