r"""Continuous batching against lockstep decoding: tokens/s and slot use.

  python experiments/bench_engine.py                        # CPU, tiny Llama
  python experiments/bench_engine.py --json=out.json --slots=16 \
      --refills=1,4,16

The workload is bench_rollout.py's: `--prompts` (P) random prompts of
`--prompt` tokens, `--group` (k) responses each (N = P * k sequences), at
most `--new` tokens, at temperature 1, from a randomly initialised Llama
whose every decode step draws the EOS with probability `--eos_prob`
(`bench_rollout.ending_at_rate`: geometric lengths, a mild spread), or
with `--lengths=lognormal` whose responses have log-normal lengths
(`--mean_length`, `--sigma`; `bench_rollout.ending_lognormal`: a
reasoning run's skew, most responses short and a long tail):

  python experiments/bench_engine.py --lengths=lognormal --new=4096

In one run, on the same prompts:

  lockstep N      today's online step: `sample_decoder_only` on all N rows
                  at once (`num_samples=k`, `stop_when_done`): N slots,
                  each busy until the longest of the N ends;
  lockstep S      the same sampler on N / S batches of S rows, one after
                  the other (`--slots` S; the prompts repeated): the slots
                  the engine has, each batch waiting for its longest row;
  engine S/R      `engine.generate` with S slots, refilled R prompts at a
                  time (`--refills`), each slot taking the next pending
                  sequence when its own ends;
  paged S/R       the same on a paged KV cache (`--page_size`, refill
                  sizes `--paged_refills`), its attention reading the
                  pages in use (`paged_attention`), followed by a line of
                  the cache it held at most (its peak pages) against the S
                  slots x (prompt + budget - 1) positions of contiguous
                  rows, in bytes, and for each pool of `--num_pages`
                  below that, the preemptions it took;
  gather S/R      the same paged engine, its attention gathering every
                  sequence's whole table (`PagedIndex.read='gather'`: a
                  step reads S x (prompt + budget - 1) positions however
                  short the sequences are), with `--paged_reads`.

Short sequences in a long budget show the difference between the two:

  python experiments/bench_engine.py --prompt=16 --new=1024 --eos_prob=0.02

Printed per variant (and written to `--json`): seconds per call (the
fastest of `--repeats` after a compiling call), CPU seconds, response
tokens (up to and including the EOS) and tokens/s, decode steps (draws of
a token column: the lockstep sampler's `num_steps`, the engine's loop
iterations), slot-steps (steps x slots) and the useful ones (tokens
drawn), and their ratio, the slots' utilisation. The engine's variants
draw lockstep N's responses (each sequence its row of the lockstep
sampler's draws, `models/row_draws.py`), so their token counts match it;
lockstep S's batches draw others.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import bench_rollout  # noqa: E402
import bench_sampling  # noqa: E402
from jaxrlhf import console  # noqa: E402
from jaxrlhf.models import engine  # noqa: E402
from jaxrlhf.models import sampling  # noqa: E402
from jaxrlhf.models.layers import paged_attention  # noqa: E402
from jaxrlhf.models.layers import paged_kv  # noqa: E402


def _parse():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--size", default="tiny", choices=("tiny", "small", "large"),
                 help="the model sizes of bench_sampling.py")
  p.add_argument("--prompts", type=int, default=16, help="P")
  p.add_argument("--group", type=int, default=4, help="k, samples per prompt")
  p.add_argument("--prompt", type=int, default=64, help="prompt tokens")
  p.add_argument("--new", type=int, default=128,
                 help="max_new_tokens, the response budget")
  p.add_argument("--eos_prob", type=float, default=0.1,
                 help="probability that a step ends a response (--lengths "
                 "geometric)")
  p.add_argument("--lengths", default="geometric",
                 choices=("geometric", "lognormal"),
                 help="the responses' lengths: geometric (--eos_prob) or "
                 "log-normal (--mean_length, --sigma; "
                 "bench_rollout.ending_lognormal), cut at --new")
  p.add_argument("--mean_length", type=float, default=300.0,
                 help="--lengths lognormal: the lengths' mean before the cut")
  p.add_argument("--sigma", type=float, default=1.0,
                 help="--lengths lognormal: the deviation of log length")
  p.add_argument("--slots", type=int, default=16,
                 help="S, the engine's slots (and lockstep S's batch)")
  p.add_argument("--refills", default="1,4,16",
                 help="the engine's refill sizes R to run (each <= S)")
  p.add_argument("--page_size", type=int, default=16,
                 help="positions per page of the paged variants (0: none)")
  p.add_argument("--num_pages", default="0",
                 help="the paged variants' pools, each a variant (0: the "
                 "engine's default, enough for every slot's longest "
                 "sequence; fewer preempt the youngest sequences, counted "
                 "on the cache line)")
  p.add_argument("--paged_refills", default="",
                 help="the paged engine's refill sizes R to run (each <= S; "
                 "empty: the engine's default, S // 4)")
  p.add_argument("--paged_reads", default="pages,gather",
                 help="how the paged variants' attention reads the pages "
                 "(PagedIndex.read, each a variant): pages, gather, auto "
                 "(paged_attention.choose)")
  p.add_argument("--vocab_size", type=int, default=2048)
  p.add_argument("--dtype", default="float32")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--json", default="", help="write the figures here")
  return p.parse_args()


def _counts(samples, rows):
  """(tokens, decode steps, slot-steps) of lockstep Samples of `rows`."""
  steps = int(samples.num_steps)
  return float(samples.mask.sum()), steps, steps * rows


def main(args):
  console.silence_library_noise(python_loggers=True)
  P, k, new, S = args.prompts, args.group, args.new, args.slots
  n = P * k
  refills = [int(r) for r in args.refills.split(",")]
  paged_refills = ([int(r) for r in args.paged_refills.split(",")]
                   if args.paged_refills else
                   [engine.default_refill_size(S)]) if args.page_size else []
  if n % S or any(not 1 <= r <= S for r in refills + paged_refills):
    raise SystemExit(f"--slots {S} must divide the {n} sequences and each "
                     f"of --refills {refills} and --paged_refills "
                     f"{paged_refills} lie in 1 .. {S}.")
  eos_id = 1
  config = bench_sampling.model_config("llama", args.vocab_size, args.dtype,
                                       args.size)
  module, params = bench_sampling.init_params(config)
  if args.lengths == "lognormal":
    module = bench_rollout.ending_lognormal(module, eos_id, args.prompt,
                                            args.mean_length, args.sigma)
    ending = (f"log-normal lengths (mean {args.mean_length:g}, sigma "
              f"{args.sigma:g})")
  else:
    module = bench_rollout.ending_at_rate(module, eos_id, args.eos_prob)
    ending = f"EOS with probability {args.eos_prob} per step"
  prompts = bench_sampling.prompts("llama", P, args.prompt, args.vocab_size)
  repeated = np.repeat(prompts, k, axis=0)
  ones = np.ones_like(repeated)
  rng = jax.random.PRNGKey(0)
  print(f"device: {jax.devices()[0].device_kind}; {args.size} Llama, vocab "
        f"{args.vocab_size}, {args.dtype}; {P} prompts x {k} samples = {n} "
        f"sequences, prompt {args.prompt} tokens, budget {new} new tokens, "
        f"temperature 1, {ending}")
  options = dict(max_new_tokens=new, temperature=1.0, eos_id=eos_id)

  all_rows = jax.jit(lambda p, x, r: sampling.sample_decoder_only(
      module, p, x, np.ones_like(prompts), r, num_samples=k,
      stop_when_done=True, **options))
  batch = jax.jit(lambda p, x, r: sampling.sample_decoder_only(
      module, p, x, ones[:S], r, stop_when_done=True, **options))

  def lockstep_batches(p, x, r):
    return [batch(p, x[b * S:(b + 1) * S], jax.random.fold_in(r, b))
            for b in range(n // S)]

  results = []

  def report(name, slots, refill, seconds, cpu, tokens, steps, slot_steps,
             lengths):
    row = dict(variant=name, slots=slots, refill_size=refill,
               seconds=seconds, cpu_seconds=cpu, tokens=tokens,
               tokens_per_s=tokens / seconds, decode_steps=steps,
               slot_steps=slot_steps, useful_slot_steps=tokens,
               utilisation=tokens / slot_steps,
               mean_length=float(np.mean(lengths)),
               longest=int(np.max(lengths)))
    results.append(row)
    base = results[0]["tokens_per_s"]
    print(f"{name:22} {slots:>5} {seconds:>8.3f} {cpu:>6.2f} "
          f"{int(tokens):>7} {row['tokens_per_s']:>8,.0f} "
          f"{row['tokens_per_s'] / base:>6.2f}x {steps:>6} {slot_steps:>7} "
          f"{row['utilisation']:>6.1%} {row['mean_length']:>6.1f} "
          f"{row['longest']:>5}")

  header = (f"{'variant':22} {'slots':>5} {'seconds':>8} {'CPU s':>6} "
            f"{'tokens':>7} {'tok/s':>8} {'ratio':>7} {'steps':>6} "
            f"{'slot-st':>7} {'util':>6} {'mean':>6} {'max':>5}")
  print(header)
  print("-" * len(header))

  seconds, cpu, out = bench_rollout.fastest(all_rows, params, prompts, rng,
                                            repeats=args.repeats)
  report("lockstep N", n, None, seconds, cpu, *_counts(out, n),
         out.mask.sum(1))

  seconds, cpu, outs = bench_rollout.fastest(lockstep_batches, params,
                                             repeated, rng,
                                             repeats=args.repeats)
  tokens = sum(float(o.mask.sum()) for o in outs)
  steps = sum(int(o.num_steps) for o in outs)
  report("lockstep S", S, None, seconds, cpu, tokens, steps, steps * S,
         np.concatenate([o.mask.sum(1) for o in outs]))

  for refill in refills:
    run = jax.jit(lambda p, x, r, refill=refill: engine.generate(
        module, p, x, ones, r, S, refill_size=refill, **options))
    seconds, cpu, (out, stats) = bench_rollout.fastest(
        run, params, repeated, rng, repeats=args.repeats)
    steps = int(stats.decode_steps)
    assert int(stats.useful_slot_steps) == int(out.mask.sum())
    report(f"engine S/R={refill}", S, refill, seconds, cpu,
           float(out.mask.sum()), steps, steps * S, out.mask.sum(1))

  # The cache's bytes per position: a pool of one one-position page.
  per_position = sum(
      x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(
          lambda: paged_kv.make_pool(module, params, 1, 1))))
  reads = [r for r in args.paged_reads.split(",") if r]
  pools = [int(x) or None for x in args.num_pages.split(",")]
  for refill, read, pool in [(f, r, q) for f in paged_refills
                             for r in reads for q in pools]:
    run = jax.jit(lambda p, x, r, refill=refill, read=read, pool=pool:
                  engine.generate(
                      paged_attention.reading(module, read), p, x, ones, r,
                      S, refill_size=refill, page_size=args.page_size,
                      num_pages=pool, **options))
    seconds, cpu, (out, stats) = bench_rollout.fastest(
        run, params, repeated, rng, repeats=args.repeats)
    assert not bool(stats.pages_exhausted)
    steps = int(stats.decode_steps)
    name = {"gather": "gather", "auto": "auto"}.get(read, "paged")
    report(f"{name} S/R={refill}" + (f" pool={pool}" if pool else ""), S,
           refill, seconds, cpu,
           float(out.mask.sum()), steps, steps * S, out.mask.sum(1))
    results[-1].update(read=read)
    paged = int(stats.pages_peak) * args.page_size * per_position
    rows = S * (args.prompt + new - 1) * per_position
    results[-1].update(page_size=args.page_size,
                       pages_peak=int(stats.pages_peak),
                       cache_bytes_peak=paged, cache_bytes_slots=rows,
                       num_pages=pool,
                       preemptions=int(stats.preemptions))
    print(f"  cache: {int(stats.pages_peak)} pages of {args.page_size} at "
          f"most = {paged:,} bytes against {S} slots x "
          f"{args.prompt + new - 1} positions = {rows:,} bytes "
          f"({paged / rows:.1%})"
          + (f"; a pool of {pool} pages: {int(stats.preemptions)} "
             "preemptions" if pool else ""))
  sys.stdout.flush()
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind,
                     jax=jax.__version__, args=vars(args), results=results),
                f, indent=1)
      f.write("\n")


if __name__ == "__main__":
  main(_parse())
