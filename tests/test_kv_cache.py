"""KV-cache sampling against full forward passes, t5x and transformers.

The truths: (1) the models' own teacher-forced forward pass without a cache
(each sampled token must be the argmax, or have the log-prob, that a full
forward pass over the prompt and the tokens before it gives); (2) the greedy
decodes t5x's predict_batch wrote into tests/fixtures/t5x; (3) the ids
transformers' greedy `generate` produced for the checkpoints in
tests/fixtures/hf (generate.npz, by experiments/make_hf_generate_fixtures.py).
"""

import dataclasses
import functools
import re
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.models import gpt_neox
from jaxrlhf.models import hf_io
from jaxrlhf.models import llama
from jaxrlhf.models import registry
from jaxrlhf.models import sampling
from jaxrlhf.models import t5
from jaxrlhf.models import t5x_decoder_only as t5x_do
from jaxrlhf.models.layers import kv_cache
from jaxrlhf.models.layers import param_recording
from jaxrlhf.models.layers import rotary
from jaxrlhf.models.t5x_checkpoint import read_t5x_checkpoint

HF_FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "hf"
NEW_TOKENS = 6


def random_params(model, *init_args, seed=0, scale=1.0):
  """Random float32 parameters for `model` without compiling its init.

  Kernels ~ N(0, scale^2 / fan_in) (fan_in: the second-to-last axis, the
  layer's input width for every kernel here), norm scales ~ 1 + N(0, 0.1^2),
  biases ~ N(0, 0.1^2), embeddings and relative-position tables ~ N(0, 1).
  Larger `scale` gives peakier next-token distributions (clear greedy
  margins).
  """
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  abstract = nn.meta.unbox(jax.eval_shape(
      lambda: model.init(jax.random.PRNGKey(0), *init_args))["params"])
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    name = str(getattr(path[-1], "key", path[-1]))
    noise = rng.standard_normal(leaf.shape).astype(np.float32)
    if name == "scale":
      return 1 + 0.1 * noise
    if name == "bias":
      return 0.1 * noise
    if name in ("embedding", "rel_embedding"):
      return noise
    return noise * np.float32(scale / np.sqrt(leaf.shape[-2]))
  return jax.tree_util.tree_map_with_path(draw, abstract)


# ----------------------------------------------------------------------------
# The check against full forward passes.

def _check_against_full_forward(samples, logits, eos_id, greedy,
                                temperature=1.0, top_k=0, top_p=1.0):
  """`logits` [batch, N, vocab]: full-forward logits for each sampled
  position given the prompt and the sampled tokens before it."""
  tokens = np.asarray(samples.tokens)
  mask = np.asarray(samples.mask) > 0
  filtered = sampling.filter_logits(jnp.asarray(logits),
                                    1.0 if greedy else temperature, top_k,
                                    top_p)
  logprobs = np.asarray(jax.nn.log_softmax(filtered))
  want = np.take_along_axis(logprobs, tokens[..., None], -1)[..., 0]
  np.testing.assert_allclose(np.asarray(samples.logprobs)[mask], want[mask],
                             atol=2e-5, rtol=1e-5)
  assert np.all(np.asarray(samples.logprobs)[~mask] == 0)
  if greedy:
    np.testing.assert_array_equal(tokens[mask],
                                  np.argmax(logprobs, -1)[mask])
  # Truncation after the first EOS; the mask covers tokens up to it.
  for row, row_mask, ended in zip(tokens, mask, np.asarray(samples.has_eos)):
    eos = np.flatnonzero(row == eos_id)
    assert ended == (eos.size > 0)
    if eos.size:
      assert np.all(row[eos[0] + 1:] == 0)
      assert row_mask.tolist() == [True] * (eos[0] + 1) + [False] * (
          len(row) - eos[0] - 1)
    else:
      assert row_mask.all()


# ----------------------------------------------------------------------------
# T5.

T5_CONFIG = t5.T5Config(vocab_size=32, emb_dim=32, num_heads=4,
                        num_encoder_layers=2, num_decoder_layers=2,
                        head_dim=8, mlp_dim=48, relpos_num_buckets=8,
                        relpos_max_distance=16)


@pytest.fixture(scope="module")
def t5_setup():
  model = t5.T5(T5_CONFIG)
  prompts = np.array([[5, 6, 7, 8, 9, 1], [3, 4, 1, 0, 0, 0],
                      [9, 9, 1, 0, 0, 0], [7, 1, 0, 0, 0, 0]], np.int32)
  params = random_params(model, prompts, prompts, scale=2.0)
  return model, params, prompts


@functools.lru_cache(maxsize=None)
def _t5_forward(model):
  return jax.jit(model.apply)


def _t5_logits(model, params, prompts, tokens):
  inputs = np.concatenate([np.zeros_like(tokens[:, :1]), tokens[:, :-1]], 1)
  return np.asarray(_t5_forward(model)({"params": params}, prompts, inputs),
                    np.float32)


@pytest.mark.parametrize("options", [
    dict(greedy=True), dict(temperature=0.8, top_k=6, top_p=0.95),
    dict(greedy=True, cache_segments=3)])
def test_t5_cached_sampling_matches_full_forward(t5_setup, options):
  model, params, prompts = t5_setup
  eos = 2  # a common token, so that some rows stop early
  samples = sampling.sample_encoder_decoder(
      model, params, prompts, jax.random.PRNGKey(3), NEW_TOKENS, eos_id=eos,
      **options)
  assert samples.tokens.shape == (4, NEW_TOKENS)
  logits = _t5_logits(model, params, prompts, np.asarray(samples.tokens))
  _check_against_full_forward(samples, logits, eos, options.get("greedy"),
                              options.get("temperature", 1.0),
                              options.get("top_k", 0), options.get("top_p", 1))


