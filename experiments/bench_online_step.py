r"""Where an online step's time goes: sampling, host rewards, scoring and
updates; and what overlapping generation with training saves.

  python experiments/bench_online_step.py                  # CPU, Llama tiny
  python experiments/bench_online_step.py --arch=t5 --size=small \
      --prompts=32 --group=8 --new=256 --eos_prob=0.02
  python experiments/bench_online_step.py --overlap        # 8 CPU devices
  python experiments/bench_online_step.py --overlap --engine=continuous \
      --page_size=16    # the responses decoded by the continuous engine

Both parts run GRPO (`jaxrlhf.algorithms.online.grpo`, its defaults) with a
randomly initialised policy and reference (`--arch`, `--size`: the model
presets of bench_sampling.py), `--group` (k) samples of at most `--new`
tokens for each of `--prompts` (P) prompts of the built-in verifiable task
`synthetic_arithmetic` ("add: 47 + 385", padded to `--prompt` tokens), at
temperature 1, and a host reward (`--host_reward`; default
`rewards.math_answer`: the completion's final number checked against the
row's answer with math-verify). A random model almost never draws EOS, so,
as in bench_rollout.py, its EOS logit is set at every sampling step to
make each step end a response with probability `--eos_prob` (the
teacher-forced scoring and updates use the model as it is; only the
lengths matter to the cost). With `--reward_model` a random reward model
of the policy's shape scores the responses too (weight 1, inside
`assemble`).

(a) The step split around the host (default). The step is
`host_split.HostSplitStep`, the one a run with host rewards trains with,
and its parts (`iteration.StepParts`) are its own compiled calls, each
timed alone:

  sampling      `iteration.sample`: k responses per prompt, each prompt
                prefilled once, decoding until every row has ended
                (stop_when_done on) or for all `--new` steps (off);
  host rewards  this process's responses copied to the host, decoded and
                scored by the host reward (`RewardSources.score_on_host`),
                and added to the rollout;
  assemble      `iteration.score`: the responses cut after their
                EOS, policy and reference log-probs (a forward pass each),
                the reward model's score when weighted; with a KL
                coefficient (`--kl_coef`, GRPO's 0.04 by default) also
                timed with 0 ("assemble, no KL"), which skips the
                reference's pass, as configs/grpo_gsm8k.py runs;
  updates       `iteration.advantages` and `iteration.update`: GRPO's
                group advantages and num_epochs x num_minibatches
                optimizer updates (forward and backward).

Then the whole step, and `fused`: the same device work as one compiled
function with no host in it (the host rewards count 0; what a run with
device rewards only would run). Printed per part: wall and CPU seconds
(the fastest of `--repeats` calls after a compiling one: minima, so that
the stalls of a shared machine do not decide; CPU seconds are this
process's threads, steadier there), the share of the step, and tokens/s
(response tokens, up to and including the EOS; updates: times the
epochs). "waiting on host" is step minus fused, the time the step takes
longer because the host scores between the compiled calls, and its share
of the step (the figure issue 22 asks for). In the step the device
assembles the rollout while the host scores (`assemble` is dispatched
without waiting), so on an accelerator the wait is about max(0, host -
assemble) plus the gaps between calls; on a CPU the host and the "device"
are the same cores, so nothing is hidden there. Each part runs with
stop_when_done on and off (`--stop`), from the same initialisation and
keys, so both draw the same responses (checked): the decode steps run
against the budget, and the step's speed-up.

(b) `--overlap`: generation overlapped with training
(`overlap.OverlappedStep`). The devices (8 simulated CPU devices:
the script sets XLA_FLAGS=--xla_force_host_platform_device_count=8 before
importing JAX when XLA_FLAGS does not name a count) split in two halves:
`online.sampler_devices` sample, assemble and (with the host) score the
rollouts, the others train. GRPO steps on-policy (`off_policy_steps=0`:
each step samples, then updates) and one step ahead (`=1`: step t+1's
rollout is sampled with step t's parameters while step t's update runs),
`--warmup` steps, then `--repeats` blocks of `--steps` steps timed whole:
the wall and CPU seconds per step (the fastest block's mean), against the
sum of its parts measured alone (the sampler's rollout, host rewards
included, then the update on the trainer's devices; the moves between the
two meshes are in the steps only). speed-up = sum of parts / step. On 2
CPU cores shared by all 8 simulated devices (and by other work), the two
halves compete for the same cores: an overlap can only fill the gaps (the
host's Python, dispatch, idle cores during small ops), not run two
programs at full speed at once; on separate accelerators each half has its
own chip.
"""

