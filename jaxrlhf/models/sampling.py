"""Sampling completions from a policy: greedy, temperature, top-k, top-p.

Every sample is drawn for a fixed number of new tokens and then truncated
after its first EOS, with the rest padded, as the PPO implementation-details
paper does (detail 23); `has_eos` reports which samples never ended. The
per-token log-probs returned are those of the distribution the token was
drawn from (temperature-scaled and filtered), so they can serve as the
"old" log-probs of a policy-gradient ratio.

This implementation re-runs the decoder over the prefix at each step (no KV
cache): simple and exact, and fast enough for the short completions of the
built-in tasks.
"""

import flax
import jax
import jax.numpy as jnp

_NEG_INF = -1e30


@flax.struct.dataclass
class Samples:
  tokens: jax.Array     # [batch, max_new_tokens] int32, 0 after the first EOS
  logprobs: jax.Array   # [batch, max_new_tokens] float32, 0 where mask is 0
  mask: jax.Array       # [batch, max_new_tokens] float32, 1 up to the EOS
  has_eos: jax.Array    # [batch] bool


def filter_logits(logits, temperature=1.0, top_k=0, top_p=1.0):
  """Temperature-scaled logits with tokens outside top-k / top-p at -inf.

  Args:
    logits: [..., vocab].
    top_k: keep the k largest (0 = all).
    top_p: keep the smallest set of most likely tokens whose probability
      reaches top_p (1.0 = all); the most likely token is always kept.
  """
  logits = logits.astype(jnp.float32) / temperature
  if top_k:
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, _NEG_INF, logits)
  if top_p < 1.0:
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # A token is kept if the mass strictly before it is below top_p.
    before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = before < top_p
    threshold = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf),
                        axis=-1, keepdims=True)
    logits = jnp.where(logits < threshold, _NEG_INF, logits)
  return logits


def sample_encoder_decoder(model, params, encoder_input_tokens, rng,
                           max_new_tokens: int, temperature: float = 1.0,
                           top_k: int = 0, top_p: float = 1.0,
                           greedy: bool = False, eos_id: int = 1) -> Samples:
  """Samples completions from a T5 given prompts [batch, Lp]."""
  batch = encoder_input_tokens.shape[0]
  variables = {"params": params}
  encoded = model.apply(variables, encoder_input_tokens, method=model.encode)
  positions = jnp.arange(max_new_tokens)[None, :]

  def step(t, carry):
    decoder_inputs, tokens, logprobs, done, rng = carry
    logits = model.apply(variables, encoded, encoder_input_tokens,
                         decoder_inputs, method=model.decode)[:, t]
    logits = filter_logits(logits, 1.0 if greedy else temperature, top_k,
                           top_p)
    rng, draw = jax.random.split(rng)
    if greedy:
      token = jnp.argmax(logits, axis=-1)
    else:
      token = jax.random.categorical(draw, logits, axis=-1)
    token = token.astype(jnp.int32)
    lp = jnp.take_along_axis(jax.nn.log_softmax(logits), token[:, None],
                             axis=-1)[:, 0]
    token = jnp.where(done, 0, token)
    lp = jnp.where(done, 0.0, lp)
    tokens = jnp.where(positions == t, token[:, None], tokens)
    logprobs = jnp.where(positions == t, lp[:, None], logprobs)
    decoder_inputs = jnp.where(positions == t + 1, token[:, None],
                               decoder_inputs)
    return decoder_inputs, tokens, logprobs, done | (token == eos_id), rng

  zeros = jnp.zeros((batch, max_new_tokens), jnp.int32)
  _, tokens, logprobs, has_eos, _ = jax.lax.fori_loop(
      0, max_new_tokens, step,
      (zeros, zeros, jnp.zeros((batch, max_new_tokens), jnp.float32),
       jnp.zeros((batch,), bool), rng))
  # Real tokens: everything up to and including the first EOS.
  is_eos = tokens == eos_id
  after_eos = (jnp.cumsum(is_eos, axis=-1) - is_eos) > 0
  mask = (~after_eos).astype(jnp.float32)
  return Samples(tokens=tokens, logprobs=logprobs * mask, mask=mask,
                 has_eos=has_eos)