@pytest.fixture(scope="module")
def encdec(t5x_fixtures):
  root = t5x_fixtures / "encdec"
  cfg = json.loads((root / "config.json").read_text())["T5Config"]
  config = t5.T5Config(**{k: (tuple(v) if isinstance(v, list) else v)
                          for k, v in cfg.items()})
  params = read_t5x_checkpoint(root / "checkpoint_3")["params"]
  return config, params, dict(np.load(root / "expected.npz"))


@pytest.mark.parametrize("options", [
    dict(scan_layers=True, remat_policy="full"),
    dict(attention_impl="dot_product")])
def test_t5_speed_options_equal_default_and_t5x(encdec, options):
  config, params, e = encdec
  config = dataclasses.replace(config, **options)
  model = t5.T5(config)
  if config.scan_layers:
    params = t5.scan_layer_params(params, config)
    assert params["encoder"]["layers"]["mlp"]["wi_0"]["kernel"].shape == (
        config.num_encoder_layers, config.emb_dim, config.mlp_dim)
    assert "layers_0" not in params["decoder"]
  logits = jax.jit(model.apply)(
      {"params": params}, e["encoder_input_tokens"], e["decoder_input_tokens"],
      e["decoder_target_tokens"])
  # The t5x logits (all positions: the masking is t5x's in both paths).
  np.testing.assert_allclose(logits, e["logits"], atol=1e-4, rtol=0)
  if config.scan_layers:  # the KV cache stacked along the scanned layers
    samples = sampling.sample_encoder_decoder(
        model, params, e["encoder_input_tokens"], jax.random.PRNGKey(0),
        e["predict_greedy"].shape[1], greedy=True)
    np.testing.assert_array_equal(samples.tokens, e["predict_greedy"])


def test_t5_scan_layout_round_trip_and_logical_axes(encdec):
  config, params, _ = encdec
  scanned_config = dataclasses.replace(config, scan_layers=True)
  scanned = t5.scan_layer_params(params, scanned_config)
  back = t5.unscan_layer_params(scanned)
  flat = lambda t: {jax.tree_util.keystr(k): v
                    for k, v in jax.tree_util.tree_leaves_with_path(t)}
  assert flat(back).keys() == flat(params).keys()
  for key, value in flat(params).items():
    np.testing.assert_array_equal(flat(back)[key], value)
  # The scanned module's init has the same tree and the 'layers' axis name.
  model = t5.T5(scanned_config)
  one = jnp.ones((1, 3), jnp.int32)
  abstract = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), one,
                                               one))["params"]
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  shapes = jax.tree.map(lambda a: a.shape, nn.meta.unbox(abstract))
  assert shapes == jax.tree.map(np.shape, scanned)
  spec = nn.get_partition_spec(abstract)
  assert tuple(spec["decoder"]["layers"]["self_attention"]["query"][
      "kernel"]) == ("layers", "embed", "joined_kv")


def test_t5_option_errors_name_the_field():
  with pytest.raises(ValueError, match="attention_impl"):
    t5.T5Config(attention_impl="flash")
  with pytest.raises(ValueError, match="remat_policy"):
    t5.T5Config(remat_policy="sometimes")


# ----------------------------------------------------------------------------
# Decoder-only families.

# Prompts left-padded by 0, 2 and 4 of 6.
PROMPTS = np.array([[5, 9, 12, 7, 3, 8], [0, 0, 4, 4, 11, 6],
                    [0, 0, 0, 0, 13, 2]], np.int32)
PROMPT_MASK = (PROMPTS > 0).astype(np.int32)


def _decoder_configs():
  return {
      "llama": llama.LlamaConfig.preset("tiny", vocab_size=32),
      "llama_scanned": llama.LlamaConfig.preset("tiny", vocab_size=32,
                                                scan_layers=True),
      "gpt_neox": gpt_neox.GPTNeoXConfig.preset("tiny", vocab_size=32,
                                                 num_heads=4, rotary_pct=0.5),
  }


@functools.lru_cache(maxsize=None)
def _decoder_setup(name):
  config = _decoder_configs()[name]
  model = registry.module_for_config(config)
  one = jnp.ones((1, 6), jnp.int32)
  return model, random_params(model, one, one, one, seed=1, scale=1.5)


@functools.lru_cache(maxsize=None)
def _decoder_forward(model):
  return jax.jit(model.apply)


def _decoder_logits(model, params, prompts, prompt_mask, tokens):
  """Full-forward logits predicting each of `tokens` (no cache)."""
  full = np.concatenate([prompts, tokens], 1)
  mask = np.concatenate([prompt_mask, np.ones_like(tokens)], 1)
  logits = _decoder_forward(model)({"params": params}, full,
                                   rotary.positions_from_mask(mask), mask)
  p, n = prompts.shape[1], tokens.shape[1]
  return np.asarray(logits)[:, p - 1:p + n - 1]


@pytest.mark.parametrize("name,options", [
    ("llama", dict(greedy=True)),
    ("llama_scanned", dict(temperature=1.3, top_p=0.9)),
    # The cache in chunks, a scanned stack's too.
    ("llama_scanned", dict(greedy=True, cache_segments=3)),
    ("gpt_neox", dict(greedy=True)),
    ("gpt_neox", dict(temperature=0.7, top_k=5)),
])
def test_decoder_only_cached_sampling_matches_full_forward(name, options):
  model, params = _decoder_setup(name)
  eos = 3
  samples = sampling.sample_decoder_only(
      model, params, PROMPTS, PROMPT_MASK, jax.random.PRNGKey(5), NEW_TOKENS,
      eos_id=eos, **options)
  assert samples.tokens.shape == (3, NEW_TOKENS)
  logits = _decoder_logits(model, params, PROMPTS, PROMPT_MASK,
                           np.asarray(samples.tokens))
  _check_against_full_forward(samples, logits, eos, options.get("greedy"),
                              options.get("temperature", 1.0),
                              options.get("top_k", 0), options.get("top_p", 1))


