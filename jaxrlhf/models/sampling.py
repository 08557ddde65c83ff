"""Sampling completions from a policy: greedy, temperature, top-k, top-p.

  samples = sample_encoder_decoder(t5_model, params, encoder_input_tokens,
                                   rng, max_new_tokens, temperature=0.7)
  samples = sample_decoder_only(llama_model, params, prompt_tokens,
                                prompt_attention_mask, rng, max_new_tokens,
                                top_p=0.9)

Every sample is drawn for a fixed number of new tokens and then truncated
after its first EOS, with the rest padded with 0, as the PPO
implementation-details paper does (detail 23: "fixed-length response
generation ... truncate after the EOS"); `has_eos` reports which samples
ended. The per-token log-probs returned are those of the distribution the
token was drawn from (temperature-scaled and top-k/top-p filtered; greedy
uses temperature 1), so they can serve as the "old" log-probs of a
policy-gradient ratio when the scorer uses the same temperature.

Both samplers use a KV cache (flax "cache" collection, see the models'
`decode_step`): the prompt (T5: the encoder input; decoder-only: the
left-padded prompt in one prefill pass) is processed once, then each new
token costs one single-position step. They are jit-compiled (the model and
the sampling options are static) and run under a mesh: call them inside
`jax.set_mesh(mesh)` and `flax.linen.logical_axis_rules(rules)` with inputs
sharded over the batch axis, and the models' logical constraints shard the
activations and the cache (batch over data, heads over model).
"""

import dataclasses
import functools
from typing import Any, Callable, Tuple

import flax
import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.models import layers

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


def _check_options(max_new_tokens, temperature, top_k, top_p):
  for name, value in (("temperature", temperature), ("top_k", top_k),
                      ("top_p", top_p)):
    if isinstance(value, jax.Array):
      raise ValueError(f"{name} must be a Python number (the sampler is "
                       f"compiled for it), got a jax array {value!r}.")
  if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be a positive int, got "
                     f"{max_new_tokens!r}.")
  if not temperature >= 0:
    raise ValueError(f"temperature must be >= 0 (0 = greedy), got "
                     f"{temperature!r}.")
  if top_k < 0:
    raise ValueError(f"top_k must be >= 0 (0 = no top-k), got {top_k!r}.")
  if not 0 < top_p <= 1:
    raise ValueError(f"top_p must be in (0, 1], got {top_p!r}.")


def _decode_loop(first_logits: jax.Array, cache: Any,
                 step: Callable[[Any, jax.Array, jax.Array],
                                Tuple[jax.Array, Any]],
                 rng: jax.Array, max_new_tokens: int, temperature: float,
                 top_k: int, top_p: float, greedy: bool,
                 eos_id: int) -> Samples:
  """Draws `max_new_tokens` tokens.

  Args:
    first_logits: [batch, vocab] logits of the first new token.
    cache: the model's KV cache after the prompt.
    step: (cache, token [batch], t) -> (logits [batch, vocab] of token t + 1,
      cache), feeding token t (the t-th new token, 0 after an EOS).
  """
  batch = first_logits.shape[0]

  def choose(logits, key):
    logits = filter_logits(logits, 1.0 if greedy else temperature, top_k,
                           top_p)
    if greedy:
      token = jnp.argmax(logits, axis=-1)
    else:
      token = jax.random.categorical(key, logits, axis=-1)
    token = token.astype(jnp.int32)
    logprob = jnp.take_along_axis(jax.nn.log_softmax(logits), token[:, None],
                                  axis=-1)[:, 0]
    return token, logprob

  def draw(logits, done, rng):
    rng, key = jax.random.split(rng)
    token, logprob = choose(logits, key)
    token = jnp.where(done, 0, token)
    logprob = jnp.where(done, 0.0, logprob)
    return token, logprob, done | (token == eos_id), rng

  def body(carry, t):
    logits, cache, done, rng = carry
    token, logprob, done, rng = draw(logits, done, rng)
    logits, cache = step(cache, token, t)
    return (logits, cache, done, rng), (token, logprob)

  done = jnp.zeros((batch,), bool)
  carry = (first_logits.astype(jnp.float32), cache, done, rng)
  # The last token is drawn outside the loop: feeding it would be wasted.
  if max_new_tokens > 1:
    carry, (tokens, logprobs) = jax.lax.scan(
        body, carry, jnp.arange(max_new_tokens - 1, dtype=jnp.int32))
  else:
    tokens = jnp.zeros((0, batch), jnp.int32)
    logprobs = jnp.zeros((0, batch), jnp.float32)
  logits, _, done, rng = carry
  last, last_logprob, has_eos, _ = draw(logits, done, rng)
  tokens = jnp.concatenate([tokens.T, last[:, None]], axis=1)
  logprobs = jnp.concatenate([logprobs.T, last_logprob[:, None]], axis=1)
  # Real tokens: everything up to and including the first EOS.
  is_eos = tokens == eos_id
  after_eos = (jnp.cumsum(is_eos, axis=-1) - is_eos) > 0
  mask = (~after_eos).astype(jnp.float32)
  return Samples(tokens=tokens, logprobs=logprobs * mask, mask=mask,
                 has_eos=has_eos)


