"""Causal self-attention's paths, checked and timed on one device (issue 24,
item 4): the einsums ('xla'), cuDNN with the dense [batch, 1, L, L] mask
(which it reads as a bias and differentiates), and what
model.attention_impl='dot_product_cudnn' runs, cuDNN's packed layout:
unpacked rows as three runs, padding, real tokens, padding
(`fused_attention.cudnn_unpacked`), packing's segments as theirs
(`fused_attention.cudnn`).

  python experiments/bench_attention.py                 # on a GPU (sm90+)
  python experiments/bench_attention.py --smoke         # tiny, on the CPU

For each path: the forward and backward pass's time (jit, median of
--repeats calls) and its largest error on the real tokens' outputs and on
the query/key/value gradients against the einsums in float32, relative to
the largest reference value; the einsums in the compute dtype beside them
give the rounding that is expected. A path whose error exceeds 4x that of
the einsums in the compute dtype (and 1e-2) is reported as FAILED and the
exit status is 1. On a CPU the dense mask runs through
jax.nn.dot_product_attention's XLA implementation (its arguments, not
cuDNN's kernel), and the packed layout, which has no such twin, is
skipped.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

from jaxrlhf import console  # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxrlhf.models.layers import attentions  # pylint: disable=g-import-not-at-top,wrong-import-position


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--smoke", action="store_true",
                 help="tiny shapes on the CPU (the dense mask's arguments "
                 "through XLA)")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--length", type=int, default=512)
  p.add_argument("--heads", type=int, default=32)
  p.add_argument("--kv_heads", type=int, default=4)
  p.add_argument("--head_dim", type=int, default=64)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--repeats", type=int, default=10)
  args = p.parse_args(argv)
  if args.smoke:
    args.batch, args.length, args.heads, args.kv_heads = 2, 16, 4, 2
    args.head_dim, args.repeats = 8, 2
  return args


def rows(batch, length):
  """Attention masks: right-padded rows (real tokens first, as the offline
  trainers' rows), rows padded on both sides (a left-padded prompt and a
  right-padded response, as the online step's), and packed segment ids
  (three examples per row, then padding)."""
  rng = np.random.default_rng(0)
  lengths = rng.integers(length // 2, length + 1, size=batch)
  lengths[0] = length
  right = (np.arange(length)[None] < lengths[:, None]).astype(np.int32)
  starts = rng.integers(0, length // 4, size=batch)
  both = ((np.arange(length)[None] >= starts[:, None])
          & (np.arange(length)[None] < (starts + lengths // 2)[:, None])
          ).astype(np.int32)
  packed = np.zeros((batch, length), np.int32)
  for b in range(batch):
    cuts = np.sort(rng.choice(np.arange(1, length - 8), 3, replace=False))
    for s, (lo, hi) in enumerate(zip((0, *cuts[:-1]), cuts), start=1):
      packed[b, lo:hi] = s
  return {"right-padded": right, "padded both sides": both,
          "packed (3 examples)": packed}


def main(argv=None):
  args = parse_args(argv)
  console.silence_library_noise(python_loggers=True)
  device = jax.devices()[0]
  on_gpu = device.platform == "gpu"
  implementation = "cudnn" if on_gpu else "xla"
  dtype = jnp.dtype(args.dtype)
  print(f"device: {device.device_kind} ({device.platform}); batch "
        f"{args.batch} x {args.length}, heads {args.heads}/{args.kv_heads} "
        f"x {args.head_dim}, {dtype.name}; "
        + ("cuDNN's kernels" if on_gpu else
           "no GPU: the dense mask through XLA, no packed layout"))
  rng = np.random.default_rng(1)
  b, l = args.batch, args.length

  def normal(*shape):
    return jnp.asarray(rng.normal(size=shape), jnp.float32)

  q = normal(b, l, args.heads, args.head_dim)
  k = normal(b, l, args.kv_heads, args.head_dim)
  v = normal(b, l, args.kv_heads, args.head_dim)
  cotangent = normal(b, l, args.heads, args.head_dim)
  scale = 1.0 / np.sqrt(args.head_dim)

  def grads_of(attention, mask, cast):
    real = jnp.asarray(mask > 0)[:, :, None, None]

    def loss(q, k, v):
      out = attention(q.astype(cast), k.astype(cast), v.astype(cast))
      out = jnp.where(real, out.astype(jnp.float32), 0.0)
      return jnp.sum(out * cotangent), out
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))

  def einsums(mask):
    return lambda q, k, v: attentions.attend(
        q, k, v, attentions.CausalSegments(jnp.asarray(mask)), impl="xla",
        scale=scale)

  def dense_mask(mask):
    dense = attentions.CausalSegments(jnp.asarray(mask)).dense()
    return lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, mask=dense, scale=scale, implementation=implementation)

  def packed_layout(mask, packed):
    # What the model runs: packing's segments say their bound on runs.
    segments = attentions.CausalSegments(jnp.asarray(mask),
                                         max_runs=4 if packed else None)
    return lambda q, k, v: attentions.attend(
        q, k, v, segments, impl="dot_product_cudnn", scale=scale)

  def measure(fn):
    result = fn(q, k, v)
    jax.block_until_ready(result)
    times = []
    for _ in range(args.repeats):
      start = time.perf_counter()
      jax.block_until_ready(fn(q, k, v))
      times.append(time.perf_counter() - start)
    return result, float(np.median(times))

  def error(got, want):
    (_, out), grads = got
    (_, want_out), want_grads = want
    return max(float(jnp.max(jnp.abs(a - w)) / jnp.max(jnp.abs(w)))
               for a, w in zip((out, *grads), (want_out, *want_grads)))

  failed = False
  print(f"{'rows':20} {'path':28} {'fwd+bwd ms':>10} {'rel. error':>10}")
  for name, mask in rows(b, l).items():
    packed = name.startswith("packed")
    reference, _ = measure(grads_of(einsums(mask), mask, jnp.float32))
    paths = [("einsums", einsums(mask))]
    if not packed:
      paths.append(("cuDNN, dense mask as bias", dense_mask(mask)))
    if on_gpu:
      paths.append((f"cuDNN, packed layout ({4 if packed else 3} runs)",
                    packed_layout(mask, packed)))
    baseline = None
    for label, attention in paths:
      try:
        got, seconds = measure(grads_of(attention, mask, dtype))
      except Exception as e:  # pylint: disable=broad-except
        print(f"{name:20} {label:28} FAILED: {type(e).__name__}: "
              f"{str(e).splitlines()[0][:200]}")
        failed = True
        continue
      err = error(got, reference)
      baseline = err if baseline is None else baseline
      bad = err > max(4 * baseline, 1e-2)
      failed |= bad
      print(f"{name:20} {label:28} {seconds * 1e3:>10.3f} {err:>10.2e}"
            + ("  FAILED: larger than the einsums' rounding" if bad else ""))
  sys.stdout.flush()
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