def test_right_padded_prompts_are_rejected():
  model, params = _decoder_setup("llama")
  right = np.array([[5, 6, 0]], np.int32)
  with pytest.raises(ValueError, match="left-padded"):
    sampling.sample_decoder_only(model, params, right, right > 0,
                                 jax.random.PRNGKey(0), 2)


# ----------------------------------------------------------------------------
# t5x decoder-only against t5x's predict_batch.

@pytest.fixture(scope="module")
def decoder_only(t5x_fixtures):
  root = t5x_fixtures / "decoder_only"
  config = t5x_do.T5xDecoderOnlyConfig.from_t5x(
      json.loads((root / "config.json").read_text())["TransformerConfig"])
  params = read_t5x_checkpoint(root / "checkpoint_3")["params"]
  return t5x_do.T5xDecoderOnly(config), params, dict(
      np.load(root / "expected.npz"))


def test_t5x_decoder_only_cached_greedy_matches_predict_batch(decoder_only):
  # (test_t5x_decoder_only.py checks the prefix-LM mode the same way.)
  model, params, e = decoder_only
  tokens, finished = t5x_do.greedy_continuation(
      model, params, jnp.asarray(e["decoder_input_tokens"]),
      jnp.asarray(e["decoder_causal_attention"]))
  np.testing.assert_array_equal(tokens, e["predict_greedy"])
  np.testing.assert_array_equal(finished, [True, True, True])


def test_t5x_decoder_only_sampled_path_matches_full_forward(decoder_only):
  model, params, e = decoder_only
  prompts, mask, _ = t5x_do.left_padded_prompts(
      jnp.asarray(e["decoder_input_tokens"]),
      jnp.asarray(e["decoder_causal_attention"]))
  prompts, mask = np.asarray(prompts), np.asarray(mask)
  # Each row's first real token is t5x's BOS, id 0: only the mask says what
  # is padding.
  first_real = mask.argmax(axis=1)
  assert np.all(prompts[np.arange(len(prompts)), first_real] == 0)
  assert mask.sum(1).tolist() == [5, 9, 3]  # prompt lengths 4, 8, 2 + BOS
  samples = sampling.sample_decoder_only(
      model, params, prompts, mask, jax.random.PRNGKey(2), NEW_TOKENS,
      temperature=1.5)
  tokens = np.asarray(samples.tokens)
  full = np.concatenate([prompts, tokens], 1)
  real = np.concatenate([mask, np.ones_like(tokens)], 1)
  # t5x's own mask with segment ids keeps the left pads apart; relative
  # positions are index differences, unchanged by the left shift.
  logits = jax.jit(functools.partial(model.apply, method=model.t5x_logits))(
      {"params": params}, full, decoder_segment_ids=real)
  p = prompts.shape[1]
  _check_against_full_forward(samples, np.asarray(logits)[:, p - 1:-1], 1,
                              False, temperature=1.5)


# ----------------------------------------------------------------------------
# Hugging Face checkpoints against transformers' greedy generate.

@pytest.mark.parametrize("name", ["llama_gqa", "llama_tied", "pythia",
                                  "neox_sequential", "t5_gated",
                                  "t5_relu_tied"])
def test_greedy_matches_transformers_generate(name):
  config, params = hf_io.load_hf_checkpoint(HF_FIXTURES / name)
  model = registry.module_for_config(config)
  g = dict(np.load(HF_FIXTURES / name / "generate.npz"))
  options = dict(rng=jax.random.PRNGKey(0),
                 max_new_tokens=int(g["max_new_tokens"]), greedy=True,
                 eos_id=int(g["eos_id"]))
  if "encoder_input_tokens" in g:
    samples = sampling.sample_encoder_decoder(
        model, params, g["encoder_input_tokens"], **options)
  else:
    samples = sampling.sample_decoder_only(
        model, params, g["prompt_tokens"], g["prompt_attention_mask"],
        **options)
  np.testing.assert_array_equal(samples.tokens, g["generated"])
  np.testing.assert_array_equal(samples.has_eos,
                                np.any(g["generated"] == g["eos_id"], -1))


# ----------------------------------------------------------------------------
# A decode step reads the cache in place.

