r"""Tokens per second of `MoeMlp`'s forward and backward pass, its experts
whole on one device against split over 8 simulated CPU devices (expert
parallelism, `sharding.experts_over`); figures printed, nothing asserted.

  python experiments/bench_moe.py [--tokens=1024] [--steps=5]

Sets XLA_FLAGS=--xla_force_host_platform_device_count=8 itself. On a CPU
`jax.lax.ragged_dot` is lowered to a dense product per expert, masked to
its rows, so each device's cost grows with the experts it holds: split 8
ways, a device holds 1/8 of them. The 8 devices share the host's cores, so
the split figure is the same work in smaller pieces plus the exchange, not
a speed-up 8 chips would show.
"""

import argparse
import os
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxrlhf import sharding  # noqa: E402
from jaxrlhf import sharding_rules  # noqa: E402
from jaxrlhf.models.layers import moe  # noqa: E402


def _timed(step, params, x, steps):
  """Seconds per call of `step` after its compilation."""
  jax.block_until_ready(step(params, x))
  start = time.perf_counter()
  for _ in range(steps):
    out = step(params, x)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / steps


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--tokens", type=int, default=1024)
  parser.add_argument("--embed", type=int, default=128)
  parser.add_argument("--mlp", type=int, default=256)
  parser.add_argument("--experts", type=int, default=8)
  parser.add_argument("--top_k", type=int, default=2)
  parser.add_argument("--steps", type=int, default=5)
  args = parser.parse_args()

  block = moe.MoeMlp(num_experts=args.experts, top_k=args.top_k,
                     mlp_dim=args.mlp)
  x = jax.random.normal(jax.random.PRNGKey(0), (8, args.tokens // 8,
                                                args.embed))
  boxed = block.init(jax.random.PRNGKey(1), x)["params"]
  params = nn.unbox(boxed)

  def loss(params, x):
    y, logits = block.apply({"params": params}, x)
    return jnp.mean(y ** 2) + moe.load_balancing_loss(logits, args.top_k,
                                                      args.experts)

  step = jax.jit(jax.value_and_grad(loss))
  print(f"MoeMlp forward + backward: {args.tokens} tokens, embed "
        f"{args.embed}, mlp {args.mlp}, {args.experts} experts, top "
        f"{args.top_k}, float32, {os.cpu_count()} host cores")
  whole = _timed(step, params, x, args.steps)
  print(f"  experts whole, 1 device:     {args.tokens / whole:10.0f} "
        f"tokens/s ({whole * 1e3:.1f} ms per step)")

  mesh = sharding.create_mesh((8, 1), ("data", "model"))
  rules = sharding.experts_over(sharding_rules.STANDARD_RULES, "data")
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    placed = jax.device_put(params,
                            sharding.tree_shardings(boxed, mesh, rules))
    x_split = jax.device_put(x, sharding.batch_sharding(mesh, rules, 3))
    split_step = jax.jit(jax.value_and_grad(loss))
    split = _timed(split_step, placed, x_split, args.steps)
  print(f"  experts split over 8 devices: {args.tokens / split:10.0f} "
        f"tokens/s ({split * 1e3:.1f} ms per step)")


if __name__ == "__main__":
  main()
