"""What the benchmark scripts share: model and batch-shape flags, the
config they make, and timing.

Each benchmark builds its trainer from `config_from_flags(args, algorithm)`
so that a flag means the same in every script. JAX and jaxrlhf are imported
where they are used, so that a script can parse its flags (and set thread
counts, or run a process without JAX) first.
"""

import argparse
import time


def peak_tflops():
  """Dense bf16 peak of this machine's devices (jaxrlhf.accelerators), for
  MFU when --peak_tflops is not given; None on a CPU."""
  import jax  # pylint: disable=g-import-not-at-top
  from jaxrlhf import accelerators  # pylint: disable=g-import-not-at-top
  chip = accelerators.chip(jax.devices()[0].device_kind)
  return chip.peak_bf16_tflops if chip else None


def add_shape_flags(p: argparse.ArgumentParser, *, optimizer: str,
                    steps: int) -> None:
  """Model, batch and mesh flags, with the script's defaults."""
  p.add_argument("--arch", default="t5",
                 help="t5, llama, gpt_neox or t5x_decoder_only")
  p.add_argument("--size", default="tiny", help="the arch's size preset")
  p.add_argument("--batch_size", type=int, default=32)
  p.add_argument("--inputs_length", type=int, default=64)
  p.add_argument("--targets_length", type=int, default=64)
  p.add_argument("--vocab_size", type=int, default=32128)
  for field in _DIMENSIONS:
    p.add_argument(f"--{field}", type=int, default=None,
                   help="overrides the size preset's" + (
                       " (decoder layers; a T5's encoder too)"
                       if field == "num_layers" else ""))
  p.add_argument("--dtype", default="float32")
  p.add_argument("--remat_policy", default="none")
  p.add_argument("--attention_impl", default="auto",
                 help="config.model.attention_impl ('auto': the platform's "
                 "default; 'dot_product_cudnn': cuDNN's flash attention)")
  p.add_argument("--num_microbatches", type=int, default=1)
  p.add_argument("--optimizer", default=optimizer)
  p.add_argument("--mesh", default="-1,1", help="data,model mesh shape")
  p.add_argument("--steps", type=int, default=steps,
                 help="timed repetitions")


# Model dimensions a flag may override (config.model fields; num_layers is
# num_decoder_layers, and a T5's num_encoder_layers too).
_DIMENSIONS = ("emb_dim", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
               "num_layers")


def _dimension_overrides(args):
  out = {}
  for field in _DIMENSIONS:
    value = getattr(args, field, None)
    if value is None:
      continue
    if field == "num_layers":
      out["model.num_decoder_layers"] = value
      if args.arch == "t5":
        out["model.num_encoder_layers"] = value
    else:
      out[f"model.{field}"] = value
  return out


def config_from_flags(args, algorithm: str, **overrides):
  """A validated config with the flags' model, shapes, optimizer and mesh,
  and `overrides` ({"online.num_epochs": 4}) of the script's own."""
  from jaxrlhf import defaults  # pylint: disable=g-import-not-at-top
  c = defaults.base_config()
  defaults.apply_overrides(c, {
      "algorithm": algorithm,
      "model.arch": args.arch,
      "model.size": args.size,
      "model.vocab_size": args.vocab_size,
      "model.dtype": args.dtype,
      "model.remat_policy": args.remat_policy,
      "model.attention_impl": args.attention_impl,
      "optimizer.name": args.optimizer,
      "train.batch_size": args.batch_size,
      "train.num_microbatches": args.num_microbatches,
      "data.inputs_length": args.inputs_length,
      "data.targets_length": args.targets_length,
      "mesh.shape": tuple(int(x) for x in args.mesh.split(",")),
      **_dimension_overrides(args),
      **overrides,
  })
  defaults.validate(c)
  return c


def timed(fn, *args, repeats: int):
  """(mean seconds per call after one compiling call, the last output)."""
  import jax  # pylint: disable=g-import-not-at-top
  out = fn(*args)
  jax.block_until_ready(out)
  start = time.perf_counter()
  for _ in range(repeats):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / repeats, out


def device_line(mesh) -> str:
  import jax  # pylint: disable=g-import-not-at-top
  d = jax.devices()[0]
  return (f"device: {d.device_kind} x{jax.device_count()} ({d.platform}); "
          f"mesh {dict(mesh.shape)}")


def peak_memory_line():
  import jax  # pylint: disable=g-import-not-at-top
  stats = jax.devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    return f"peak device memory: {stats['peak_bytes_in_use'] / 2**30:.2f} GiB"
  return None
