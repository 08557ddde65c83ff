"""What the benchmark scripts share: model and batch-shape flags, the
config they make, and timing.

Each benchmark builds its trainer from `config_from_flags(args, algorithm)`
so that a flag means the same in every script. JAX and jaxrlhf are imported
where they are used, so that a script can parse its flags (and set thread
counts, or run a process without JAX) first.
"""

import argparse
import re
import time
from typing import Optional


def peak_tflops():
  """Dense bf16 peak of this machine's devices (jaxrlhf.accelerators), for
  MFU when --peak_tflops is not given; None on a CPU."""
  import jax  # pylint: disable=g-import-not-at-top
  from jaxrlhf import accelerators  # pylint: disable=g-import-not-at-top
  chip = accelerators.chip(jax.devices()[0].device_kind)
  return chip.peak_bf16_tflops if chip else None


def hbm_gbps(given: float = 0.0) -> float:
  """Memory bandwidth in GB/s of this machine's devices
  (jaxrlhf.accelerators), for the share of it a benchmark reaches: `given`
  (a --hbm_gbps flag) when set, else the chip's, else 0.0 (a CPU)."""
  if given:
    return given
  import jax  # pylint: disable=g-import-not-at-top
  from jaxrlhf import accelerators  # pylint: disable=g-import-not-at-top
  chip = accelerators.chip(jax.devices()[0].device_kind)
  return chip.hbm_gbps if chip else 0.0


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


# Kernel names by what they compute (matched on the lower-cased name, first
# match wins): fused attention (whose kernels use the matrix units too, so
# first), cuBLAS's and CUTLASS's matrix products (XLA's own Triton ones are
# "gemm_fusion"s; nvjet and xmma are cuBLAS's Hopper kernels), data
# movement; the rest are XLA's elementwise and reduction fusions.
_KERNEL_KINDS = (
    ("attention", re.compile(r"flash|fmha|cudnn|attention|sdpa")),
    ("matmul", re.compile(r"gemm|cublas|cutlass|nvjet|xmma|wgmma|matmul|"
                          r"(^|[^a-z])dot([^a-z]|$)")),
    ("copy", re.compile(r"memcpy|memset|copy|transpose|dynamic.update.slice")),
    ("reduction", re.compile(r"reduce")),
)


_CONTROL_FLOW = re.compile(r"(while|conditional|call)(\.\d+)?$")


def _kernel_kind(name: str) -> str:
  low = name.lower()
  for kind, pattern in _KERNEL_KINDS:
    if pattern.search(low):
      return kind
  return "other"


def _traced_ops(path):
  """(name, start ns, duration ns) of each device kernel in the trace at
  `path` (jax.profiler's XSpace file, read by jax.profiler.ProfileData): a
  GPU's streams, a TPU's "XLA Ops", or on a CPU the XLA client threads'
  operations."""
  import jax  # pylint: disable=g-import-not-at-top
  data = jax.profiler.ProfileData.from_file(path)

  def events(plane, keep_line, keep_name=lambda n: True):
    return [(e.name, e.start_ns, e.duration_ns)
            for line in plane.lines if keep_line(line.name)
            for e in line.events if keep_name(e.name)]

  devices = [p for p in data.planes if p.name.startswith("/device:")]
  ops = []
  for plane in devices:
    ops += (events(plane, lambda n: n.startswith("Stream"))
            or events(plane, lambda n: n == "XLA Ops"))
  if devices:
    return ops
  for plane in data.planes:
    if plane.name == "/host:CPU":
      # Not ops: the thread pools' bookkeeping ("Pool::Await"), and the
      # control flow (a while loop's event holds its body's).
      ops += events(plane, lambda n: n.startswith("tf_XLA"),
                    lambda n: not ("::" in n or n.startswith("end: ")
                                   or _CONTROL_FLOW.match(n)))
  return ops


def _busy(ops):
  """The length of the union of the ops' [start, start + duration)
  intervals: the time some kernel ran, streams that overlap counted once."""
  busy, end = 0, None
  for start, duration in sorted((s, d) for _, s, d in ops):
    stop = start + duration
    if end is None or start >= end:
      busy += duration
      end = stop
    elif stop > end:
      busy += stop - end
      end = stop
  return busy