import argparse
import os
import sys
import tempfile
import time


def _parse():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--arch", default="llama", choices=("llama", "t5"))
  p.add_argument("--size", default="tiny", choices=("tiny", "small", "large"),
                 help="the model sizes of bench_sampling.py")
  p.add_argument("--prompts", type=int, default=16, help="P, per step")
  p.add_argument("--group", type=int, default=4, help="k, samples per prompt")
  p.add_argument("--prompt", type=int, default=64,
                 help="prompt tokens (the task's sums, padded)")
  p.add_argument("--new", type=int, default=128,
                 help="online.max_new_tokens, the response budget")
  p.add_argument("--eos_prob", type=float, default=0.1,
                 help="probability that a sampling step ends a response")
  p.add_argument("--vocab_size", type=int, default=2048)
  p.add_argument("--dtype", default="float32")
  p.add_argument("--optimizer", default="adamw")
  p.add_argument("--kl_coef", type=float, default=None,
                 help="grpo.kl_coef (unset: GRPO's default); when not 0, "
                 "assemble is also timed with 0 (no reference pass)")
  p.add_argument("--epochs", type=int, default=None,
                 help="online.num_epochs (unset: GRPO's default)")
  p.add_argument("--minibatches", type=int, default=None,
                 help="online.num_minibatches (unset: the default)")
  p.add_argument("--host_reward", default="math_answer",
                 help="math_answer, gold_reward or format (the rewards "
                 "group's), or a function 'package.module:function'")
  p.add_argument("--reward_model", action="store_true",
                 help="also a random reward model of the policy's shape")
  p.add_argument("--stop", default="on,off",
                 help="stop_when_done settings to run, of on,off")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--engine", default="lockstep",
                 choices=("lockstep", "continuous"), help="online.engine")
  p.add_argument("--page_size", type=int, default=None,
                 help="online.engine_page_size (--engine=continuous)")
  p.add_argument("--slots", type=int, default=None,
                 help="online.engine_slots (--engine=continuous; unset: "
                 "the default)")
  p.add_argument("--overlap", action="store_true",
                 help="part (b): sampler and trainer devices")
  p.add_argument("--steps", type=int, default=4,
                 help="--overlap: steps per timed block")
  p.add_argument("--warmup", type=int, default=2,
                 help="--overlap: untimed steps first (compiling)")
  return p.parse_args()


if __name__ == "__main__":
  _ARGS = _parse()
  if _ARGS.overlap and ("xla_force_host_platform_device_count"
                        not in os.environ.get("XLA_FLAGS", "")):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8"
                               ).strip()

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import bench_rollout  # noqa: E402
from jaxrlhf import algorithms  # noqa: E402
from jaxrlhf import answers  # noqa: E402
from jaxrlhf import console  # noqa: E402
from jaxrlhf import defaults  # noqa: E402
from jaxrlhf import sharding  # noqa: E402
from jaxrlhf.algorithms.online import host_split  # noqa: E402
from jaxrlhf.algorithms.online import iteration  # noqa: E402
from jaxrlhf.algorithms.online import overlap  # noqa: E402
from jaxrlhf.data import prompts as prompts_lib  # noqa: E402
from jaxrlhf.eval import evaluation  # noqa: E402
from jaxrlhf.models import scoring  # noqa: E402

TASK = "synthetic_arithmetic"
BUILT_IN_HOST_REWARDS = ("math_answer", "gold_reward", "format")
# bench_sampling.py's "small" Llama (about T5 1.1 small's width and depth).
SMALL_LLAMA = {"model.emb_dim": 512, "model.num_heads": 8,
               "model.num_kv_heads": 8, "model.num_decoder_layers": 8,
               "model.head_dim": 64, "model.mlp_dim": 1024}


def model_overrides(arch: str, size: str):
  """config.model fields of bench_sampling.py's model of `size`."""
  if arch == "t5":
    return {"model.arch": "t5", "model.size": size,
            "model.logits_via_embedding": True}
  if size == "tiny":
    return {"model.arch": "llama", "model.size": "tiny"}
  if size == "small":
    return {"model.arch": "llama", "model.size": "tiny", **SMALL_LLAMA}
  return {"model.arch": "llama", "model.size": "llama3.2-1b"}