def _jit_static(fn, static_argnames):
  """jax.jit with the model and options static; falls back to the plain
  function (still traceable by an outer jit) when a static value is not
  hashable (e.g. a config holding a list)."""
  jitted = jax.jit(fn, static_argnames=static_argnames)

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    try:
      hash(tuple(kwargs[k] for k in static_argnames if k in kwargs))
    except TypeError:
      return fn(*args, **kwargs)
    return jitted(*args, **kwargs)
  return wrapper


def _inference_module(model):
  # Rematerialisation only matters for gradients; without it the cache
  # updates are plain mutations.
  config = getattr(model, "config", None)
  if getattr(config, "remat_policy", "none") != "none":
    model = model.clone(config=dataclasses.replace(config,
                                                   remat_policy="none"))
  return model


_STATIC = ("model", "max_new_tokens", "temperature", "top_k", "top_p",
           "greedy", "eos_id")


def _sample_encoder_decoder(*, model, params, encoder_input_tokens, rng,
                            max_new_tokens, temperature, top_k, top_p, greedy,
                            eos_id):
  model = _inference_module(model)
  encoder_input_tokens = jnp.asarray(encoder_input_tokens, jnp.int32)
  batch = encoder_input_tokens.shape[0]
  encoded = model.apply({"params": params}, encoder_input_tokens,
                        method=model.encode)
  # Decoder position 0 holds BOS (0); new token t is fed at position t + 1.
  cache_length = max_new_tokens
  bos = jnp.zeros((batch, 1), jnp.int32)
  logits, variables = model.apply(
      {"params": params}, encoded, encoder_input_tokens, bos, 0, cache_length,
      method=model.decode_step, mutable=["cache"])

  def step(cache, token, t):
    logits, variables = model.apply(
        {"params": params, "cache": cache}, None, encoder_input_tokens,
        token[:, None], t + 1, cache_length, method=model.decode_step,
        mutable=["cache"])
    return logits[:, -1].astype(jnp.float32), variables["cache"]

  return _decode_loop(logits[:, -1], variables["cache"], step, rng,
                      max_new_tokens, temperature, top_k, top_p, greedy,
                      eos_id)


_sample_encoder_decoder_jit = _jit_static(_sample_encoder_decoder, _STATIC)


def sample_encoder_decoder(model, params, encoder_input_tokens, rng,
                           max_new_tokens: int, temperature: float = 1.0,
                           top_k: int = 0, top_p: float = 1.0,
                           greedy: bool = False, eos_id: int = 1) -> Samples:
  """Samples completions from a T5 (`jaxrlhf.models.t5.T5`).

  Args:
    model: the T5 module.
    params: its parameters (the tree under "params").
    encoder_input_tokens: int [batch, enc_len] prompts, 0 = padding.
    rng: a PRNG key (unused when greedy).
    max_new_tokens: static number of decoder tokens drawn per row.
    temperature, top_k, top_p: see `filter_logits`; greedy ignores the
      temperature (argmax) but still applies top_k/top_p to the log-probs.
    greedy: argmax decoding; temperature 0 means the same (t5x's
      temperature_sample convention).
    eos_id: the end-of-sequence id.
  Returns:
    Samples with [batch, max_new_tokens] tokens (no BOS; EOS kept, then 0),
    log-probs, mask and [batch] has_eos.
  """
  _check_options(max_new_tokens, temperature, top_k, top_p)
  greedy = greedy or temperature == 0
  return _sample_encoder_decoder_jit(
      model=model, params=params, encoder_input_tokens=encoder_input_tokens,
      rng=rng, max_new_tokens=int(max_new_tokens),
      temperature=float(temperature) if not greedy else 1.0,
      top_k=int(top_k), top_p=float(top_p), greedy=bool(greedy),
      eos_id=int(eos_id))


