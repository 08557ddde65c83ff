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
ended. With `stop_when_done` the decode loop instead stops as soon as every
row has ended (a `lax.while_loop`); the steps it skips would only have
written that padding, so the outputs are the same, at their static
[batch, max_new_tokens] shape, and `num_steps` says how many ran. The
per-token log-probs returned are those of the distribution the token was
drawn from (temperature-scaled and top-k/top-p filtered; greedy uses
temperature 1), so they can serve as the "old" log-probs of a
policy-gradient ratio when the scorer uses the same temperature.

Both samplers use a KV cache (flax "cache" collection, see the models'
`decode_step`): the prompt (T5: the encoder input; decoder-only: the
left-padded prompt in one prefill pass) is processed once, then each new
token costs one single-position step. With `num_samples=k` each prompt is
prefilled once and its cache (and first logits) repeated for its k samples,
which are then decoded as k adjacent rows: the same rows, cache and random
draws as sampling `jnp.repeat(prompts, k, axis=0)`, at 1/k of the prefill.
The decode loop reads the weights in the compute dtype: each one the model
only ever reads cast (the matrices, in bfloat16 with float32 parameters) is
cast once after the prefill (`param_recording.cast_read_params`), not at
every step, and the weights of the projections that read the same input
(query, key and value; a gated MLP's two input projections) are joined
there into one matrix each, in the place of their cast copies
(`param_recording.fuse_projections`; weights read in the dtype they are held in have no copy, and stay apart),
so a step reads each group in one product; the values computed are the
same (the joined products may round their sums differently). With
`cache_segments` > 1 the decode steps run in that many segments, one loop
each, and the KV cache is held in one chunk per segment
(`kv_cache.kv_cache_chunks`: the prompt and the first segment's positions,
then each later segment's): a step reads the chunks written so far, not
the whole, mostly empty, cache of a long generation (the positions it
leaves out are masked, so the outputs are the same; the attention's sums
may round differently). Unset, it is 2 for generations of
`LONG_GENERATION` tokens or more on a GPU, where that was measured to pay,
and 1 elsewhere (`default_cache_segments`).
They are jit-compiled (the model and the sampling options are static) and
run under a mesh: call them inside `jax.set_mesh(mesh)` and
`flax.linen.logical_axis_rules(rules)` with inputs sharded over the batch
axis, and the models' logical constraints shard the activations and the
cache (batch over data, heads over model; a repeated cache keeps them).
"""

import dataclasses
import functools
from typing import Any, Callable, Optional, Tuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.models import moe_decoder
from jaxrlhf.models.layers import kv_cache
from jaxrlhf.models.layers import param_recording
from jaxrlhf.models.layers import rotary

_NEG_INF = -1e30


@flax.struct.dataclass
class Samples:
  tokens: jax.Array     # [batch, max_new_tokens] int32, 0 after the first EOS
  logprobs: jax.Array   # [batch, max_new_tokens] float32, 0 where mask is 0
  mask: jax.Array       # [batch, max_new_tokens] float32, 1 up to the EOS
  has_eos: jax.Array    # [batch] bool
  # int32 [], tokens drawn per row before the loop stopped: max_new_tokens,
  # or fewer with `stop_when_done` (columns from it on are padding). None
  # in Samples built by hand.
  num_steps: jax.Array = None
  # int32 [batch, prompt_len + max_new_tokens, moe layers, top_k]: the
  # experts each token the sampler fed was routed to (a mixture-of-experts
  # model sampled with `record_routes`; `moe_decoder.routes`' layout), -1
  # where no token was fed (the last new token, and the columns a
  # `stop_when_done` loop never ran); None when not recorded.
  routes: jax.Array = None
  # int32 []: sequences the continuous engine preempted for pages (a pool
  # below slots x budget, `engine.generate(num_pages=)`); None otherwise.
  preemptions: jax.Array = None


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


def choose_tokens(logits: jax.Array, key: jax.Array, temperature: float,
                  top_k: int, top_p: float, greedy: bool
                  ) -> Tuple[jax.Array, jax.Array]:
  """One draw per row: (int32 tokens [batch], float32 log-probs [batch])
  from logits [batch, vocab], filtered by `filter_logits` (greedy: argmax,
  at temperature 1, `key` unused), the log-probs those of the filtered
  distribution."""
  logits = filter_logits(logits, 1.0 if greedy else temperature, top_k, top_p)
  if greedy:
    token = jnp.argmax(logits, axis=-1)
  else:
    token = jax.random.categorical(key, logits, axis=-1)
  token = token.astype(jnp.int32)
  logprob = jnp.take_along_axis(jax.nn.log_softmax(logits), token[:, None],
                                axis=-1)[:, 0]
  return token, logprob


def _check_options(max_new_tokens, temperature, top_k, top_p,
                   num_samples=1, cache_segments=1):
  for name, value in (("temperature", temperature), ("top_k", top_k),
                      ("top_p", top_p), ("num_samples", num_samples)):
    if isinstance(value, jax.Array):
      raise ValueError(f"{name} must be a Python number (the sampler is "
                       f"compiled for it), got a jax array {value!r}.")
  if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be a positive int, got "
                     f"{max_new_tokens!r}.")
  # Unset segments are `default_cache_segments`' (a positive int).
  for name, value in (("num_samples", num_samples),
                      ("cache_segments",
                       1 if cache_segments is None else cache_segments)):
    if not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}.")
  if not temperature >= 0:
    raise ValueError(f"temperature must be >= 0 (0 = greedy), got "
                     f"{temperature!r}.")
  if top_k < 0:
    raise ValueError(f"top_k must be >= 0 (0 = no top-k), got {top_k!r}.")
  if not 0 < top_p <= 1:
    raise ValueError(f"top_p must be in (0, 1], got {top_p!r}.")


# Where `cache_segments` is left unset, a generation this long or longer
# runs its decode steps in 2 segments on a GPU: measured on an H100 with a
# Llama 3.2 1B shape in bfloat16 (2,048 new tokens after 64 prompt tokens),
# 2 segments gave 1.11x the tokens/s at batch 64 and 1.14x at 128, 4 gave
# 0.93x at 64 (experiments/results/gpu/README.md). Elsewhere it stays 1:
# on a CPU the extra attention products cost more than the reads saved,
# and on a TPU the speed is unmeasured (its temporaries grow).
LONG_GENERATION = 2048


def default_cache_segments(max_new_tokens: int,
                           platform: Optional[str] = None) -> int:
  """The decode loop's segments when `cache_segments` is unset: 2 for a
  generation of `LONG_GENERATION` tokens or more on a GPU (`platform`,
  default jax's default backend), else 1."""
  platform = platform or jax.default_backend()
  return 2 if platform == "gpu" and max_new_tokens >= LONG_GENERATION else 1


def _segments_or_default(cache_segments, max_new_tokens) -> int:
  if cache_segments is None:
    return default_cache_segments(max_new_tokens)
  return int(cache_segments)


def segment_ends(max_new_tokens: int, segments: int) -> Tuple[int, ...]:
  """The exclusive ends of `segments` near-equal runs of the decode steps
  0 .. max_new_tokens - 2 (at most one per step; max_new_tokens 1 has no
  step: (0,)). Equal runs read the least cache for their number."""
  steps = max_new_tokens - 1
  segments = max(1, min(segments, steps))
  return tuple(steps * (i + 1) // segments for i in range(segments))


def _decode_loop(first_logits: jax.Array, cache: Any,
                 step: Callable[[Any, jax.Array, jax.Array, int],
                                Tuple[jax.Array, Any]],
                 rng: jax.Array, max_new_tokens: int, temperature: float,
                 top_k: int, top_p: float, greedy: bool, eos_id: int,
                 stop_when_done: bool, ends: Tuple[int, ...],
                 records: Optional[jax.Array] = None) -> Samples:
  """Draws `max_new_tokens` tokens.

  Args:
    first_logits: [batch, vocab] logits of the first new token.
    cache: the model's KV cache after the prompt.
    step: (cache, token [batch], t, end) -> (logits [batch, vocab] of token
      t + 1, cache, record [batch, ...] or None), feeding token t (the t-th
      new token, 0 after an EOS); `end` (static) ends t's segment of
      steps, t < end; its record (what it saw feeding token t) goes to
      column t of `records`.
    stop_when_done: stop once every row has drawn its EOS (a while loop)
      instead of always running max_new_tokens - 1 steps (a scan); the
      outputs are the same.
    ends: the segments' ends (`segment_ends`), a loop each, one after the
      other.
    records: None, or [batch, max_new_tokens, ...] the steps' records are
      written into (the columns no step ran keep what it holds); returned
      as `Samples.routes`.
  """
  batch = first_logits.shape[0]

  def draw(logits, done, rng):
    rng, key = jax.random.split(rng)
    token, logprob = choose_tokens(logits, key, temperature, top_k, top_p,
                                   greedy)
    token = jnp.where(done, 0, token)
    logprob = jnp.where(done, 0.0, logprob)
    return token, logprob, done | (token == eos_id), rng

  done = jnp.zeros((batch,), bool)
  first_logits = first_logits.astype(jnp.float32)
  if stop_when_done:
    tokens, logprobs, has_eos, num_steps, records = _decode_until_done(
        first_logits, cache, step, draw, done, rng, max_new_tokens, ends,
        records)
  else:
    tokens, logprobs, has_eos, records = _decode_fixed(
        first_logits, cache, step, draw, done, rng, ends, records)
    num_steps = jnp.int32(max_new_tokens)
  # Real tokens: everything up to and including the first EOS.
  is_eos = tokens == eos_id
  after_eos = (jnp.cumsum(is_eos, axis=-1) - is_eos) > 0
  mask = (~after_eos).astype(jnp.float32)
  return Samples(tokens=tokens, logprobs=logprobs * mask, mask=mask,
                 has_eos=has_eos, num_steps=num_steps, routes=records)


def _record(records, record, t):
  """`records` [batch, columns, ...] with column t set to `record`
  [batch, ...] (None: nothing recorded)."""
  if records is None:
    return None
  start = (jnp.zeros((), jnp.int32), t) + (jnp.zeros((), jnp.int32),) * (
      records.ndim - 2)
  return jax.lax.dynamic_update_slice(records, record[:, None], start)


def _segments(ends):
  """(start, end) of each segment of steps that has a step."""
  return [(start, end) for start, end in zip((0,) + ends[:-1], ends)
          if end > start]


def _decode_fixed(logits, cache, step, draw, done, rng, ends, records):
  """max_new_tokens draws and max_new_tokens - 1 steps (a scan per segment,
  `ends`), whether or not the rows have ended. Returns (tokens, logprobs
  [batch, max_new_tokens], has_eos [batch], records)."""
  batch = logits.shape[0]
  carry = (logits, cache, done, rng, records)
  tokens = [jnp.zeros((0, batch), jnp.int32)]
  logprobs = [jnp.zeros((0, batch), jnp.float32)]
  for start, end in _segments(ends):
    def body(carry, t, end=end):
      logits, cache, done, rng, records = carry
      token, logprob, done, rng = draw(logits, done, rng)
      logits, cache, record = step(cache, token, t, end)
      return (logits, cache, done, rng, _record(records, record, t)), (
          token, logprob)

    carry, (drawn, drawn_logprobs) = jax.lax.scan(
        body, carry, jnp.arange(start, end, dtype=jnp.int32))
    tokens.append(drawn)
    logprobs.append(drawn_logprobs)
  tokens = jnp.concatenate(tokens, axis=0)
  logprobs = jnp.concatenate(logprobs, axis=0)
  # The last token is drawn outside the loop: feeding it would be wasted.
  logits, _, done, rng, records = carry
  last, last_logprob, has_eos, _ = draw(logits, done, rng)
  tokens = jnp.concatenate([tokens.T, last[:, None]], axis=1)
  logprobs = jnp.concatenate([logprobs.T, last_logprob[:, None]], axis=1)
  return tokens, logprobs, has_eos, records


def _decode_until_done(logits, cache, step, draw, done, rng, max_new_tokens,
                       ends, records):
  """`_decode_fixed`'s draws and steps in the same order (so the same rng
  splits and tokens), stopping once every row is done: a step runs only when
  some row still needs the token after it. The columns never drawn keep the
  zeros (token 0, log-prob 0) a finished row's draws would have written.
  A while loop per segment of steps (`ends`): once every row is done, the
  later segments' loops run no step.

  Returns (tokens, logprobs [batch, max_new_tokens], has_eos [batch],
  num_steps int32 []: the columns drawn, records).
  """
  batch = logits.shape[0]
  token, logprob, done, rng = draw(logits, done, rng)
  tokens = jnp.zeros((batch, max_new_tokens), jnp.int32).at[:, 0].set(token)
  logprobs = jnp.zeros((batch, max_new_tokens),
                       jnp.float32).at[:, 0].set(logprob)
  tokens = nn.with_logical_constraint(tokens, ("batch", "length"))
  logprobs = nn.with_logical_constraint(logprobs, ("batch", "length"))

  carry = (token, cache, done, rng, tokens, logprobs, records)
  num_steps = jnp.int32(1)
  for start, end in _segments(ends):
    # Step s draws column s + 1. The counter t (the next column) starts at
    # the literal start + 1, is compared with the literal end + 1 and grows
    # by 1: `jaxrlhf.flops` reads that pattern as the loop's bound, the
    # segment's end - start steps.
    def keep_going(carry, end=end):
      t, done = carry[0], carry[3]
      return (t < end + 1) & ~jnp.all(done)

    def body(carry, end=end):
      t, token, cache, done, rng, tokens, logprobs, records = carry
      logits, cache, record = step(cache, token, t - 1, end)
      records = _record(records, record, t - 1)
      token, logprob, done, rng = draw(logits, done, rng)
      zero = jnp.zeros((), jnp.int32)
      tokens = jax.lax.dynamic_update_slice(tokens, token[:, None],
                                            (zero, t))
      logprobs = jax.lax.dynamic_update_slice(logprobs, logprob[:, None],
                                              (zero, t))
      return t + 1, token, cache, done, rng, tokens, logprobs, records

    t, *carry = jax.lax.while_loop(keep_going, body,
                                   (jnp.int32(start + 1), *carry))
    # A segment after the one where every row ended runs no step.
    num_steps = num_steps + (t - (start + 1))
  _, _, done, _, tokens, logprobs, records = carry
  return tokens, logprobs, done, num_steps, records


def _later_chunks(ends: Tuple[int, ...]) -> Tuple[int, ...]:
  """The KV cache's chunks after the first (`kv_cache.kv_cache_chunks`): one
  per later segment of steps, as long as its steps."""
  return tuple(end - start for start, end in zip(ends[:-1], ends[1:]))


def _repeat_rows(x: jax.Array, num_samples: int, axis: int = 0,
                 logical_axes=None) -> jax.Array:
  """Row i of `x` (along `axis`) becomes rows i * k .. i * k + k - 1,
  `jnp.repeat`'s layout, constrained to `logical_axes` when given."""
  if num_samples == 1:
    return x
  x = jnp.repeat(x, num_samples, axis=axis)
  if logical_axes is not None:
    x = nn.with_logical_constraint(x, logical_axes)
  return x


def _repeat_cache(cache: Any, num_samples: int, batch: int,
                  head_axis: str) -> Any:
  """A prefilled KV cache for `batch` prompts as the cache of their
  batch * num_samples samples (`_repeat_rows` along batch).

  Every cache leaf is a `kv_cache.update_kv_cache` or T5 cross-attention
  array, [batch, heads, length, head_dim], with a leading [layers] axis
  when the layers are scanned; `head_axis` is the heads' logical name
  ("heads" for T5, "kv_heads" for decoder-only models), as they constrain it.
  """
  def repeat(x):
    lead = x.ndim - 4
    if lead not in (0, 1) or x.shape[lead] != batch:
      raise ValueError(
          f"num_samples: a KV-cache entry of shape {x.shape} is not "
          f"[(layers,) batch={batch}, heads, length, head_dim].")
    names = ("layers",) * lead + ("batch", head_axis, "length", "kv")
    return _repeat_rows(x, num_samples, lead, names)
  return jax.tree.map(repeat, cache)


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


def records_routes(model, record: bool) -> bool:
  """Whether a sampler asked to `record` routes (router replay) records
  them for `model`: a mixture-of-experts model's only."""
  return bool(record) and isinstance(model, moe_decoder.MoeCausalLM)


def decode_step(model, variables, *args, routes: bool = False, **kwargs):
  """`model.decode_step(*args, **kwargs)` with the cache mutable: (logits,
  cache, the experts each fed token was routed to [n, length, moe layers,
  top_k] when `routes`, else None)."""
  mutable = ["cache"] + ([moe_decoder.INTERMEDIATES] if routes else [])
  logits, out = model.apply(variables, *args, method=model.decode_step,
                            mutable=mutable, **kwargs)
  return (logits, out["cache"],
          moe_decoder.routes(out[moe_decoder.INTERMEDIATES]) if routes
          else None)


_STATIC = ("model", "max_new_tokens", "temperature", "top_k", "top_p",
           "greedy", "eos_id", "num_samples", "stop_when_done",
           "fuse_projections", "cache_segments")


def _decode_params(params, reads, fusions, fuse_projections):
  """The parameters the decode loop reads: cast once to the dtype of their
  reads, and with `fuse_projections` each layer's query, key and value
  projections (and a gated MLP's input projections) joined where they are
  cast, into the cast copies' place (`param_recording.fuse_projections`),
  from what the prefill recorded."""
  cast = param_recording.cast_read_params(params, reads)
  if fuse_projections:
    cast = param_recording.fuse_projections(cast, fusions, cast_from=params)
  return cast


def _sample_encoder_decoder(*, model, params, encoder_input_tokens, rng,
                            max_new_tokens, temperature, top_k, top_p, greedy,
                            eos_id, num_samples, stop_when_done,
                            fuse_projections, cache_segments):
  model = _inference_module(model)
  encoder_input_tokens = jnp.asarray(encoder_input_tokens, jnp.int32)
  batch = encoder_input_tokens.shape[0]
  # The prefill (the encoder, the cross-attention keys/values and the BOS
  # step) runs once per prompt; its results are repeated for the samples.
  encoded = model.apply({"params": params}, encoder_input_tokens,
                        method=model.encode)
  # Decoder position 0 holds BOS (0); new token t is fed at position t + 1,
  # so the steps of a segment ending at `end` read positions 0 .. end. The
  # cache's first chunk holds the first segment's.
  ends = segment_ends(max_new_tokens, cache_segments)
  bos = jnp.zeros((batch, 1), jnp.int32)
  with param_recording.recording_param_reads() as reads, \
      param_recording.recording_param_fusions() as fusions, \
      kv_cache.kv_cache_chunks(_later_chunks(ends)):
    logits, variables = model.apply(
        {"params": params}, encoded, encoder_input_tokens, bos, 0,
        ends[0] + 1, method=model.decode_step, mutable=["cache"])
  params = _decode_params(params, reads, fusions, fuse_projections)
  logits = _repeat_rows(logits[:, -1], num_samples, 0, ("batch", "vocab"))
  cache = _repeat_cache(variables["cache"], num_samples, batch, "heads")
  encoder_input_tokens = _repeat_rows(encoder_input_tokens, num_samples, 0,
                                      ("batch", "length"))

  def step(cache, token, t, end):
    logits, variables = model.apply(
        {"params": params, "cache": cache}, None, encoder_input_tokens,
        token[:, None], t + 1, end + 1, method=model.decode_step,
        mutable=["cache"])
    return logits[:, -1].astype(jnp.float32), variables["cache"], None

  return _decode_loop(logits, cache, step, rng, max_new_tokens, temperature,
                      top_k, top_p, greedy, eos_id, stop_when_done, ends)


_sample_encoder_decoder_jit = _jit_static(_sample_encoder_decoder, _STATIC)


def sample_encoder_decoder(model, params, encoder_input_tokens, rng,
                           max_new_tokens: int, temperature: float = 1.0,
                           top_k: int = 0, top_p: float = 1.0,
                           greedy: bool = False, eos_id: int = 1,
                           num_samples: int = 1,
                           stop_when_done: bool = False,
                           fuse_projections: bool = True,
                           cache_segments: Optional[int] = None) -> Samples:
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
    num_samples: static k, samples per prompt: the prompts are encoded once
      and row i * k + j of the result is sample j of prompt i, the same
      draws as sampling `jnp.repeat(encoder_input_tokens, k, axis=0)`.
    stop_when_done: static; stop decoding once every row has drawn its EOS
      (the outputs are unchanged, `num_steps` counts the columns drawn).
    fuse_projections: static; the decode loop reads each layer's query,
      key and value weights (and a gated MLP's input weights) joined into
      one matrix, built once after the prefill where the weights are cast
      to a narrower compute dtype (float32 parameters of a bfloat16
      model), in the cast copies' place (`param_recording.fuse_projections`; not
      where LoRA adapters sit on them or a tensor-parallel mesh splits the
      heads or the MLP). The same products, rounded perhaps in another
      order; False reads them apart (for comparison).
    cache_segments: static; the decode steps run in this many segments
      (`segment_ends`: near-equal runs of steps, each its own compiled
      loop) and the KV cache is held in a chunk per segment, so a step
      reads the cache written so far, not the whole cache: the same
      outputs (its sums may round differently), less of the cache read
      in a long generation, for more, smaller attention products (a
      step of segment s reads s + 1 chunks). 1: every step reads the
      whole cache (experiments/bench_sampling.py --segments compares);
      None: `default_cache_segments` (2 for long generations on a GPU).
  Returns:
    Samples with [batch * num_samples, max_new_tokens] tokens (no BOS; EOS
    kept, then 0), log-probs, mask, [batch * num_samples] has_eos and
    num_steps.
  """
  _check_options(max_new_tokens, temperature, top_k, top_p, num_samples,
                 cache_segments)
  greedy = greedy or temperature == 0
  return _sample_encoder_decoder_jit(
      model=model, params=params, encoder_input_tokens=encoder_input_tokens,
      rng=rng, max_new_tokens=int(max_new_tokens),
      temperature=float(temperature) if not greedy else 1.0,
      top_k=int(top_k), top_p=float(top_p), greedy=bool(greedy),
      eos_id=int(eos_id), num_samples=int(num_samples),
      stop_when_done=bool(stop_when_done),
      fuse_projections=bool(fuse_projections),
      cache_segments=_segments_or_default(cache_segments, max_new_tokens))


def _sample_decoder_only(*, model, params, prompt_tokens, prompt_attention_mask,
                         rng, max_new_tokens, temperature, top_k, top_p, greedy,
                         eos_id, num_samples, stop_when_done,
                         fuse_projections, cache_segments,
                         bidirectional_prompt, record_routes):
  model = _inference_module(model)
  # Router replay: record the experts each fed token is routed to.
  record_routes = records_routes(model, record_routes)
  prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
  prompt_mask = jnp.asarray(prompt_attention_mask).astype(jnp.int32)
  batch, prompt_length = prompt_tokens.shape
  # Cache positions: the prompt, then new tokens 0 .. max_new_tokens - 2 (the
  # last new token is never fed).
  cache_mask = jnp.concatenate(
      [prompt_mask, jnp.ones((batch, max_new_tokens - 1), jnp.int32)], axis=1)
  positions = rotary.positions_from_mask(prompt_mask)
  num_real = jnp.sum(prompt_mask, axis=-1)
  extra = {"bidirectional_prompt": True} if bidirectional_prompt else {}
  # Step t writes position prompt_length + t, so the steps of a segment
  # ending at `end` read the positions before prompt_length + end. The
  # cache's first chunk holds the prompt and the first segment's.
  ends = segment_ends(max_new_tokens, cache_segments)
  # One prefill per prompt, repeated for its samples.
  with param_recording.recording_param_reads() as reads, \
      param_recording.recording_param_fusions() as fusions, \
      kv_cache.kv_cache_chunks(_later_chunks(ends)):
    logits, cache, prompt_routes = decode_step(
        model, {"params": params}, prompt_tokens, positions,
        cache_mask[:, :prompt_length + ends[0]], 0, routes=record_routes,
        **extra)
  params = _decode_params(params, reads, fusions, fuse_projections)
  records = None
  if record_routes:
    prompt_routes = _repeat_rows(prompt_routes, num_samples)
    records = jnp.full((batch * num_samples, max_new_tokens)
                       + prompt_routes.shape[2:], -1, jnp.int32)
  logits = _repeat_rows(logits, num_samples, 0, ("batch", "vocab"))
  cache = _repeat_cache(cache, num_samples, batch, "kv_heads")
  cache_mask = _repeat_rows(cache_mask, num_samples, 0, ("batch", "length"))
  num_real = _repeat_rows(num_real, num_samples, 0, ("batch",))

  def step(cache, token, t, end):
    position = (num_real + t)[:, None].astype(jnp.int32)
    logits, cache, record = decode_step(
        model, {"params": params, "cache": cache}, token[:, None], position,
        cache_mask[:, :prompt_length + end], prompt_length + t,
        routes=record_routes)
    return (logits.astype(jnp.float32), cache,
            None if record is None else record[:, 0])

  samples = _decode_loop(logits, cache, step, rng, max_new_tokens,
                         temperature, top_k, top_p, greedy, eos_id,
                         stop_when_done, ends, records)
  if not record_routes:
    return samples
  return samples.replace(routes=jnp.concatenate(
      [prompt_routes, samples.routes], axis=1))


_sample_decoder_only_jit = _jit_static(
    _sample_decoder_only, _STATIC + ("bidirectional_prompt", "record_routes"))


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
                        bidirectional_prompt: bool = False,
                        num_samples: int = 1,
                        stop_when_done: bool = False,
                        fuse_projections: bool = True,
                        cache_segments: Optional[int] = None,
                        record_routes: bool = False) -> Samples:
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
    num_samples: static k, samples per prompt: each prompt is prefilled
      once and row i * k + j of the result is sample j of prompt i, the same
      draws as sampling the prompts repeated with `jnp.repeat(..., k,
      axis=0)`.
    stop_when_done, fuse_projections, cache_segments: as in
      `sample_encoder_decoder`.
    record_routes: static; a mixture-of-experts model
      (`moe_decoder.MoeCausalLM`) records the experts every prompt and new
      token it feeds is routed to, in `Samples.routes` (router replay: the
      trainer routes the same tokens alike); ignored by a dense model.
  Returns:
    Samples of the NEW tokens only: [batch * num_samples, max_new_tokens]
    tokens (EOS kept, then 0), log-probs, mask, [batch * num_samples]
    has_eos, and num_steps; with `record_routes`, their routes over the
    prompt's columns and the new tokens'.
  """
  _check_options(max_new_tokens, temperature, top_k, top_p, num_samples,
                 cache_segments)
  _check_left_padded(prompt_attention_mask)
  greedy = greedy or temperature == 0
  return _sample_decoder_only_jit(
      model=model, params=params, prompt_tokens=prompt_tokens,
      prompt_attention_mask=prompt_attention_mask, rng=rng,
      max_new_tokens=int(max_new_tokens),
      temperature=float(temperature) if not greedy else 1.0,
      top_k=int(top_k), top_p=float(top_p), greedy=bool(greedy),
      eos_id=int(eos_id), num_samples=int(num_samples),
      stop_when_done=bool(stop_when_done),
      fuse_projections=bool(fuse_projections),
      cache_segments=_segments_or_default(cache_segments, max_new_tokens),
      bidirectional_prompt=bool(bidirectional_prompt),
      record_routes=bool(record_routes))