def make_config(args, stop_when_done: bool, **overrides):
  c = defaults.base_config()
  rewards = {"rewards.reward_model.weight": 1.0 if args.reward_model else 0.0}
  if args.host_reward in BUILT_IN_HOST_REWARDS:
    rewards[f"rewards.{args.host_reward}.weight"] = 1.0
  else:
    rewards["rewards.functions"] = args.host_reward
  online = {"online.num_epochs": args.epochs,
            "online.num_minibatches": args.minibatches,
            "online.engine_page_size": args.page_size,
            "online.engine_slots": args.slots}
  defaults.apply_overrides(c, {
      "algorithm": "grpo",
      "data.task": TASK,
      "data.inputs_length": args.prompt,
      "data.targets_length": args.new,
      **model_overrides(args.arch, args.size),
      "model.vocab_size": args.vocab_size,
      "model.dtype": args.dtype,
      "optimizer.name": args.optimizer,
      "train.batch_size": args.prompts,
      "train.num_steps": 10**6,
      "online.samples_per_prompt": args.group,
      "online.max_new_tokens": args.new,
      "online.temperature": 1.0,
      "online.stop_when_done": stop_when_done,
      "online.engine": args.engine,
      **({} if args.kl_coef is None else {"grpo.kl_coef": args.kl_coef}),
      # Only the shapes matter: the networks start from their random
      # initialisation (`Trainer._init`), no checkpoint is read.
      "init.policy_checkpoint": "unused",
      "online.reward_model_checkpoint": "unused" if args.reward_model else "",
      **{k: v for k, v in online.items() if v is not None},
      **rewards,
      **overrides,
  })
  defaults.validate(c)
  return c


def build_trainer(config, args, mesh):
  """The trainer, with a policy that ends responses at `--eos_prob` per
  sampling step (module docstring)."""
  trainer = algorithms.build(config, mesh, evaluate=False)
  # The steps built below trace `trainer.lm` when first called: they sample
  # with the EOS rate set (decode_step) and score with the model as it is.
  trainer.lm = scoring.adapter_for(bench_rollout.ending_at_rate(
      trainer.model, trainer.vocabulary.eos_id, args.eos_prob))
  return trainer


def build(config, args, mesh):
  """(`build_trainer`, its random train state)."""
  trainer = build_trainer(config, args, mesh)
  state = trainer._init(jax.random.PRNGKey(config.seed))  # pylint: disable=protected-access
  return trainer, state


def _timed(fn, *args):
  start, start_cpu = time.perf_counter(), time.process_time()
  out = jax.block_until_ready(fn(*args))
  return time.perf_counter() - start, time.process_time() - start_cpu, out


def fastest(fn, *args, repeats):
  """(wall s, CPU s, output) of the fastest of `repeats` calls after a
  compiling one (bench_rollout.fastest, without copying the output)."""
  out = jax.block_until_ready(fn(*args))
  best = None
  for _ in range(repeats):
    wall, cpu, out = _timed(fn, *args)
    best = (wall, cpu) if best is None else (min(best[0], wall),
                                             min(best[1], cpu))
  return best[0], best[1], out


def fastest_chained(fn, state, *args, repeats):
  """As `fastest` for a step (state, *args) -> (state, metrics) that
  donates its state: each call takes the last one's. (wall, CPU, state)."""
  state, _ = jax.block_until_ready(fn(state, *args))
  best = None
  for _ in range(repeats):
    wall, cpu, (state, _) = _timed(fn, state, *args)
    best = (wall, cpu) if best is None else (min(best[0], wall),
                                             min(best[1], cpu))
  return best[0], best[1], state


def _millions(n):
  return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e6:.3f}M"


def _engine(args, o) -> str:
  """How the responses are decoded."""
  if args.engine == "lockstep":
    return "decoded in lockstep"
  slots = (f"{args.slots} slots" if args.slots
           else "the default slots (online.engine_slots unset)")
  pages = (f", pages of {args.page_size}" if args.page_size
           else ", contiguous caches")
  return f"continuous engine, {slots}{pages}"


