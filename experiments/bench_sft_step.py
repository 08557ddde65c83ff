r"""Benchmark of the jitted, sharded SFT train step.

  python experiments/bench_sft_step.py --size=small --batch_size=32 \
      --inputs_length=512 --targets_length=128 --dtype=bfloat16
  python experiments/bench_sft_step.py --arch=llama --size=tinyllama-1.1b \
      --dtype=bfloat16 --vocab_size=32000

Prints compile time, mean step time, steps/s, target tokens/s, the model's
FLOPs per step (the matmuls of the step's jaxpr, jaxrlhf.flops), MFU against the
given peak (--peak_tflops; default: the device's data sheet) and
peak device memory where the backend reports it. Random token batches, so it
measures the step and nothing else. Decoder-only models train on the prompt
and target as one sequence of inputs_length + targets_length tokens, with the
loss on the target.
"""

import argparse
import time

import jax
import numpy as np

import bench_common
from jaxrlhf import algorithms
from jaxrlhf import flops as jaxrlhf_flops
from jaxrlhf import sharding


def random_batch(is_encoder_decoder: bool, b: int, li: int, lt: int):
  rng = np.random.default_rng(0)
  prompt = rng.integers(2, 1000, (b, li), dtype=np.int32)
  targets = rng.integers(2, 1000, (b, lt), dtype=np.int32)
  if is_encoder_decoder:
    return {
        "encoder_input_tokens": prompt,
        "decoder_target_tokens": targets,
        "decoder_input_tokens": np.concatenate(
            [np.zeros((b, 1), np.int32), targets[:, :-1]], 1),
        "decoder_loss_weights": np.ones((b, lt), np.int32),
    }
  length = li + lt
  return {
      "tokens": np.concatenate([prompt, targets], 1),
      "loss_weights": np.concatenate([np.zeros((b, li), np.int32),
                                      np.ones((b, lt), np.int32)], 1),
      "positions": np.tile(np.arange(length, dtype=np.int32), (b, 1)),
      "attention_mask": np.ones((b, length), np.int32),
  }


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawTextHelpFormatter)
  bench_common.add_shape_flags(p, optimizer="adafactor", steps=20)
  p.add_argument("--peak_tflops", type=float, default=None,
                 help="per-device peak for MFU")
  args = p.parse_args()

  c = bench_common.config_from_flags(args, "sft")
  rules = sharding.as_rules(c.sharding.logical_axis_rules)
  b, li, lt = args.batch_size, args.inputs_length, args.targets_length
  with sharding.activate(c) as mesh:
    trainer = algorithms.build(c, mesh)
    state = trainer.init_state()
    batch = sharding.global_batch(
        random_batch(trainer.lm.is_encoder_decoder, b, li, lt), mesh, rules)
    t0 = time.perf_counter()
    compiled = trainer.train_step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    # Matmul FLOPs of the whole step (every device), layers and
    # micro-batches counted by their trip count (jaxrlhf.flops).
    flops = jaxrlhf_flops.function_flops(trainer.train_step, state, batch)
    state, m = compiled(state, batch)  # warm-up
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for _ in range(args.steps):
      state, m = compiled(state, batch)
    jax.block_until_ready(m)
    step_s = (time.perf_counter() - t0) / args.steps

  n_params = sum(x.size for x in jax.tree.leaves(state.params))
  peak = args.peak_tflops or bench_common.peak_tflops()
  print(bench_common.device_line(mesh))
  print(f"model: {args.arch} {args.size} ({n_params / 1e6:.1f}M params, "
        f"{args.dtype}); batch {b} x ({li} in, {lt} out); optimizer "
        f"{args.optimizer}")
  print(f"compile: {compile_s:.1f} s")
  print(f"step time: {step_s * 1e3:.2f} ms | {1 / step_s:.2f} steps/s | "
        f"{b * lt / step_s:,.0f} target tokens/s | "
        f"{b * (li + lt) / step_s:,.0f} total tokens/s")
  if flops:
    achieved = flops / step_s / 1e12
    line = f"FLOPs/step: {flops / 1e9:.2f} GFLOP | {achieved:.3f} TFLOP/s"
    if peak:
      line += (f" | MFU {achieved / (peak * jax.device_count()):.1%} of "
               f"{peak} TFLOP/s per device")
    print(line)
  memory = bench_common.peak_memory_line()
  if memory:
    print(memory)


if __name__ == "__main__":
  main()
