r"""Benchmark of the jitted, sharded SFT train step.

  python experiments/bench_sft_step.py --size=small --batch_size=32 \
      --inputs_length=512 --targets_length=128 --dtype=bfloat16

Prints compile time, mean step time, steps/s, target tokens/s, the model's
FLOPs per step (XLA's cost analysis of the compiled step), MFU against the
given peak (--peak_tflops; default: a per-device guess from the platform) and
peak device memory where the backend reports it. Random token batches, so it
measures the step and nothing else.
"""

import argparse
import time

import flax.linen as nn
import jax
import numpy as np

from jaxrlhf import defaults
from jaxrlhf import sharding
from jaxrlhf.train import sft

_PEAK_TFLOPS = {"cpu": None, "gpu": 989.0, "tpu": 197.0}  # H100 bf16, v5e bf16


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--size", default="tiny")
  p.add_argument("--batch_size", type=int, default=32)
  p.add_argument("--inputs_length", type=int, default=64)
  p.add_argument("--targets_length", type=int, default=64)
  p.add_argument("--num_microbatches", type=int, default=1)
  p.add_argument("--dtype", default="float32")
  p.add_argument("--remat_policy", default="none")
  p.add_argument("--optimizer", default="adafactor")
  p.add_argument("--mesh", default="-1,1", help="data,model mesh shape")
  p.add_argument("--vocab_size", type=int, default=32128)
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--peak_tflops", type=float, default=None,
                 help="per-device peak for MFU")
  args = p.parse_args()

  c = defaults.base_config()
  c.model.size = args.size
  c.model.vocab_size = args.vocab_size
  c.model.dtype = args.dtype
  c.model.remat_policy = args.remat_policy
  c.optimizer.name = args.optimizer
  c.train.batch_size = args.batch_size
  c.train.num_microbatches = args.num_microbatches
  c.data.inputs_length = args.inputs_length
  c.data.targets_length = args.targets_length
  c.mesh.shape = tuple(int(x) for x in args.mesh.split(","))
  defaults.validate(c)
  mesh = sharding.create_mesh(c.mesh.shape, c.mesh.axis_names)
  rules = sharding.as_rules(c.sharding.logical_axis_rules)
  rng = np.random.default_rng(0)
  b, li, lt = args.batch_size, args.inputs_length, args.targets_length
  targets = rng.integers(2, 1000, (b, lt), dtype=np.int32)
  local = {
      "encoder_input_tokens": rng.integers(2, 1000, (b, li), dtype=np.int32),
      "decoder_target_tokens": targets,
      "decoder_input_tokens": np.concatenate(
          [np.zeros((b, 1), np.int32), targets[:, :-1]], 1),
      "decoder_loss_weights": np.ones((b, lt), np.int32),
  }
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    recipe = sft.SFTRecipe(c, mesh)
    state = recipe.init_state()
    batch = sharding.global_batch(local, mesh, rules)
    t0 = time.perf_counter()
    compiled = recipe.train_step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    flops = float(cost.get("flops", 0.0)) if cost else 0.0
    state, m = compiled(state, batch)  # warm-up
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for _ in range(args.steps):
      state, m = compiled(state, batch)
    jax.block_until_ready(m)
    step_s = (time.perf_counter() - t0) / args.steps

  n_params = sum(x.size for x in jax.tree.leaves(state.params))
  platform = jax.devices()[0].platform
  peak = args.peak_tflops or _PEAK_TFLOPS.get(platform)
  print(f"device: {jax.devices()[0].device_kind} x{jax.device_count()} "
        f"({platform}); mesh {dict(mesh.shape)}")
  print(f"model: t5 {args.size} ({n_params / 1e6:.1f}M params, {args.dtype}); "
        f"batch {b} x ({li} in, {lt} out); optimizer {args.optimizer}")
  print(f"compile: {compile_s:.1f} s")
  print(f"step time: {step_s * 1e3:.2f} ms | {1 / step_s:.2f} steps/s | "
        f"{b * lt / step_s:,.0f} target tokens/s | "
        f"{b * (li + lt) / step_s:,.0f} total tokens/s")
  if flops:
    achieved = flops / step_s / 1e12
    line = f"XLA FLOPs/step: {flops / 1e9:.2f} GFLOP | {achieved:.3f} TFLOP/s"
    if peak:
      line += f" | MFU {achieved / (peak * jax.device_count()):.1%} of {peak} TFLOP/s per device"
    print(line)
  stats = jax.devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    print(f"peak device memory: {stats['peak_bytes_in_use'] / 2**30:.2f} GiB")


if __name__ == "__main__":
  main()