def describe(args, trainer, devices: str):
  o = trainer.online
  params = sum(x.size for x in jax.tree.leaves(
      trainer.abstract_state.params["policy"]))
  rm = ", a random reward model" if args.reward_model else ""
  return (f"device: {jax.devices()[0].device_kind} ({devices}); {args.arch} "
          f"{args.size} ({_millions(params)} parameters), vocab "
          f"{trainer.model_config.vocab_size}, {args.dtype}; GRPO, "
          f"{args.prompts} prompts x {o.samples_per_prompt} samples, prompt "
          f"{args.prompt} tokens ({TASK}, padded), budget {args.new} new "
          f"tokens, temperature 1, EOS with probability {args.eos_prob} per "
          f"step; host reward {args.host_reward}{rm}; updates: "
          f"{o.num_epochs} epoch(s) x {o.num_minibatches} minibatch(es), "
          f"{args.optimizer}; {_engine(args, o)}; load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores")


# --- (a) the step split around the host ---------------------------------------


def split_parts(args, stop_when_done: bool):
  """The parts and the whole of one HostSplitStep (module docstring)."""
  config = make_config(args, stop_when_done)
  with sharding.activate(config) as mesh:
    trainer, state = build(config, args, mesh)
    step = host_split.HostSplitStep(trainer)
    parts = step.parts
    batch = sharding.global_batch(next(trainer.train_batches(0)), mesh,
                                  trainer.rules)
    prompts = batch[prompts_lib.PROMPT_FEATURE]
    next_rng, rollout_rng, update_rng = iteration.split_step_key(state.rng)
    r = args.repeats
    start = time.perf_counter()
    # The step's own compiled parts, so that each part is what the step
    # runs and compiles once.
    t = {}
    t["sampling"] = fastest(parts.sample, state.params, state.frozen,
                            batch, rollout_rng, repeats=r)
    samples = t["sampling"][2]
    t["assemble"] = fastest(parts.score, state.params, state.frozen,
                            prompts, samples, repeats=r)
    rollout = t["assemble"][2]
    t["host rewards"] = fastest(
        lambda ro, s, b: parts.host_rewards(ro, s, b)[0], rollout, samples,
        batch, repeats=r)
    rollout = t["host rewards"][2]
    sources = trainer.online.rewards
    values = rollout.rewards[:, np.asarray(
        [sources.names.index(n) for n in sources.host_names], np.int32)]
    if config.grpo.kl_coef:
      # The same assemble with grpo.kl_coef = 0: the reference's forward
      # pass skipped (`kl_control.scores_reference`).
      # Its trainer reads this state: no state of its own is made.
      no_kl = host_split.HostSplitStep(build_trainer(
          make_config(args, stop_when_done, **{"grpo.kl_coef": 0.0}), args,
          mesh))
      t["assemble, no KL"] = fastest(no_kl.parts.score, state.params,
                                     state.frozen, prompts, samples,
                                     repeats=r)

    def finish(state, rollout):
      rows, carried, _ = parts.advantages(state, rollout, None)
      return parts.update(state, rows, carried, update_rng, next_rng)
    t["updates"] = fastest_chained(finish, state, rollout, repeats=r)
    state = t["updates"][2]
    t["step"] = fastest_chained(step, state, batch, repeats=r)
    state = t["step"][2]
    t["fused"] = fastest_chained(step.fused, state, batch, repeats=r)
    seconds = time.perf_counter() - start
    host = {"samples": jax.device_get(samples),
            "completions": [trainer.vocabulary.decode(evaluation.until_eos(
                row, trainer.vocabulary.eos_id))
                            for row in evaluation.local_rows(samples.tokens)],
            "values": np.asarray(jax.device_get(values)),
            "epochs": trainer.online.num_epochs,
            "seconds": seconds, "line": describe(args, trainer, "1 device")}
  return t, host


