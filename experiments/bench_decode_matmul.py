"""The matrix products of a decode step alone, against the memory bandwidth
(issue 24, item 6: decoding reaches 35-43% of the HBM bound on an H100, and
its matrix products are 76% of a decode step, streaming the weights at
about half the bandwidth).

  python experiments/bench_decode_matmul.py               # on a GPU
  python experiments/bench_decode_matmul.py --smoke       # tiny, on the CPU

The products of a Llama 3.2 1B-shaped layer (width 2048; 32 query heads and
8 KV heads of 64; MLP 8192; bf16) at decoding's batch sizes (the rows of
each product: the sequences decoded at once), over --layers layers whose
weights are all distinct, so that they stream from memory as in decoding
(one layer's weights, 67 MB, would fit the 50 MB L2 of an H100 nearly
whole), in one jit-compiled call:

  separate  q, k, v from one input, o, gate and up from one input, down:
            the seven products of our layers (`layers.Attention`, the
            gated `layers.Mlp`), bf16 in and out as they compute them,
            which XLA may merge where they share an input (its dot
            merger);
  fused     qkv, o, gate_up, down: four products on weights concatenated
            beforehand, as a sampler could hold them for a rollout;
  lm_head   the 128,256-token output layer alone.

For each: microseconds per layer that the device ran kernels (traced over
--repeats calls, `bench_common.device_busy_seconds`: the kernels' cost,
without the host's dispatch of a call of ~200 arguments and the gaps
between launches, which make up most of these short calls' wall time; the
wall time, median of --repeats calls, beside it), the bytes read (weights
and inputs) per busy second and their share of the device's HBM bandwidth
(jaxrlhf.accelerators), and the products' largest difference from float32
matmuls relative to the largest output (the fused and separate paths
compute the same numbers). A variant of XLA's flags runs each in its own
process: --xla_flags takes a '|'-separated list ('' is the default flags);
--profile lists the kernels of one call of each
(bench_common.kernel_profile).
"""

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--batches", default="64,128",
                 help="rows of each product, comma-separated")
  p.add_argument("--layers", type=int, default=16)
  p.add_argument("--width", type=int, default=2048)
  p.add_argument("--heads", type=int, default=32)
  p.add_argument("--kv_heads", type=int, default=8)
  p.add_argument("--head_dim", type=int, default=64)
  p.add_argument("--mlp", type=int, default=8192)
  p.add_argument("--vocab", type=int, default=128256)
  p.add_argument("--repeats", type=int, default=20)
  p.add_argument("--xla_flags", default="",
                 help="'|'-separated XLA_FLAGS values, each run in its own "
                 "process ('': the default flags)")
  p.add_argument("--profile", action="store_true")
  p.add_argument("--smoke", action="store_true",
                 help="tiny shapes, on the CPU")
  p.add_argument("--hbm_gbps", type=float, default=0.0,
                 help="memory bandwidth in GB/s (0: from the device kind)")
  args = p.parse_args(argv)
  if args.smoke:
    args.batches, args.layers, args.width, args.heads = "2,4", 2, 64, 4
    args.kv_heads, args.head_dim, args.mlp, args.vocab = 2, 16, 128, 256
    args.repeats = 2
  return args


def weights(args, rng):
  """Per layer the separate and the fused weights (the same numbers)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  d, q, kv, f = (args.width, args.heads * args.head_dim,
                 args.kv_heads * args.head_dim, args.mlp)

  def w(*shape):
    return jnp.asarray(rng.standard_normal(shape, np.float32)
                       / np.sqrt(shape[0]), jnp.bfloat16)

  separate, fused = [], []
  for _ in range(args.layers):
    layer = dict(q=w(d, q), k=w(d, kv), v=w(d, kv), o=w(q, d), gate=w(d, f),
                 up=w(d, f), down=w(f, d))
    separate.append(layer)
    fused.append(dict(
        qkv=jnp.concatenate([layer["q"], layer["k"], layer["v"]], 1),
        o=layer["o"], gate_up=jnp.concatenate([layer["gate"], layer["up"]],
                                              1),
        down=layer["down"]))
  return separate, fused, w(d, args.vocab)


def inputs(args, batch, rng):
  """Per layer the inputs of the attention's projections, of its output
  projection, of the MLP and of its down projection: distinct arrays, as a
  layer's are."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  def x(n):
    return jnp.asarray(rng.standard_normal((batch, n), np.float32),
                       jnp.bfloat16)

  q = args.heads * args.head_dim
  return [dict(attn=x(args.width), o=x(q), mlp=x(args.width),
               down=x(args.mlp)) for _ in range(args.layers)]


def _dot(a, b):
  """a [rows, K] . b [K, N] in the inputs' dtype, as `layers.DenseGeneral`
  computes (bf16 in, bf16 out, float32 sums inside the kernel)."""
  import jax  # pylint: disable=g-import-not-at-top
  return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())))


def separate_products(xs, ws):
  dot = _dot
  out = []
  for x, w in zip(xs, ws):
    out.append((dot(x["attn"], w["q"]), dot(x["attn"], w["k"]),
                dot(x["attn"], w["v"]), dot(x["o"], w["o"]),
                dot(x["mlp"], w["gate"]), dot(x["mlp"], w["up"]),
                dot(x["down"], w["down"])))
  return out


