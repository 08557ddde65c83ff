"""The fused attention kernels (`jaxrlhf.models.fused_attention`) against the
XLA path: Pallas splash attention, run here in Pallas's interpret mode
(the TPU kernel's own code, interpreted on the CPU), and the arguments of
cuDNN's packed layout (the kernel itself needs a GPU).

Truth: 'xla' computes softmax(q k^T) v with the dense mask of
`CausalSegments`; every real token's output must be the same through
the kernels, for packed segments, grouped key/value heads, sliding windows
(static, and traced in a scanned stack whose layers differ), Gemma's soft
cap, the gradient, and a KV-cache prefill.
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from jaxrlhf import defaults
from jaxrlhf import sharding
from jaxrlhf import sharding_rules
from jaxrlhf.models import fused_attention
from jaxrlhf.models import gemma3
from jaxrlhf.models import llama
from jaxrlhf.models import registry
from jaxrlhf.models import sampling
from jaxrlhf.models import t5
from jaxrlhf.models.layers import attentions

# Two rows of 20 slots: three packed examples and padding; one example and
# padding.
LENGTH = 20
SEGMENTS = np.zeros((2, LENGTH), np.int32)
SEGMENTS[0, :5], SEGMENTS[0, 5:12], SEGMENTS[0, 12:15] = 1, 2, 3
SEGMENTS[1, :9] = 1
REAL = SEGMENTS > 0


def _positions(segments):
  out = np.zeros_like(segments)
  for row, ids in enumerate(segments):
    for s in range(1, ids.max() + 1):
      out[row, ids == s] = np.arange(np.sum(ids == s))
  return out


def _qkv(heads=4, kv_heads=2, head_dim=8):
  rng = np.random.default_rng(0)
  shape = (2, LENGTH)
  return (jnp.asarray(rng.normal(size=shape + (heads, head_dim)), jnp.float32),
          jnp.asarray(rng.normal(size=shape + (kv_heads, head_dim)),
                      jnp.float32),
          jnp.asarray(rng.normal(size=shape + (kv_heads, head_dim)),
                      jnp.float32))


def test_segment_masks():
  # Unpacked: a real token sees the earlier real tokens, a pad itself.
  mask = np.array([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1]], bool)
  causal = np.tril(np.ones((5, 5), bool))
  expected = (causal[None] & (mask[:, :, None] & mask[:, None, :])) | np.eye(
      5, dtype=bool)
  np.testing.assert_array_equal(attentions.causal_padding_mask(mask)[:, 0],
                                expected)
  # Packed: each token sees the earlier tokens of its own example.
  dense = np.asarray(attentions.CausalSegments(jnp.asarray(SEGMENTS)).dense())
  q, k = 9, 6
  assert dense[0, 0, q, k] and not dense[0, 0, q, 4] and not dense[0, 0, k, q]
  assert dense[0, 0, 17, 17] and not dense[0, 0, 17, 16]  # a pad: itself


def test_splash_equals_xla_forward_and_gradient():
  query, key, value = _qkv()
  segments = attentions.CausalSegments(jnp.asarray(SEGMENTS))

  def loss(impl, q, k, v):
    out = attentions.attend(q, k, v, segments, impl=impl, scale=0.3)
    return jnp.sum(jnp.where(REAL[..., None, None], out, 0.0) ** 2), out

  grads = {}
  for impl in ("xla", "splash"):
    grads[impl] = jax.jit(jax.grad(functools.partial(loss, impl),
                                   argnums=(0, 1, 2), has_aux=True))(
                                       query, key, value)
  (gx, outx), (gs, outs) = grads["xla"], grads["splash"]
  np.testing.assert_allclose(np.asarray(outs)[REAL], np.asarray(outx)[REAL],
                             atol=2e-6)
  for a, b in zip(gs, gx):
    np.testing.assert_allclose(a, b, atol=2e-5)


def test_splash_window_and_soft_cap_equal_xla():
  """Under a mesh, as in training: the kernel runs per shard (shard_map),
  the replicated key/value heads given to each query head."""
  query, key, value = _qkv()
  segments = attentions.CausalSegments(jnp.asarray(SEGMENTS))
  mesh = sharding.create_mesh((1, 1), ("data", "model"), jax.devices()[:1])
  outs = []
  for impl in ("xla", "splash"):
    with jax.set_mesh(mesh), nn.logical_axis_rules(
        sharding_rules.STANDARD_RULES):
      outs.append(jax.jit(functools.partial(
          attentions.attend, impl=impl, window=4, logit_softcap=2.0))(
              query, key, value, segments))
  np.testing.assert_allclose(np.asarray(outs[1])[REAL],
                             np.asarray(outs[0])[REAL], atol=2e-6)


def test_scanned_layers_with_different_windows_and_packing():
  """Gemma 3's sliding and global layers in one scanned stack: the
  window is traced, each layer's kernel picked by its index."""
  config = gemma3.Gemma3Config.preset(
      "tiny", num_layers=2, scan_layers=True).with_layer_types(
          (attentions.SLIDING_ATTENTION, attentions.FULL_ATTENTION))
  tokens = np.where(REAL, np.arange(2, 2 + LENGTH) % 100, 0).astype(np.int32)
  args = (tokens, _positions(SEGMENTS), REAL.astype(np.int32), SEGMENTS, 3)
  params = nn.meta.unbox(gemma3.Gemma3(config).init(jax.random.PRNGKey(0),
                                                    *args)["params"])
  logits = {impl: np.asarray(jax.jit(gemma3.Gemma3(dataclasses.replace(
      config, attention_impl=impl)).apply)({"params": params}, *args))
            for impl in ("xla", "splash")}
  np.testing.assert_allclose(logits["splash"][REAL], logits["xla"][REAL],
                             atol=2e-5)
  # Each packed example as its own row: the same logits.
  row = SEGMENTS[0] == 2
  alone = np.asarray(jax.jit(gemma3.Gemma3(config).apply)(
      {"params": params}, tokens[:1, row], _positions(SEGMENTS)[:1, row],
      np.ones((1, row.sum()), np.int32)))
  np.testing.assert_allclose(logits["xla"][0, row], alone[0], atol=2e-5)