def print_setting(args, stop, t, info, first):
  """The table of one stop_when_done setting (`first`: the info of the
  setting printed before, or None)."""
  if first is None:
    print(info["line"])
  samples = info["samples"]
  tokens = float(samples.mask.sum())
  steps = int(samples.num_steps)
  lengths = samples.mask.sum(axis=1)
  print(f"\nstop_when_done {stop}: {steps} of {args.new} decode steps run "
        f"({1 - steps / args.new:.0%} saved); responses mean "
        f"{lengths.mean():.1f} tokens, longest {int(lengths.max())}, "
        f"{samples.has_eos.mean():.0%} ended; {info['seconds']:.0f} s with "
        "the compiling calls")
  if first is not None and not np.array_equal(samples.tokens,
                                              first["samples"].tokens):
    print("  !! the responses differ from the first setting's")
  header = (f"{'part':22} {'seconds':>8} {'CPU s':>7} {'share':>6} "
            f"{'tok/s':>9}")
  print(header)
  print("-" * len(header))
  step_s = t["step"][0]
  per_part = {"sampling": tokens, "host rewards": tokens,
              "assemble": tokens, "updates": tokens * info["epochs"]}
  total, total_cpu = 0.0, 0.0
  for name, n in per_part.items():
    wall, cpu = t[name][:2]
    total, total_cpu = total + wall, total_cpu + cpu
    print(f"{name:22} {wall:>8.4f} {cpu:>7.4f} {wall / step_s:>6.1%} "
          f"{n / wall:>9,.0f}")
  print(f"{'sum of parts':22} {total:>8.4f} {total_cpu:>7.4f} "
        f"{total / step_s:>6.1%}")
  for name, label in (("step", "step (split, host)"),
                      ("fused", "fused (no host)")):
    wall, cpu = t[name][:2]
    print(f"{label:22} {wall:>8.4f} {cpu:>7.4f} {wall / step_s:>6.1%} "
          f"{tokens / wall:>9,.0f}")
  if "assemble, no KL" in t:
    wall, cpu = t["assemble, no KL"][:2]
    saved = t["assemble"][0] - wall
    print(f"{'assemble, no KL':22} {wall:>8.4f} {cpu:>7.4f} "
          f"{wall / step_s:>6.1%} {tokens / wall:>9,.0f}   (grpo.kl_coef=0: "
          f"no reference pass; {t['assemble'][0] / wall:.2f}x as fast, the "
          f"step {saved / step_s:.1%} shorter)")
  wait = t["step"][0] - t["fused"][0]
  wait_cpu = t["step"][1] - t["fused"][1]
  print(f"{'waiting on host':22} {wait:>8.4f} {wait_cpu:>7.4f} "
        f"{wait / step_s:>6.1%}   (step - fused)")
  values = info["values"]
  found = np.mean([answers.extract_answer(c, "auto") is not None
                   for c in info["completions"]])
  print(f"host reward {args.host_reward}: {len(values)} rows, mean "
        f"{np.nanmean(values):.3f}; an answer found in {found:.0%} of the "
        "completions")
  sys.stdout.flush()


def compare_settings(results):
  """One line: the first stop_when_done setting against the second."""
  (a, (ta, ia)), (b, (tb, ib)) = results.items()
  steps_a, steps_b = (int(i["samples"].num_steps) for i in (ia, ib))
  print(f"\nstop_when_done {a} against {b}: decode steps {steps_a} vs "
        f"{steps_b}; sampling {tb['sampling'][0] / ta['sampling'][0]:.2f}x "
        f"as fast (CPU s {tb['sampling'][1] / ta['sampling'][1]:.2f}x), "
        f"the step {tb['step'][0] / ta['step'][0]:.2f}x (CPU s "
        f"{tb['step'][1] / ta['step'][1]:.2f}x)")


# --- (b) generation overlapped with training ----------------------------------