def _hlo_origin(hlo: str, name: str) -> str:
  """'shape <- the JAX operation' of the instruction `name` in a compiled
  program's text (its result shape and the op_name of its metadata, the
  end of that path), or '' where the text has no such instruction. A GPU's
  trace names a fusion with '_' where the program has '.'
  (loop_select_fusion_34 for loop_select_fusion.34)."""
  pattern = re.escape(name).replace("_", "[._]")
  found = re.search(rf"^\s*(?:ROOT\s+)?%?{pattern} = (\(.*?\)|\S+) .*$",
                    hlo, re.MULTILINE)
  if not found:
    return ""
  op = re.search(r'op_name="([^"]*)"', found.group(0))
  origin = op.group(1) if op else ""
  if len(origin) > 90:
    origin = "..." + origin[-87:]
  return f"{found.group(1)}" + (f" <- {origin}" if origin else "")


def _trace(run, calls: int):
  """(the device's kernels as `_traced_ops` lists them, wall seconds) of
  `calls` calls of `run(calls)`, traced with jax.profiler."""
  import glob  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  logdir = tempfile.mkdtemp(prefix="bench_profile_")
  with jax.profiler.trace(logdir):
    start = time.perf_counter()
    run(calls)
    wall = time.perf_counter() - start
  paths = glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)
  return (_traced_ops(paths[0]) if paths else []), wall


def device_busy_seconds(run, calls: int) -> Optional[float]:
  """Seconds per call that the device ran kernels (the union of their
  intervals, `_busy`) over `calls` traced calls of `run(calls)`: a
  kernel's cost without the host's dispatch and the gaps between launches,
  which dominate the wall time of short calls. None where the profiler is
  missing or traced nothing."""
  try:
    ops, _ = _trace(run, calls)
  except Exception:  # pylint: disable=broad-except
    return None
  return _busy(ops) / 1e9 / calls if ops else None


def kernel_profile(run, calls: int, unit: str, units_per_call: int = 1,
                   top: int = 8, hlo: Optional[str] = None):
  """Lines describing the kernels of `calls` calls of `run(calls)` (which
  runs them and waits for the last), traced with jax.profiler: kernels per
  `unit`, the device's busy time (the union of the kernels' intervals)
  against the wall time, the time by kind (matrix products, attention,
  copies, reductions, other fusions) and the `top` kernels by time. Where
  the device sits idle between kernels, the step is bound by launches and
  the host; where it is busy with small kernels, by their latency. With
  `hlo`, the compiled program's text, each top kernel that is one of its
  instructions is followed by its result shape and the JAX operation it
  came from."""
  try:
    ops, wall = _trace(run, calls)
  except Exception as e:  # pylint: disable=broad-except
    # The figures measured before stay; the profiler (CUPTI on a GPU) may
    # be missing or refused.
    return [f"kernels: not profiled ({type(e).__name__}: {e})"]
  if not ops:
    return ["kernels: none in the trace"]
  n = calls * units_per_call
  busy = _busy(ops)
  per_unit_ms = lambda ns: ns / 1e6 / n
  total = sum(d for _, _, d in ops)
  lines = [
      f"kernels: {len(ops) / n:,.1f} per {unit} ({len({o[0] for o in ops})}"
      f" distinct); device busy {per_unit_ms(busy):.3f} ms of "
      f"{wall * 1e3 / n:.3f} ms wall per {unit} ({busy / 1e9 / wall:.0%})"]
  kinds, names = {}, {}
  for name, _, dur in ops:
    kind = _kernel_kind(name)
    kinds[kind] = kinds.get(kind, 0) + dur
    count, t = names.get(name, (0, 0))
    names[name] = (count + 1, t + dur)
  lines.append("  by kind: " + ", ".join(
      f"{kind} {t / total:.0%}" for kind, t in
      sorted(kinds.items(), key=lambda kv: -kv[1])))
  for name, (count, t) in sorted(names.items(), key=lambda kv: -kv[1][1])[
      :top]:
    short = name if len(name) <= 64 else name[:61] + "..."
    lines.append(f"  {t / total:5.1%} {per_unit_ms(t):8.3f} ms/{unit} "
                 f"x{count / n:<6.1f} {short}")
    origin = _hlo_origin(hlo, name) if hlo else ""
    if origin:
      lines.append(f"{'':30}{origin}")
  return lines