def fused_products(xs, ws):
  dot = _dot
  return [(dot(x["attn"], w["qkv"]), dot(x["o"], w["o"]),
           dot(x["mlp"], w["gate_up"]), dot(x["down"], w["down"]))
          for x, w in zip(xs, ws)]


def lm_head_product(x, w):
  return _dot(x, w)


def _nbytes(tree):
  import jax  # pylint: disable=g-import-not-at-top
  return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))


def _median_seconds(fn, args, repeats):
  import jax  # pylint: disable=g-import-not-at-top
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return sorted(times)[len(times) // 2]


def _error(got, want):
  """Largest |got - want| relative to the largest |want|."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  got = [np.asarray(a, np.float32) for a in jax.tree.leaves(got)]
  want = [np.asarray(a, np.float32) for a in jax.tree.leaves(want)]
  scale = max(float(np.abs(w).max()) for w in want)
  return max(float(np.abs(g - w).max()) for g, w in zip(got, want)) / scale


def run(args):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import bench_common  # pylint: disable=g-import-not-at-top
  from jaxrlhf import console  # pylint: disable=g-import-not-at-top
  console.silence_library_noise(python_loggers=True)
  device = jax.devices()[0]
  gbps = bench_common.hbm_gbps(args.hbm_gbps)
  rng = np.random.default_rng(0)
  separate, fused, head = weights(args, rng)
  print(f"device: {device.device_kind} ({device.platform}); XLA_FLAGS="
        f"{os.environ.get('XLA_FLAGS', '')!r}; {args.layers} layers of "
        f"{_nbytes(separate[0]) / 1e6:.1f} MB, output layer "
        f"{_nbytes(head) / 1e6:.1f} MB, bf16")
  header = (f"{'batch':>5} {'path':9} {'products':>8} {'us/layer':>9} "
            f"{'GB/s':>7} {'of HBM':>7} {'wall us':>8} {'error':>8}")
  print(header)
  print("-" * len(header))
  float32 = lambda tree: jax.tree.map(lambda a: a.astype(jnp.float32), tree)
  failed = False
  for batch in (int(b) for b in args.batches.split(",")):
    xs = inputs(args, batch, rng)
    want = separate_products(float32(xs), float32(separate))
    paths = (("separate", jax.jit(separate_products), (xs, separate), 7,
              args.layers),
             ("fused", jax.jit(fused_products), (xs, fused), 4, args.layers),
             ("lm_head", jax.jit(lm_head_product), (xs[0]["mlp"], head), 1,
              1))
    for name, fn, call_args, products, per in paths:
      wall = _median_seconds(fn, call_args, args.repeats)

      def calls(n, fn=fn, call_args=call_args):
        for _ in range(n):
          out = fn(*call_args)
        jax.block_until_ready(out)

      # Without a trace (no profiler), the wall time stands in.
      seconds = bench_common.device_busy_seconds(calls, args.repeats) or wall
      moved = _nbytes(call_args)
      row = (f"{batch:>5} {name:9} {products:>8} {seconds / per * 1e6:>9.1f} "
             f"{moved / seconds / 1e9:>7.0f} ")
      row += f"{moved / seconds / (gbps * 1e9):>7.0%}" if gbps else f"{'-':>7}"
      row += f" {wall / per * 1e6:>8.1f}"
      if name == "lm_head":
        error = _error(fn(*call_args),
                       lm_head_product(*float32(call_args)))
      else:
        got = fn(*call_args)
        if name == "fused":
          # Back to the separate products' layout: the same numbers.
          q, kv = (args.heads * args.head_dim,
                   args.kv_heads * args.head_dim)
          got = [(qkv[:, :q], qkv[:, q:q + kv], qkv[:, q + kv:], o,
                  gu[:, :args.mlp], gu[:, args.mlp:], dn)
                 for qkv, o, gu, dn in got]
        error = _error(got, want)
      # bf16 outputs of float32 sums: a relative error near 2^-8.
      failed |= error > 2e-2
      print(row + f" {error:>8.1e}" + ("  FAILED" if error > 2e-2 else ""))
      if args.profile:
        compiled = fn.lower(*call_args).compile()
        for line in bench_common.kernel_profile(
            calls, 3, "layer", units_per_call=per, top=6,
            hlo=compiled.as_text()):
          print("      " + line)
  return 1 if failed else 0


def main():
  args = parse_args()
  if args.smoke:
    os.environ["JAX_PLATFORMS"] = "cpu"
  variants = args.xla_flags.split("|")
  if len(variants) == 1:
    if variants[0]:
      os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " "
                                 + variants[0]).strip()
    sys.exit(run(args))
  status = 0
  for flags in variants:
    argv = [a for a in sys.argv[1:] if not a.startswith("--xla_flags")]
    sys.stdout.flush()
    status |= subprocess.call([sys.executable, __file__, *argv,
                               f"--xla_flags={flags}"])
  sys.exit(status)


if __name__ == "__main__":
  main()