def test_splash_prefill_samples_as_the_xla_cache(monkeypatch):
  calls = []
  splash = fused_attention.splash
  monkeypatch.setattr(fused_attention, "splash",
                      lambda *a, **k: calls.append(1) or splash(*a, **k))
  config = llama.LlamaConfig.preset("tiny")
  prompts = np.array([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]], np.int32)
  one = jnp.ones((1, 5), jnp.int32)
  params = nn.meta.unbox(llama.Llama(config).init(jax.random.PRNGKey(1), one,
                                                  one, one)["params"])
  samples = {impl: sampling.sample_decoder_only(
      llama.Llama(dataclasses.replace(config, attention_impl=impl)), params,
      prompts, prompts > 0, jax.random.PRNGKey(0), 4, greedy=True)
             for impl in ("xla", "splash")}
  assert calls  # the prefill went through the kernel
  np.testing.assert_array_equal(samples["splash"].tokens,
                                samples["xla"].tokens)
  np.testing.assert_allclose(samples["splash"].logprobs,
                             samples["xla"].logprobs, atol=1e-5)


def test_cudnn_packed_layout_describes_the_segment_mask():
  """cuDNN's packed layout (runs of equal ids: their offsets and lengths)
  with its causal mask gives the real tokens the mask of CausalSegments;
  the padding after them is one more run."""
  seqlen, offsets = fused_attention.cudnn_segment_args(
      jnp.asarray(SEGMENTS), max_runs=4)
  np.testing.assert_array_equal(seqlen, [[5, 7, 3, 5], [9, 11, -1, -1]])
  np.testing.assert_array_equal(offsets, [[0, 5, 12, 15, -1],
                                          [0, 9, -1, -1, -1]])
  dense = np.asarray(attentions.CausalSegments(jnp.asarray(SEGMENTS)).dense())
  for b in range(2):
    run = np.full(LENGTH, -1)
    for m, (start, n) in enumerate(zip(offsets[b], seqlen[b])):
      if n > 0:
        run[start:start + n] = m
    q, k = np.meshgrid(np.arange(LENGTH), np.arange(LENGTH), indexing="ij")
    cudnn_mask = (run[q] == run[k]) & (k <= q)
    real = REAL[b][:, None] & REAL[b][None, :]
    np.testing.assert_array_equal(cudnn_mask[real], dense[b, 0][real])


