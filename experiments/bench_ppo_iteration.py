r"""Where one PPO iteration's time goes: rollout, scoring and update.

  python experiments/bench_ppo_iteration.py --size=tiny --batch_size=32 \
      --inputs_length=64 --targets_length=64 --epochs=4 --minibatches=1
  python experiments/bench_ppo_iteration.py --arch=llama --size=tinyllama-1.1b \
      --dtype=bfloat16 --vocab_size=32000

One PPO iteration of `jaxrlhf.algorithms.online.ppo` is timed whole (the
jitted train step) and in its three parts, each jitted alone:

  rollout  sampling `targets_length` tokens per prompt at temperature 0.7
           (the KV-cache sampler of `jaxrlhf.models.sampling`);
  scoring  teacher-forced forward passes over the sampled responses: policy
           and reference log-probs, the reward model at the EOS, the value
           network, then the PPO targets (KL-penalised rewards, GAE,
           whitening);
  update   `epochs` x `minibatches` PPO updates (policy and value forward
           and backward, optimizer) in one `lax.scan`.

Tokens/s counts response tokens: sampled tokens for the rollout, response
tokens scored (each by four networks) for scoring, and response tokens
trained on, once per epoch, for the update. Networks are randomly
initialised (the cost does not depend on the weights: responses are always
sampled to full length) and prompts are random token ids.
"""

import argparse
import time

import jax
import numpy as np

import bench_common
from jaxrlhf import algorithms
from jaxrlhf import sharding
from jaxrlhf.algorithms.online import iteration
from jaxrlhf.algorithms.online import reward_sources
from jaxrlhf.algorithms.online import ppo
from jaxrlhf.rl import rollout as rollout_lib


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawTextHelpFormatter)
  bench_common.add_shape_flags(p, optimizer="adamw", steps=5)
  p.add_argument("--epochs", type=int, default=4)
  p.add_argument("--minibatches", type=int, default=1)
  args = p.parse_args()

  c = bench_common.config_from_flags(args, "ppo", **{
      "online.num_epochs": args.epochs,
      "online.num_minibatches": args.minibatches,
      # Only the shapes matter: no checkpoint is read (see init below).
      "init.policy_checkpoint": "unused",
      "online.reward_model_checkpoint": "unused",
  })
  rules = sharding.as_rules(c.sharding.logical_axis_rules)
  b, lp, lt = args.batch_size, args.inputs_length, args.targets_length
  rng = np.random.default_rng(0)
  prompts = rng.integers(3, 100, size=(b, lp)).astype(np.int32)
  prompts[:, -1] = 1

  with sharding.activate(c) as mesh:
    trainer = algorithms.build(c, mesh)
    # Random networks in their shardings (init_state would load the
    # checkpoints).
    state = trainer._init(jax.random.PRNGKey(0))  # pylint: disable=protected-access
    batch = sharding.global_batch({"encoder_input_tokens": prompts}, mesh,
                                  rules)
    o = c.online
    eos = trainer.vocabulary.eos_id
    reward_lm = trainer.online.rewards.lm

    # The two halves of `iteration.make_rollout`, jitted apart.
    @jax.jit
    def rollout(params, prompt_tokens, key):
      return rollout_lib.sample_responses(
          trainer.lm, params["policy"], prompt_tokens, key,
          max_new_tokens=trainer.online.max_new_tokens,
          temperature=o.temperature,
          eos_id=eos).tokens

    @jax.jit
    def scoring(params, frozen, prompt_tokens, tokens, kl_coef):
      ro = rollout_lib.assemble_rollout(
          trainer.lm, params["policy"], frozen["reference"], reward_lm,
          frozen["reward"], prompt_tokens, tokens, temperature=o.temperature,
          eos_id=eos, missing_eos_penalty=o.missing_eos_penalty)
      return ro, ppo.rollout_targets(
          trainer.config, trainer.online.rewards.lm, params["value"], ro,
          kl_coef)

    @jax.jit
    def update(state, ro, targets, key):
      return iteration.run_updates(
          trainer, state, ppo.update_data(ro, targets),
          lambda params, minibatch: ppo.minibatch_loss(trainer, params,
                                                       minibatch), key)

    key = jax.random.PRNGKey(1)
    prompt_tokens = batch["encoder_input_tokens"]
    t_roll, tokens = bench_common.timed(rollout, state.params, prompt_tokens,
                                        key, repeats=args.steps)
    t_score, (ro, targets) = bench_common.timed(
        scoring, state.params, state.frozen, prompt_tokens, tokens,
        state.algorithm_state["kl_coef"], repeats=args.steps)
    t_update, _ = bench_common.timed(update, state, ro, targets, key,
                                     repeats=args.steps)

    step = trainer.train_step
    state = step(state, batch)[0]  # compile (the step donates its state)
    jax.block_until_ready(state)
    start = time.perf_counter()
    for _ in range(args.steps):
      state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    t_step = (time.perf_counter() - start) / args.steps

  response_tokens = b * lt
  print(bench_common.device_line(mesh))
  print(f"PPO iteration: {args.arch} {args.size}, {b} prompts x {lp} "
        f"tokens, {lt} sampled tokens each, {args.epochs} epochs x {args.minibatches} "
        f"minibatches x {args.num_microbatches} micro-batches")
  print(f"{'part':<10} {'ms':>10} {'share':>7} {'tokens/s':>12}  counts")
  parts = (("rollout", t_roll, response_tokens, "sampled tokens"),
           ("scoring", t_score, response_tokens,
            "response tokens, 4 networks each"),
           ("update", t_update, response_tokens * args.epochs,
            "response tokens x epochs"))
  total = t_roll + t_score + t_update
  for name, t, n, what in parts:
    print(f"{name:<10} {t * 1e3:>10.1f} {t / total:>7.1%} {n / t:>12,.0f}  "
          f"{what}")
  print(f"{'sum':<10} {total * 1e3:>10.1f}")
  print(f"{'step':<10} {t_step * 1e3:>10.1f} {'':>7} "
        f"{response_tokens / t_step:>12,.0f}  the jitted train step, whole")


if __name__ == "__main__":
  main()