def overlap_run(args, off_policy_steps: int, sampler_devices: int):
  """(step wall s, step CPU s, {part: (wall, CPU)}, describe line) of GRPO
  steps on a mesh split into sampler and trainer devices."""
  config = make_config(args, True, **{
      "online.sampler_devices": sampler_devices,
      "online.off_policy_steps": off_policy_steps})
  with sharding.activate(config) as mesh:
    trainer, state = build(config, args, mesh)
    step = overlap.OverlappedStep(trainer)
    batches = trainer.train_batches(0)

    def run(state, n):
      for _ in range(n):
        state, metrics = step(state, sharding.global_batch(
            next(batches), mesh, trainer.rules))
      return state, metrics

    def block(state, n):
      # A block's steps and the rollout its last step left in flight: each
      # block holds n samplings and n updates.
      state, metrics = run(state, n)
      return state, metrics, step._pending  # pylint: disable=protected-access

    state, _, _ = jax.block_until_ready(block(state, args.warmup))
    best = None
    for _ in range(args.repeats):
      wall, cpu, (state, _, _) = _timed(block, state, args.steps)
      wall, cpu = wall / args.steps, cpu / args.steps
      best = (wall, cpu) if best is None else (min(best[0], wall),
                                               min(best[1], cpu))
    parts = {}
    if not off_policy_steps:
      # Each half alone: the sampler's rollout, then the update on the
      # trainer's devices (the step's own compiled calls).
      # pylint: disable=protected-access
      local = next(batches)  # this process's rows
      next_rng, rollout_rng, update_rng = iteration.split_step_key(state.rng)
      on_sampler = jax.device_put(state.params, step._params_on_sampler)
      wall, cpu, (rollout, _) = fastest(step._rollout, on_sampler, state,
                                        step._on_sampler(local), rollout_rng,
                                        repeats=args.repeats)
      parts["sampling"] = (wall, cpu)
      rollout = jax.device_put(rollout, overlap._rows_on(
          trainer.mesh, trainer.rules, rollout))

      def finish(state, rollout):
        rollout, weights, _ = step.parts.correct(state, rollout)
        rows, carried, _ = step.parts.advantages(state, rollout, weights)
        return step.parts.update(state, rows, carried, update_rng, next_rng)
      wall, cpu, state = fastest_chained(finish, state, rollout,
                                         repeats=args.repeats)
      parts["updates"] = (wall, cpu)
      # pylint: enable=protected-access
    line = describe(args, trainer, f"{jax.device_count()} devices: "
                    f"{sampler_devices} sample, "
                    f"{jax.device_count() - sampler_devices} train")
  return best[0], best[1], parts, line


def main_overlap(args):
  n = jax.device_count()
  if n < 2:
    sys.exit(f"--overlap needs at least 2 devices; this machine has {n} "
             f"{jax.devices()[0].platform} device(s).")
  sampler = n // 2
  on_wall, on_cpu, parts, line = overlap_run(args, 0, sampler)
  ahead_wall, ahead_cpu, _, _ = overlap_run(args, 1, sampler)
  print(line)
  print(f"{args.warmup} warm-up steps, then the fastest of {args.repeats} "
        f"blocks of {args.steps} steps (mean per step)")
  header = f"{'':30} {'seconds':>8} {'CPU s':>7} {'speed-up':>9}"
  print(header)
  print("-" * len(header))
  total = parts["sampling"][0] + parts["updates"][0]
  total_cpu = parts["sampling"][1] + parts["updates"][1]
  for name, (wall, cpu) in parts.items():
    label = ("sampling alone (sampler)" if name == "sampling"
             else "updates alone (trainer)")
    print(f"{label:30} {wall:>8.3f} {cpu:>7.3f}")
  print(f"{'sum of parts':30} {total:>8.3f} {total_cpu:>7.3f}")
  for label, wall, cpu in (("step, on-policy (0 ahead)", on_wall, on_cpu),
                           ("step, one step ahead (1)", ahead_wall,
                            ahead_cpu)):
    print(f"{label:30} {wall:>8.3f} {cpu:>7.3f} {total / wall:>8.2f}x")
  print(f"one step ahead against on-policy: {on_wall / ahead_wall:.2f}x "
        f"(CPU s {on_cpu / ahead_cpu:.2f}x); speed-up = sum of parts / step, "
        f"at most sum / the longer part = "
        f"{total / max(p[0] for p in parts.values()):.2f}x")


def main(args):
  console.silence_library_noise(python_loggers=True)
  if not jax.config.jax_compilation_cache_dir:  # (JAX_COMPILATION_CACHE_DIR)
    # Each setting builds its own trainer, so the second one would compile
    # again what the two share (the scoring, the updates): a cache of this
    # run's own makes it a read. The timings come after the compiling calls
    # either way.
    jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(
        prefix="bench_online_step_cache_"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  if args.overlap:
    main_overlap(args)
  else:
    settings = [s.strip() for s in args.stop.split(",") if s.strip()]
    if not settings or set(settings) - {"on", "off"}:
      sys.exit(f"--stop={args.stop!r}: give on, off or on,off.")
    results = {}
    for stop in settings:
      t, info = split_parts(args, stop == "on")
      print_setting(args, stop, t, info,
                    next(iter(results.values()))[1] if results else None)
      results[stop] = (t, info)
    if len(results) == 2:
      compare_settings(results)
  sys.stdout.flush()


if __name__ == "__main__":
  main(_ARGS)