def _packed_layout_on_xla(query, key, value, segment_ids, *, max_runs,
                          scale, window=None):
  """What cuDNN's packed layout computes, in einsums: each position's run
  from the offsets and lengths of `cudnn_segment_args`, causal attention
  within a run (and the window); grouped key/value heads."""
  seqlen, offsets = fused_attention.cudnn_segment_args(segment_ids, max_runs)
  slots = jnp.arange(segment_ids.shape[-1])
  inside = ((slots[None, None] >= offsets[:, :max_runs, None])
            & (slots[None, None] < (offsets[:, :max_runs] + seqlen)[..., None])
            & (seqlen[..., None] > 0))
  run = jnp.where(inside.any(1), jnp.argmax(inside, axis=1), -1)
  q, k = slots[:, None], slots[None, :]
  allowed = (run[:, :, None] == run[:, None, :]) & (k <= q)
  if window is not None:
    allowed &= q - k < window
  groups = query.shape[2] // key.shape[2]
  logits = jnp.einsum("bqhd,bkhd->bhqk", query,
                      jnp.repeat(key, groups, axis=2)) * scale
  logits = jnp.where(allowed[:, None], logits, -jnp.inf)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1),
                    jnp.repeat(value, groups, axis=2))


@pytest.mark.parametrize("window", [None, 3])
def test_cudnn_unpacked_rows_are_three_runs_or_nan(monkeypatch, window):
  """Unpacked rows under 'dot_product_cudnn' go through cuDNN's packed
  layout (emulated here in einsums, since it runs on GPUs only) as
  padding, real tokens, padding: right-padded, left-padded and two-side
  padded rows give the real tokens' outputs and the gradients of the
  einsum path; a row whose real tokens have a hole gets NaN, never another
  attention."""
  monkeypatch.setattr(fused_attention, "cudnn", _packed_layout_on_xla)
  assert not fused_attention.packed_layout_available()  # a CPU
  monkeypatch.setattr(fused_attention, "packed_layout_available",
                      lambda: True)
  query, key, value = _qkv()
  real = np.zeros((2, LENGTH), np.int32)
  real[0, :13] = 1  # right-padded
  real[1, 4:17] = 1  # padded on both sides
  for mask in (real, real[:, ::-1].copy()):
    segments = attentions.CausalSegments(jnp.asarray(mask))
    keep = mask > 0

    def loss(impl, q, k, v, segments=segments, keep=keep):
      out = attentions.attend(q, k, v, segments, impl=impl, scale=0.3,
                              window=window)
      return jnp.sum(jnp.where(keep[..., None, None], out, 0.0) ** 2), out

    (gf, outf), (gx, outx) = (
        jax.grad(functools.partial(loss, impl), argnums=(0, 1, 2),
                 has_aux=True)(query, key, value)
        for impl in ("dot_product_cudnn", "xla"))
    np.testing.assert_allclose(np.asarray(outf)[keep], np.asarray(outx)[keep],
                               atol=2e-6)
    for a, b in zip(gf, gx):
      np.testing.assert_allclose(a, b, atol=2e-5)
  holes = real.copy()
  holes[0, 6] = 0
  out = attentions.attend(query, key, value,
                          attentions.CausalSegments(jnp.asarray(holes)),
                          impl="dot_product_cudnn", scale=0.3)
  assert np.isnan(np.asarray(out[0])).all()
  assert np.isfinite(np.asarray(out[1])).all()


def test_t5_says_why_it_takes_no_fused_kernel():
  with pytest.raises(ValueError, match="relative-position bias"):
    t5.T5Config(attention_impl="splash")