def _loop_computations(hlo_text):
  """{name: its instruction lines} of the computations a compiled program
  runs inside its while loops: the loops' bodies and conditions and what
  they call, transitively."""
  computations, name = {}, None
  for line in hlo_text.splitlines():
    header = re.match(r"(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
    if header and not line.startswith(" "):
      name = header[1]
      computations[name] = []
    elif name is not None and line.startswith(" "):
      computations[name].append(line)
  called = lambda lines: {m for line in lines for m in re.findall(
      r"(?:body|condition|calls|to_apply)=%?([\w.\-]+)", line)}
  todo = {m for lines in computations.values() for line in lines
          if " while(" in line
          for m in re.findall(r"(?:body|condition)=%?([\w.\-]+)", line)}
  inside = set()
  while todo:
    name = todo.pop()
    if name in computations and name not in inside:
      inside.add(name)
      todo |= called(computations[name])
  return {name: computations[name] for name in inside}


def _cache_rewrites(hlo_text, batch, heads, head_dim, min_length):
  """Copies and transposes inside the decode loops of arrays shaped like a
  layer's KV cache (or a chunk of it), [batch, heads, length >= min_length,
  head_dim]: what a decode step must not do (it writes only the new
  position, `update_kv_cache`)."""
  bad = []
  for lines in _loop_computations(hlo_text).values():
    for line in lines:
      m = re.search(r"= \w+\[(\d+),(\d+),(\d+),(\d+)\]\{[^}]*\} "
                    r"(copy|transpose)\(", line)
      if m and (int(m[1]), int(m[2]), int(m[4])) == (batch, heads, head_dim) \
          and int(m[3]) >= min_length:
        bad.append(line.strip()[:160])
  return bad


def test_a_cache_in_chunks_is_written_and_read_chunk_by_chunk():
  """`update_kv_cache` on a cache made in `kv_cache_chunks`: each call
  writes into the chunk its length ends and returns the chunks up to it;
  a length that does not end a chunk is refused."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top

  class Cache(nn.Module):
    @nn.compact
    def __call__(self, new, index, length):
      return kv_cache.update_kv_cache(self, "key", new, index, length,
                                      "kv_heads")
  cache = Cache()
  # [batch 1, L, heads 1, head_dim 2] of the value v.
  rows = lambda v, length=1: jnp.full((1, length, 1, 2), v, jnp.float32)

  def call(variables, value, index, length, positions=1):
    read, variables = cache.apply(variables, rows(value, positions), index,
                                  length, mutable=["cache"])
    return [np.asarray(c)[0, 0, :, 0] for c in read], variables
  with kv_cache.kv_cache_chunks((3, 2)):
    read, variables = call({}, 1.0, 0, 4, positions=4)  # the prefill
  held = variables["cache"]["key"]
  assert [c.shape[2] for c in held] == [4, 3, 2]
  np.testing.assert_array_equal(read[0], [1, 1, 1, 1])
  assert len(read) == 1
  # Position 5 is the second chunk's second slot.
  read, variables = call(variables, 5.0, 5, 7)
  assert [len(c) for c in read] == [4, 3]
  np.testing.assert_array_equal(read[1], [0, 5, 0])
  read, variables = call(variables, 8.0, 8, 9)
  np.testing.assert_array_equal(np.concatenate(read),
                                [1, 1, 1, 1, 0, 5, 0, 0, 8])
  with pytest.raises(ValueError, match="ending at \\[4, 7, 9\\].*must end"):
    call(variables, 6.0, 6, 6)
  # Outside kv_cache_chunks, one array: the whole cache.
  read, variables = call({}, 2.0, 1, 3)
  assert variables["cache"]["key"].shape == (1, 1, 3, 2)
  np.testing.assert_array_equal(read[0], [0, 2, 0])


@pytest.mark.parametrize("family", ["t5", "llama"])
@pytest.mark.parametrize("segments", [1, 3])
def test_decode_steps_do_not_copy_the_kv_cache(family, segments):
  """Laid out [batch, length, heads, head_dim], the cache of every layer
  was transposed (and copied) at every decode step, so sampling slowed with
  the cache's size, not with the new token (issue: T5's tokens/s did not
  grow with batch). Read in segments, each step reading a prefix, the cache
  must not be copied either: a slice of one cache array that a step also
  updates was copied whole at every step, so the cache is held in chunks."""
  batch, prompt, new = 4, 8, 16
  tokens = np.ones((batch, prompt), np.int32)
  options = dict(greedy=True, cache_segments=segments)
  if family == "t5":
    config = t5.t5_config("tiny", vocab_size=64)
    model = t5.T5(config)
    heads = config.num_heads
    params = random_params(model, tokens, tokens[:, :2])
    fn = lambda p, x: sampling.sample_encoder_decoder(
        model, p, x, jax.random.PRNGKey(0), new, **options).tokens
  else:
    config = llama.LlamaConfig.preset("tiny")
    model = llama.Llama(config)
    heads = config.num_kv_heads
    params = random_params(model, tokens, tokens, tokens)
    fn = lambda p, x: sampling.sample_decoder_only(
        model, p, x, jnp.ones_like(x), jax.random.PRNGKey(0), new,
        **options).tokens
  hlo = jax.jit(fn).lower(params, tokens).compile().as_text()
  loops = _loop_computations(hlo)
  assert loops and any("dot(" in line or "fusion(" in line
                       for lines in loops.values() for line in lines)
  # The shortest chunk: a later segment's steps.
  ends = sampling.segment_ends(new, segments)
  shortest = min(b - a for a, b in zip((0,) + ends[:-1], ends))
  assert _cache_rewrites(hlo, batch, heads, config.head_dim, shortest) == []


# ----------------------------------------------------------------------------
# A decode step reads the weights cast once, not at every step.

def _loop_param_casts(hlo_text, loop, param_shapes):
  """Converts to bfloat16 inside the decode loop (op names under `loop`)
  whose shape is a weight's (`param_shapes`), or one scanned layer's slice
  of one: the float32 weights cast again at every step."""
  sliced = set(param_shapes) | {(1,) + s[1:] for s in param_shapes
                                 if len(s) >= 3}
  bad = []
  for line in hlo_text.splitlines():
    m = re.search(r"= bf16\[([\d,]*)\]\{[^}]*\} convert\(.*op_name=\"([^\"]*)",
                  line)
    if m and m[2].startswith(loop):
      shape = tuple(int(d) for d in m[1].split(",") if d)
      if shape in sliced:
        bad.append(line.strip()[:160])
  return bad


@pytest.mark.parametrize("family", ["t5_scanned", "llama_scanned"])
def test_decode_steps_read_the_weights_cast_once(family):
  """With float32 parameters and bfloat16 compute every decode step cast
  every weight again (in a scanned stack XLA cannot hoist the casts: each
  reads its layer's slice): 38% of a Llama 3.2 1B-shaped decode step on an
  H100. The sampler casts them once, after the prefill. (Unscanned, XLA
  on the CPU hoists them itself.)"""
  batch, prompt, new = 3, 8, 6
  tokens = np.ones((batch, prompt), np.int32)
  if family == "t5_scanned":
    model = t5.T5(t5.t5_config("tiny", vocab_size=64, dtype="bfloat16",
                               scan_layers=True))
    params = random_params(model, tokens, tokens[:, :2])
    fn = lambda p, x: sampling.sample_encoder_decoder(
        model, p, x, jax.random.PRNGKey(0), new, greedy=True).tokens
    loop = "jit(<lambda>)/jit(_sample_encoder_decoder)/while/body"
  else:
    model = llama.Llama(llama.LlamaConfig.preset(
        "tiny", dtype="bfloat16", scan_layers=True))
    params = random_params(model, tokens, tokens, tokens)
    fn = lambda p, x: sampling.sample_decoder_only(
        model, p, x, jnp.ones_like(x), jax.random.PRNGKey(0), new,
        greedy=True).tokens
    loop = "jit(<lambda>)/jit(_sample_decoder_only)/while/body"
  shapes = [tuple(x.shape) for path, x in jax.tree_util.tree_leaves_with_path(
      params) if path[-1].key in ("kernel", "embedding")]
  hlo = jax.jit(fn).lower(params, tokens).compile().as_text()
  assert loop in hlo  # the decode loop is there to inspect
  assert _loop_param_casts(hlo, loop, shapes) == []


def _one_decode_call(model):
  """(random float32 parameters, call(params) -> logits) of one decode call
  of `model` on two prompts: a T5's BOS step over the encoded prompts, a
  decoder-only model's prefill of the left-padded prompts."""
  tokens = np.array([[0, 5, 9, 12], [7, 3, 8, 2]], np.int32)
  if isinstance(model, t5.T5):
    params = random_params(model, tokens, tokens[:, :2], seed=3)
    encoded = model.apply({"params": params}, tokens, method=model.encode)
    return params, lambda p: model.apply(
        {"params": p}, encoded, tokens, tokens[:, :1] * 0, 0, 4,
        method=model.decode_step, mutable=["cache"])[0]
  mask = (tokens > 0).astype(np.int32)
  positions = rotary.positions_from_mask(mask)
  params = random_params(model, tokens, positions, mask, seed=3)
  return params, lambda p: model.apply(
      {"params": p}, tokens, positions, mask, 0, method=model.decode_step,
      mutable=["cache"])[0]


def _cast_and_kept(params, reads):
  cast = param_recording.cast_read_params(params, reads)
  paths = lambda keep: sorted(
      "/".join(str(k.key) for k in path)
      for path, leaf in jax.tree_util.tree_leaves_with_path(cast)
      if (leaf.dtype == jnp.float32) == keep)
  return cast, paths(False), paths(True)


@pytest.mark.parametrize("name", ["llama_scanned", "gemma3", "gpt_neox",
                                  "t5x_decoder_only", "t5_tied"])
def test_weights_cast_once_give_the_same_logits(name):
  """Only the parameters every read casts to bfloat16 are cast (the
  projections, the MLP, an embedding read in the compute dtype), so the
  model computes the same bits from them; those read in float32 stay
  float32: Gemma's norm scales (1 + scale in float32), GPT-NeoX's
  LayerNorm, T5's tied embedding (its logits are float32, as t5x's) and
  t5x decoder-only's, the T5 relative-position tables."""
  from jaxrlhf.models import gemma3  # pylint: disable=g-import-not-at-top
  if name == "t5_tied":
    model = t5.T5(t5.t5_config("tiny", vocab_size=32, dtype="bfloat16",
                               logits_via_embedding=True))
  else:
    model = registry.module_for_config({
        "llama_scanned": llama.LlamaConfig.preset(
            "tiny", vocab_size=32, scan_layers=True, dtype="bfloat16"),
        "gemma3": gemma3.Gemma3Config.preset("tiny", vocab_size=32,
                                             dtype="bfloat16"),
        "gpt_neox": gpt_neox.GPTNeoXConfig.preset("tiny", vocab_size=32,
                                                   dtype="bfloat16"),
        "t5x_decoder_only": dataclasses.replace(
            t5x_do.T5X_DECODER_ONLY_PRESETS["tiny"], vocab_size=32,
            logits_via_embedding=False, dtype="bfloat16"),
    }[name])
  params, call = _one_decode_call(model)
  with param_recording.recording_param_reads() as reads:
    want = np.asarray(jax.jit(call)(params).astype(jnp.float32))
  cast, narrowed, kept = _cast_and_kept(params, reads)
  got = np.asarray(jax.jit(call)(cast).astype(jnp.float32))
  np.testing.assert_array_equal(got, want)
  assert all(n.endswith(("kernel", "bias", "embedding")) for n in narrowed)
  assert any(n.endswith("mlp/wi_0/kernel") or n.endswith("mlp/wi/kernel")
             or "dense_h_to_4h" in n for n in narrowed), narrowed
  expected_kept = {
      "llama_scanned": lambda n: n.endswith("/scale"),
      "gemma3": lambda n: n.endswith("/scale"),
      "gpt_neox": lambda n: "layer_norm" in n or "norm" in n,
      "t5x_decoder_only": lambda n: (n.endswith("/scale")
                                     or n.endswith("/logits_dense/kernel")
                                     or "relpos" in n),
      # (The encoder is not read by a decode step: not recorded, not cast.)
      "t5_tied": lambda n: (n.endswith("/scale") or "relpos" in n
                            or n.startswith("encoder/")
                            or n.endswith("token_embedder/embedding")),
  }[name]
  assert all(expected_kept(n) for n in kept), kept
  assert not any(expected_kept(n) for n in narrowed), narrowed


# ----------------------------------------------------------------------------
# One prefill per prompt for its k samples (`num_samples`), and a decode loop
# that stops once every row has ended (`stop_when_done`). The truth for both
# is the plain path: the prompts repeated k times, decoded by the fixed scan.

GROUP = 2  # samples per prompt
BUDGET = 8  # max_new_tokens
EOS = 2


def _eos_biased(cls):
  """`cls` whose EOS logit is raised by params["eos_bias"] at every step, so
  that a random model's rows end early (or, at 0, some never do); a traced
  parameter, so both cases run one compiled program."""
  class EosBiased(cls):
    def decode_step(self, *args, **kwargs):
      logits = super().decode_step(*args, **kwargs)
      return logits.at[..., EOS].add(self.get_variable("params", "eos_bias"))
  return EosBiased


_EosBiasedT5 = _eos_biased(t5.T5)
_EosBiasedLlama = _eos_biased(llama.Llama)

# Per family and greedy, an EOS bias with which every row ends before BUDGET
# (asserted below); with 0 some rows never end.
_ENDING_BIAS = {("t5", True): 5.0, ("t5", False): 4.0,
                ("llama", True): 4.0, ("llama", False): 5.0}


@pytest.fixture(scope="module")
def group_sampling(t5_setup):
  """family -> (EOS-biased model, params with eos_bias 0, prompts [P, Lp],
  sample(params, prompts, **options) -> Samples)."""
  _, t5_params, t5_prompts = t5_setup
  t5_model = _EosBiasedT5(T5_CONFIG)
  llama_model = _EosBiasedLlama(llama.LlamaConfig.preset("tiny",
                                                         vocab_size=32))
  one = jnp.ones((1, 6), jnp.int32)
  llama_params = random_params(llama.Llama(llama_model.config), one, one, one,
                               seed=1, scale=1.5)
  bias = {"eos_bias": jnp.float32(0.0)}
  return {
      "t5": (t5_model, dict(t5_params, **bias), t5_prompts,
             lambda p, x, **kw: sampling.sample_encoder_decoder(
                 t5_model, p, x, jax.random.PRNGKey(4), BUDGET, eos_id=EOS,
                 **kw)),
      "llama": (llama_model, dict(llama_params, **bias), PROMPTS,
                lambda p, x, **kw: sampling.sample_decoder_only(
                    llama_model, p, x, x > 0, jax.random.PRNGKey(4), BUDGET,
                    eos_id=EOS, **kw)),
  }


@pytest.mark.parametrize("family", ["t5", "llama"])
def test_shared_prefill_and_early_stop_equal_repeated_prompts(
    family, group_sampling):
  _, params, prompts, sample = group_sampling[family]

  @jax.jit
  def run(p):
    """{(greedy, variant): Samples}, in one program (one compilation):
    "repeated" (the truth: the prompts repeated, fixed loop), "shared"
    (num_samples=GROUP), "shared_until_done" (and stop_when_done)."""
    out = {}
    for greedy in (True, False):
      out[greedy, "repeated"] = sample(p, np.repeat(prompts, GROUP, 0),
                                       greedy=greedy)
      out[greedy, "shared"] = sample(p, prompts, num_samples=GROUP,
                                     greedy=greedy)
      out[greedy, "shared_until_done"] = sample(
          p, prompts, num_samples=GROUP, stop_when_done=True, greedy=greedy)
      # The steps in 3 segments, the cache in 3 chunks.
      out[greedy, "segments"] = sample(p, prompts, num_samples=GROUP,
                                       cache_segments=3, greedy=greedy)
      out[greedy, "segments_until_done"] = sample(
          p, prompts, num_samples=GROUP, stop_when_done=True,
          cache_segments=3, greedy=greedy)
    return out

  for greedy in (True, False):
    for bias in (_ENDING_BIAS[family, greedy], 0.0):
      out = jax.device_get(run(dict(params, eos_bias=jnp.float32(bias))))
      truth = out[greedy, "repeated"]
      ended = truth.has_eos
      if bias:
        assert ended.all(), (greedy, truth.tokens)
      else:
        assert ended.any() and not ended.all(), (greedy, truth.tokens)
      # Row i * GROUP + j: sample j of prompt i, the same draws.
      shared = out[greedy, "shared"]
      np.testing.assert_array_equal(shared.tokens, truth.tokens)
      np.testing.assert_allclose(shared.logprobs, truth.logprobs, atol=1e-5)
      np.testing.assert_array_equal(shared.mask, truth.mask)
      np.testing.assert_array_equal(shared.has_eos, truth.has_eos)
      assert shared.num_steps == truth.num_steps == BUDGET
      # The while loop writes exactly what the fixed scan writes.
      early = out[greedy, "shared_until_done"]
      for name in ("tokens", "logprobs", "mask", "has_eos"):
        np.testing.assert_array_equal(getattr(early, name),
                                      getattr(shared, name))
      # It ran up to the column of the last row's EOS.
      last_eos = np.max(np.argmax(truth.tokens == EOS, axis=1))
      assert early.num_steps == (last_eos + 1 if ended.all() else BUDGET)
      if bias:
        assert early.num_steps < BUDGET
      # Segments read the cache written so far: the same draws, the
      # log-probs to float32 rounding (shorter sums), the same steps run
      # (segments after the last EOS's run none).
      for name, like in (("segments", shared),
                         ("segments_until_done", early)):
        got = out[greedy, name]
        np.testing.assert_array_equal(got.tokens, like.tokens)
        np.testing.assert_allclose(got.logprobs, like.logprobs, atol=1e-5)
        np.testing.assert_array_equal(got.mask, like.mask)
        np.testing.assert_array_equal(got.has_eos, like.has_eos)
        assert got.num_steps == like.num_steps, name


@pytest.mark.parametrize("family", ["t5", "llama"])
def test_shared_prefill_saves_the_prefill_flops(family, group_sampling):
  """FLOPs (counted from the jaxpr, nothing compiled): sharing saves exactly
  GROUP - 1 prefills of the prompts; the while loop counts as the scan (its
  bound, BUDGET - 1 steps). The samplers' traces are those of the test
  above (jit's cache)."""
  from jaxrlhf import flops  # pylint: disable=g-import-not-at-top
  model, params, prompts, sample = group_sampling[family]
  if family == "t5":
    def prefill(x):
      encoded = model.apply({"params": params}, x, method=model.encode)
      return model.apply({"params": params}, encoded, x,
                         jnp.zeros((len(x), 1), jnp.int32), 0, BUDGET,
                         method=model.decode_step, mutable=["cache"])
  else:
    def prefill(x):
      mask = (x > 0).astype(jnp.int32)
      cache_mask = jnp.pad(mask, ((0, 0), (0, BUDGET - 1)),
                           constant_values=1)
      return model.apply({"params": params}, x,
                         rotary.positions_from_mask(mask), cache_mask, 0,
                         method=model.decode_step, mutable=["cache"])

  def count(x, **options):
    return flops.function_flops(
        lambda p, x: sample(p, x, greedy=False, **options).tokens, params, x)
  repeated = count(np.repeat(prompts, GROUP, 0))
  shared = count(prompts, num_samples=GROUP)
  one_prefill = flops.function_flops(prefill, prompts)
  assert one_prefill > 0
  assert shared == repeated - (GROUP - 1) * one_prefill
  assert count(prompts, num_samples=GROUP, stop_when_done=True) == shared

  # With the steps in 3 segments (ends 2, 4, 7 of BUDGET - 1 = 7 steps),
  # the steps of a segment ending at e attend over the cache's first
  # P + e positions (T5: e + 1) instead of its P + BUDGET - 1 (T5:
  # BUDGET): each unread position saves its logit and its share of the
  # output, 2 * 2 * heads * head_dim FLOPs per query, layer and step. The
  # prefill (once per prompt: T5's BOS step, the decoder-only prompt's P
  # queries) reads the first chunk, up to the first segment's positions.
  config = model.config
  if family == "t5":
    layers_, offset = config.num_decoder_layers, 1
    heads, full = config.num_heads, BUDGET
  else:
    layers_, offset = config.num_layers, prompts.shape[1]
    heads, full = config.num_heads, prompts.shape[1] + BUDGET - 1
  ends = sampling.segment_ends(BUDGET, 3)
  assert ends == (2, 4, 7)
  unread = sum(full - (offset + end)
               for start, end in zip((0,) + ends[:-1], ends)
               for _ in range(start, end))
  per_prompt = 4 * heads * config.head_dim * layers_ * len(prompts)
  prefill_queries = 1 if family == "t5" else prompts.shape[1]
  prefill_unread = prefill_queries * (full - (offset + ends[0]))
  segmented = count(prompts, num_samples=GROUP, cache_segments=3)
  assert segmented == shared - per_prompt * (GROUP * unread
                                             + prefill_unread)
  assert count(prompts, num_samples=GROUP, cache_segments=3,
               stop_when_done=True) == segmented


def test_rollout_sampling_passes_the_group_options_through(group_sampling,
                                                           monkeypatch):
  """Traced only: P encoder-style prompts give P * GROUP rows, decoded by the
  loop that stops early, in 2 segments (2 loops); segments left unset are
  `sampling.default_cache_segments`' (1 on this CPU)."""
  from jaxrlhf.models import scoring  # pylint: disable=g-import-not-at-top
  from jaxrlhf.rl import rollout  # pylint: disable=g-import-not-at-top
  model, params, _, _ = group_sampling["llama"]
  right_padded = np.array([[5, 9, 0, 0], [4, 0, 0, 0], [7, 8, 6, 3]],
                          np.int32)
  fn = lambda p, x, **segments: rollout.sample_responses(
      scoring.adapter_for(model), p, x, jax.random.PRNGKey(0),
      max_new_tokens=BUDGET, temperature=1.0, eos_id=EOS,
      num_samples=GROUP, stop_when_done=True, **segments)
  loops = lambda **segments: str(jax.make_jaxpr(
      functools.partial(fn, **segments))(params, right_padded)).count(
          "while[")
  samples = jax.eval_shape(fn, params, right_padded)
  assert samples.tokens.shape == (3 * GROUP, BUDGET)
  assert samples.num_steps.shape == ()
  assert loops(cache_segments=2) == 2
  assert loops() == 1
  monkeypatch.setattr(sampling, "default_cache_segments", lambda n: 3)
  assert loops() == 3


# ----------------------------------------------------------------------------
# Projections joined for the decode loop (`fuse_projections`, on by default):
# the truth is the same sampler reading each projection's weights apart.

def _loop_products(fn, *args) -> int:
  """dot_general equations inside the program's loops (the decode loop's
  body, and a scanned stack's body within it), from the jaxpr."""
  from jaxrlhf import flops  # pylint: disable=g-import-not-at-top

  def count(jaxpr, in_loop):
    total = 0
    for eqn in jaxpr.eqns:
      name = eqn.primitive.name
      total += in_loop and name == "dot_general"
      for sub in flops.sub_jaxprs(eqn.params):
        total += count(sub, in_loop or name in ("scan", "while"))
    return total
  return count(jax.make_jaxpr(fn)(*args).jaxpr, False)


@pytest.mark.parametrize("name", ["llama", "qwen2_scanned", "t5"])
def test_joined_projections_compute_what_separate_ones_do(name):
  """A decode call (a prefill; T5: the BOS step over the encoded prompt) on
  the joined parameters gives the separate ones' logits, in float32 to the
  rounding of other products (a head, a bias or a gate put in another's
  place moves them by ~1): Llama's grouped-query heads, Qwen2's q/k/v
  biases on a scanned stack's [layers, ...] parameters, T5's joined-kv
  self-attention kernels; and each gated MLP."""
  from jaxrlhf.models import qwen2  # pylint: disable=g-import-not-at-top
  model = t5.T5(T5_CONFIG) if name == "t5" else registry.module_for_config(
      llama.LlamaConfig.preset("tiny", vocab_size=32) if name == "llama"
      else qwen2.Qwen2Config.preset("tiny", vocab_size=32, scan_layers=True))
  params, call = _one_decode_call(model)
  with param_recording.recording_param_fusions() as fusions:
    want = np.asarray(jax.jit(call)(params))
  joined = param_recording.fuse_projections(params, fusions)
  names = {str(path[-2].key) for path, _ in
           jax.tree_util.tree_leaves_with_path(joined)}
  assert {"fused_qkv", "fused_wi"} <= names, names
  # (T5's cross-attention and encoder keep theirs.)
  assert ("query" in names) == (name == "t5"), names
  np.testing.assert_allclose(np.asarray(jax.jit(call)(joined)), want,
                             rtol=1e-5, atol=1e-5)


def _bf16(model):
  """The same module computing in bfloat16 (its float32 parameters are then
  cast for the decode loop, and joined in the casts' place)."""
  return type(model)(dataclasses.replace(model.config, dtype="bfloat16"))


@pytest.mark.parametrize("family", ["t5", "llama"])
def test_the_decode_loop_reads_joined_projections_where_it_casts(
    family, group_sampling):
  """The sampler's decode loop runs fewer products a step: a decoder layer
  reads its self-attention's query, key and value in one and the gated
  MLP's two input projections in one (3 fewer a layer; T5's
  cross-attention query stays apart), when the model computes in bfloat16
  from float32 parameters; a float32 model's loop reads them apart (no
  cast copy to put them in). Traced, not compiled."""
  model, params, prompts, _ = group_sampling[family]
  params = {k: v for k, v in params.items() if k != "eos_bias"}
  base = t5.T5(model.config) if family == "t5" else llama.Llama(model.config)

  def tokens(module, joined):
    if family == "t5":
      return lambda p: sampling.sample_encoder_decoder(
          module, p, prompts, jax.random.PRNGKey(4), BUDGET, eos_id=EOS,
          num_samples=GROUP, fuse_projections=joined).tokens
    return lambda p: sampling.sample_decoder_only(
        module, p, prompts, prompts > 0, jax.random.PRNGKey(4), BUDGET,
        eos_id=EOS, num_samples=GROUP, fuse_projections=joined).tokens

  layer_count = (T5_CONFIG.num_decoder_layers if family == "t5"
                 else base.config.num_layers)
  for module, fewer in ((_bf16(base), 3 * layer_count), (base, 0)):
    products = {joined: _loop_products(tokens(module, joined), params)
                for joined in (True, False)}
    assert products[False] - products[True] == fewer, (module.config.dtype,
                                                       products)


def test_projections_stay_apart_under_lora_or_a_tensor_parallel_mesh():
  """A group joins only where every member is a plain kernel (and bias):
  LoRA's factors on the query keep q/k/v apart while the MLP joins; a mesh
  whose model axis splits the heads and the MLP keeps both apart (the
  key/value heads need not split like the query heads); a data axis alone
  splits neither."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from jaxrlhf import sharding_rules  # pylint: disable=g-import-not-at-top
  model = llama.Llama(llama.LlamaConfig.preset("tiny", vocab_size=32))
  one = jnp.ones((1, 6), jnp.int32)
  params = random_params(model, one, one, one)
  with param_recording.recording_param_fusions() as fusions:
    jax.eval_shape(lambda p: model.apply(
        {"params": p}, one, one, one, 0, method=model.decode_step,
        mutable=["cache"]), params)
  block = lambda tree: tree["decoder"]["layers_0"]

  def joined(tree):
    return sorted(k for k in (*block(tree)["self_attention"],
                              *block(tree)["mlp"]) if k.startswith("fused"))

  plain = param_recording.fuse_projections(params, fusions)
  assert joined(plain) == ["fused_qkv", "fused_wi"]
  # Given what they were cast from: joined where cast, apart where not.
  cast = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  assert joined(param_recording.fuse_projections(
      cast, fusions, cast_from=params)) == ["fused_qkv", "fused_wi"]
  assert joined(param_recording.fuse_projections(params, fusions,
                                                 cast_from=params)) == []
  attention = block(params)["self_attention"]
  np.testing.assert_array_equal(
      block(plain)["self_attention"]["fused_qkv"]["kernel"],
      np.concatenate([attention[n]["kernel"] for n in ("query", "key",
                                                       "value")], axis=-2))
  mlp = block(params)["mlp"]
  np.testing.assert_array_equal(
      block(plain)["mlp"]["fused_wi"]["kernel"],
      np.stack([mlp["wi_0"]["kernel"], mlp["wi_1"]["kernel"]], axis=-2))

  adapted = jax.tree_util.tree_map(lambda x: x, params)
  query = block(adapted)["self_attention"]["query"]
  query["lora_a"] = np.zeros((32, 2), np.float32)
  query["lora_b"] = np.zeros((2, 4, 8), np.float32)
  fused = param_recording.fuse_projections(adapted, fusions)
  assert joined(fused) == ["fused_wi"]
  assert "lora_a" in block(fused)["self_attention"]["query"]

  for shape, expected in (((2, 1), ["fused_qkv", "fused_wi"]),
                          ((1, 2), [])):
    mesh = jax.sharding.AbstractMesh(shape, ("data", "model"))
    with jax.sharding.use_abstract_mesh(mesh), \
        nn.logical_axis_rules(sharding_rules.STANDARD_RULES):
      assert joined(param_recording.fuse_projections(params, fusions)
                   ) == expected
