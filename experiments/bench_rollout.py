r"""Sampling an online step's k responses per prompt: what sharing the prefill
and stopping early save.

  python experiments/bench_rollout.py                      # CPU, T5 and Llama
  python experiments/bench_rollout.py --families=llama --prompts=32 \
      --group=8 --new=256 --eos_prob=0.05

For each family one randomly initialised model (`--size`, the presets of
bench_sampling.py) samples `--group` (k) responses to each of `--prompts`
(P) random prompts of `--prompt` tokens, at most `--new` tokens each, at
temperature 1, three ways (all with the same rng, hence the same responses,
which the script checks):

  repeated     today's online step: the prompts repeated k times
               (`jnp.repeat(prompts, k, axis=0)`), each copy prefilled
               (T5: encoded, and its cross-attention keys and values
               projected), then `--new` decode steps;
  shared       `num_samples=k`: one prefill per prompt, its KV cache
               repeated for the k samples;
  shared+stop  and `stop_when_done=True`: the decode loop stops once every
               one of the P * k rows has drawn its EOS.

A random model almost never draws a given EOS id, so its responses would all
run to the budget and stopping early would save nothing. Trained policies
end their responses; to stand in for one without training, the models here
have their EOS logit set at every step to logsumexp(other logits) +
log(p / (1 - p)), so that every step ends a response with probability
p = `--eos_prob` at temperature 1: response lengths are geometric (mean
1 / p) and the loop runs until the longest of the P * k has ended (about
log(P * k) / p steps), not `--new`.

Printed per variant: wall and CPU seconds per call (the fastest of
`--repeats` after a compiling call), tokens/s (response tokens up to and
including the EOS, the same in every variant), decode steps run
(`Samples.num_steps`: new-token columns drawn), and matmul FLOPs
(`jaxrlhf.flops.function_flops`): the count of the compiled program, which
for the while loop is its bound (`--new` steps, as the plan counts it), and
the FLOPs of the steps that actually ran. Tiny models on a CPU are bound by
each step's fixed overhead, not by FLOPs: there the prefill is a small part
of the time and sharing it gains less than its FLOPs share.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import bench_sampling  # noqa: E402
from jaxrlhf import console  # noqa: E402
from jaxrlhf import flops  # noqa: E402
from jaxrlhf.models import sampling  # noqa: E402

VARIANTS = (("repeated", 1, False), ("shared", None, False),
            ("shared+stop", None, True))


def _parse():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--families", default="t5,llama")
  p.add_argument("--size", default="tiny",
                 choices=("tiny", "small", "large"),
                 help="the model sizes of bench_sampling.py")
  p.add_argument("--prompts", type=int, default=16, help="P")
  p.add_argument("--group", type=int, default=4, help="k, samples per prompt")
  p.add_argument("--prompt", type=int, default=64, help="prompt tokens")
  p.add_argument("--new", type=int, default=128,
                 help="max_new_tokens, the response budget")
  p.add_argument("--eos_prob", type=float, default=0.1,
                 help="probability that a step ends a response")
  p.add_argument("--vocab_size", type=int, default=2048)
  p.add_argument("--dtype", default="float32")
  p.add_argument("--repeats", type=int, default=3)
  return p.parse_args()


def ending_at_rate(module, eos_id: int, eos_prob: float):
  """`module` (same config and parameters) whose every decode step draws
  `eos_id` with probability `eos_prob` at temperature 1."""
  offset = float(np.log(eos_prob / (1.0 - eos_prob)))

  class EndingAtRate(type(module)):

    def decode_step(self, *args, **kwargs):
      logits = super().decode_step(*args, **kwargs)
      others = logits.at[..., eos_id].set(-jnp.inf)
      eos = jax.nn.logsumexp(others.astype(jnp.float32), axis=-1) + offset
      return logits.at[..., eos_id].set(eos.astype(logits.dtype))

  return EndingAtRate(module.config)


def ending_lognormal(module, eos_id: int, prompt_length: int, mean: float,
                     sigma: float):
  """`module` (same config and parameters) whose responses end with
  log-normal lengths at temperature 1: a response's length is ceil(X), X
  log-normal with mean `mean` and log-space deviation `sigma` (a reasoning
  run's skew: most responses short, a long tail), cut at the budget.

  Its decode step draws the EOS as response token t (0-based) with the
  hazard h(t) = P(X <= t + 1 | X > t) = 1 - S(t + 1) / S(t), S the
  log-normal survival function, by setting the EOS logit to logsumexp(other
  logits) + log(h / (1 - h)). t is read from the rotary position of the
  step's last input (prompt_length - 1 at the prefill: t = 0), so the
  prompts must be `prompt_length` real tokens, unpadded.
  """
  mu = float(np.log(mean) - sigma ** 2 / 2)

  def log_survival(x):  # log P(X > x), x >= 0
    z = (jnp.log(x) - mu) / sigma
    return jax.scipy.special.log_ndtr(-z)

  class EndingLogNormal(type(module)):

    def decode_step(self, tokens, positions, *args, **kwargs):
      logits = super().decode_step(tokens, positions, *args, **kwargs)
      t = (positions[..., -1] - (prompt_length - 1)).astype(jnp.float32)
      step = log_survival(t + 1.0) - log_survival(t)  # log(1 - h), <= 0
      step = jnp.minimum(step, -1e-12)
      odds = jnp.log(-jnp.expm1(step)) - step  # log(h / (1 - h))
      others = logits.at[..., eos_id].set(-jnp.inf)
      eos = jax.nn.logsumexp(others.astype(jnp.float32), axis=-1) + odds
      return logits.at[..., eos_id].set(eos.astype(logits.dtype))

  return EndingLogNormal(module.config)


def sampler(family, module, num_samples, stop_when_done, new, eos_id):
  """jitted (params, prompts [P or P * k, Lp], rng) -> Samples."""
  options = dict(max_new_tokens=new, temperature=1.0, eos_id=eos_id,
                 num_samples=num_samples, stop_when_done=stop_when_done)
  if family == "t5":
    return jax.jit(lambda p, x, r: sampling.sample_encoder_decoder(
        module, p, x, r, **options))
  return jax.jit(lambda p, x, r: sampling.sample_decoder_only(
      module, p, x, jnp.ones_like(x), r, **options))


def fastest(fn, *args, repeats: int):
  """(wall seconds, CPU seconds, the output) of the fastest of `repeats`
  calls after a compiling one: minima, not means, so that the stalls of a
  shared, busy machine do not decide a comparison; the CPU time (this
  process's threads) is the steadier figure there."""
  out = jax.block_until_ready(fn(*args))
  wall, cpu = [], []
  for _ in range(repeats):
    start, start_cpu = time.perf_counter(), time.process_time()
    out = jax.block_until_ready(fn(*args))
    wall.append(time.perf_counter() - start)
    cpu.append(time.process_time() - start_cpu)
  return min(wall), min(cpu), jax.device_get(out)


def decode_step_flops(jaxpr):
  """Matmul FLOPs of one iteration of the (one) while loop in `jaxpr`, or
  None if it has none."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "while":
      return flops.jaxpr_flops(eqn.params["body_jaxpr"])
    for sub in flops.sub_jaxprs(eqn.params):
      found = decode_step_flops(sub)
      if found is not None:
        return found
  return None


def main(args):
  console.silence_library_noise(python_loggers=True)
  P, k, new = args.prompts, args.group, args.new
  eos_id = 1
  print(f"device: {jax.devices()[0].device_kind}; {args.size} models, "
        f"vocab {args.vocab_size}, {args.dtype}; {P} prompts x {k} samples, "
        f"prompt {args.prompt} tokens, budget {new} new tokens, "
        f"temperature 1, EOS with probability {args.eos_prob} per step")
  header = (f"{'family':7} {'variant':12} {'seconds':>8} {'CPU s':>6} "
            f"{'tok/s':>7} {'speedup':>7} {'steps':>6} {'GFLOPs bound':>12} "
            f"{'GFLOPs run':>10}")
  print(header)
  print("-" * len(header))
  for family in args.families.split(","):
    config = bench_sampling.model_config(family, args.vocab_size, args.dtype,
                                         args.size)
    module, params = bench_sampling.init_params(config)
    module = ending_at_rate(module, eos_id, args.eos_prob)
    # Ids from 2 up (T5's end in EOS = 1).
    prompts = bench_sampling.prompts(family, P, args.prompt, args.vocab_size)
    rng = jax.random.PRNGKey(0)
    first, first_seconds = None, None
    for name, num_samples, stop in VARIANTS:
      num_samples = num_samples or k
      x = prompts if num_samples == k else np.repeat(prompts, k, axis=0)
      fn = sampler(family, module, num_samples, stop, new, eos_id)
      seconds, cpu, out = fastest(fn, params, x, rng, repeats=args.repeats)
      bound = flops.function_flops(fn, params, x, rng)
      steps = int(out.num_steps)
      ran = bound
      if stop:  # the loop's bound is new - 1 steps; steps - 1 of them ran
        ran = bound - (new - steps) * decode_step_flops(
            fn.trace(params, x, rng).jaxpr)
      if first is None:
        first, first_seconds = out, seconds
      elif not np.array_equal(out.tokens, first.tokens):
        print(f"  !! {name}: the responses differ from repeated's")
      tokens = float(out.mask.sum())
      print(f"{family:7} {name:12} {seconds:>8.3f} {cpu:>6.2f} "
            f"{tokens / seconds:>7,.0f} {first_seconds / seconds:>6.2f}x "
            f"{steps:>6} "
            f"{bound / 1e9:>12.3f} {ran / 1e9:>10.3f}")
    lengths = first.mask.sum(axis=1)
    print(f"{'':7} responses: mean {lengths.mean():.1f} tokens, longest "
          f"{int(lengths.max())}, {first.has_eos.mean():.0%} ended")
  sys.stdout.flush()


if __name__ == "__main__":
  main(_parse())