@pytest.mark.parametrize("arch,platform,want", [
    # Decoder-only families with the kernel: splash on TPU, nowhere else
    # (interpreted, it would be slow); cuDNN on Hopper GPUs (the next test).
    ("llama", "tpu", "splash"), ("qwen3", "tpu", "splash"),
    ("gemma", "tpu", "splash"), ("llama", "cpu", "xla"),
    # Not on a GPU without cuDNN's packed layout (these CPU devices).
    ("llama", "gpu", "xla"),
    # No fused kernel takes T5's bias; t5x's decoder-only model has 'xla'.
    ("t5", "tpu", "xla"), ("t5x_decoder_only", "tpu", "xla")])
def test_auto_attention_is_the_fused_kernel_where_the_family_has_it(
    arch, platform, want):
  model_cfg = ml_collections.ConfigDict(defaults.base_config().model)
  model_cfg.arch, model_cfg.size = arch, "tiny"
  if arch == "t5":
    model_cfg.size = "small"
  assert model_cfg.attention_impl == "auto"  # the default
  # (Gemma 2's tiny preset soft-caps its attention logits: the kernel
  # takes the cap.)
  _, config = registry.build_model(model_cfg, 256, platform)
  assert getattr(config, "attention_impl", "xla") == want
  # The run's config keeps 'auto': a checkpoint moved to other hardware
  # picks that hardware's kernel.
  assert model_cfg.attention_impl == "auto"


@pytest.mark.parametrize("arch,fields,hopper,want", [
    ("llama", {"dtype": "bfloat16"}, True, "dot_product_cudnn"),
    ("qwen3", {"dtype": "float16"}, True, "dot_product_cudnn"),
    # A GPU older than Hopper would need the dense [B, 1, L, L] mask.
    ("llama", {"dtype": "bfloat16"}, False, "xla"),
    # cuDNN's flash attention: half precision only, head sizes that are
    # multiples of 8 up to 256, no soft cap (Gemma 2's tiny preset has one).
    ("llama", {"dtype": "float32"}, True, "xla"),
    ("llama", {"dtype": "bfloat16", "head_dim": 12}, True, "xla"),
    ("llama", {"dtype": "bfloat16", "head_dim": 264}, True, "xla"),
    ("llama", {"dtype": "bfloat16", "head_dim": 256}, True,
     "dot_product_cudnn"),
    ("gemma", {"dtype": "bfloat16"}, True, "xla"),
    ("t5", {"dtype": "bfloat16"}, True, "xla")])
def test_auto_attention_on_a_gpu_is_cudnn_where_cudnn_takes_the_model(
    monkeypatch, arch, fields, hopper, want):
  monkeypatch.setattr(fused_attention, "packed_layout_available",
                      lambda: hopper)
  model_cfg = ml_collections.ConfigDict(defaults.base_config().model)
  model_cfg.arch, model_cfg.size = arch, "small" if arch == "t5" else "tiny"
  model_cfg.update(fields)
  _, config = registry.build_model(model_cfg, 256, "gpu")
  assert getattr(config, "attention_impl", "xla") == want
  # The dimensions the choice read are the model's own.
  if "head_dim" in fields:
    assert config.head_dim == fields["head_dim"]


def test_a_plan_counts_the_kernels_matmuls_as_the_dense_attentions():
  # The plan's FLOP count walks the jaxpr: a Pallas kernel's body runs
  # once per point of its grid (head x query block x key block), so splash
  # attention counts what the dense path's two matmuls do (blocks the mask
  # skips included, as the dense path computes them), not one block's.
  from jaxrlhf import flops  # pylint: disable=g-import-not-at-top
  shape = (1, 512, 2, 128)
  q = jax.ShapeDtypeStruct(shape, jnp.float32)
  segments = attentions.CausalSegments(jnp.ones(shape[:2], jnp.int32))
  dense = 2 * (2 * shape[0] * shape[2] * shape[1] ** 2 * shape[3])
  for impl in ("xla", "splash"):
    attend = functools.partial(attentions.attend, mask=segments, impl=impl,
                               scale=0.1)
    assert flops.function_flops(attend, q, q, q) == dense, impl