def _sample_decoder_only(*, model, params, prompt_tokens, prompt_attention_mask,
                         rng, max_new_tokens, temperature, top_k, top_p, greedy,
                         eos_id, bidirectional_prompt):
  model = _inference_module(model)
  prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
  prompt_mask = jnp.asarray(prompt_attention_mask).astype(jnp.int32)
  batch, prompt_length = prompt_tokens.shape
  # Cache positions: the prompt, then new tokens 0 .. max_new_tokens - 2 (the
  # last new token is never fed).
  cache_mask = jnp.concatenate(
      [prompt_mask, jnp.ones((batch, max_new_tokens - 1), jnp.int32)], axis=1)
  positions = layers.positions_from_mask(prompt_mask)
  num_real = jnp.sum(prompt_mask, axis=-1)
  extra = {"bidirectional_prompt": True} if bidirectional_prompt else {}
  logits, variables = model.apply(
      {"params": params}, prompt_tokens, positions, cache_mask, 0,
      method=model.decode_step, mutable=["cache"], **extra)

  def step(cache, token, t):
    position = (num_real + t)[:, None].astype(jnp.int32)
    logits, variables = model.apply(
        {"params": params, "cache": cache}, token[:, None], position,
        cache_mask, prompt_length + t, method=model.decode_step,
        mutable=["cache"])
    return logits.astype(jnp.float32), variables["cache"]

  return _decode_loop(logits, variables["cache"], step, rng, max_new_tokens,
                      temperature, top_k, top_p, greedy, eos_id)


_sample_decoder_only_jit = _jit_static(
    _sample_decoder_only, _STATIC + ("bidirectional_prompt",))


def _check_left_padded(prompt_attention_mask):
  """Rejects right-padded prompts when the mask is concrete (not traced)."""
  if isinstance(prompt_attention_mask, jax.core.Tracer):
    return
  try:
    mask = np.asarray(prompt_attention_mask).astype(bool)
  except Exception:  # pylint: disable=broad-except
    return  # e.g. a non-addressable global array: checked by the caller
  if mask.ndim != 2:
    raise ValueError("prompt_attention_mask must be [batch, length], got "
                     f"shape {mask.shape}.")
  # Left padding: once a row turns real it stays real.
  bad = np.flatnonzero(np.any(mask[:, :-1] & ~mask[:, 1:], axis=-1))
  if bad.size:
    raise ValueError(
        f"sample_decoder_only needs left-padded prompts, but rows "
        f"{bad[:5].tolist()} have padding after a real token. Pad on the "
        "left (the last column must be each prompt's last token).")


def sample_decoder_only(model, params, prompt_tokens, prompt_attention_mask,
                        rng, max_new_tokens: int, temperature: float = 1.0,
                        top_k: int = 0, top_p: float = 1.0,
                        greedy: bool = False, eos_id: int = 1,
                        bidirectional_prompt: bool = False) -> Samples:
  """Samples continuations from a decoder-only model.

  Works with `llama.Llama`, `gpt_neox.GPTNeoX` and
  `t5x_decoder_only.T5xDecoderOnly` (anything with the common
  `decode_step(tokens, positions, attention_mask, cache_index)`).

  Args:
    model: the module.
    params: its parameters (the tree under "params").
    prompt_tokens: int [batch, prompt_len], LEFT-padded: each row's last
      column is its last prompt token.
    prompt_attention_mask: [batch, prompt_len], 1 = real token, 0 = pad.
      Rotary positions come from it (the first real token is position 0).
    rng: a PRNG key (unused when greedy).
    max_new_tokens: static number of tokens drawn per row.
    temperature, top_k, top_p, greedy: as in `sample_encoder_decoder`.
    eos_id: the end-of-sequence id (Llama 3: 128001/128009, Pythia: 0, ...).
    bidirectional_prompt: prefix-LM prefill (t5x decoder-only with
      `inputs_bidirectional_attention=True`); T5xDecoderOnly only.
  Returns:
    Samples of the NEW tokens only: [batch, max_new_tokens] tokens (EOS kept,
    then 0), log-probs, mask, and [batch] has_eos.
  """
  _check_options(max_new_tokens, temperature, top_k, top_p)
  _check_left_padded(prompt_attention_mask)
  greedy = greedy or temperature == 0
  return _sample_decoder_only_jit(
      model=model, params=params, prompt_tokens=prompt_tokens,
      prompt_attention_mask=prompt_attention_mask, rng=rng,
      max_new_tokens=int(max_new_tokens),
      temperature=float(temperature) if not greedy else 1.0,
      top_k=int(top_k), top_p=float(top_p), greedy=bool(greedy),
      eos_id=int(eos_id), bidirectional_prompt=bool(bidirectional_prompt))
