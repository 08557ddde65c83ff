"""Every 8-device check of the suite, in one process; run by
tests/test_eight_devices.py.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
      python tests/eight_devices.py WORKDIR

The same computations run on a mesh of one of the 8 devices and on a 4x2
(data x model) mesh of all of them, in this process (one interpreter start
and one compilation of each single-device step for all the checks):
  models   T5 (the t5x encdec fixture) and Llama (the llama_gqa HF fixture)
           loaded with `from_pretrained` onto one device and onto the mesh:
           logits and greedy KV-cache decodes;
  offline  three DPO and three DRO-V train steps from the seeded
           initialisation;
  online   three PPO iterations (sampling, scoring, minibatch updates), the
           4x2 run with micro-batches, and the refusal of micro-batches whose
           rows do not split over the data shards;
  overlap  two GRPO steps sampled on 4 devices and trained on the other 4
           (on-policy and one step ahead) against sampling and training on
           the same 4, and one step ahead with the decoupled correction on
           those same 4;
  engine   two GRPO steps of a tiny Llama decoded by the continuous
           engine on a paged KV cache, on one device and on the 4x2 mesh,
           and sampled on 4 sampler devices and trained on the other 4
           (on-policy and one step ahead);
  loop     a 12-step SFT run through the training loop (checkpoints,
           metrics, restore; no evaluation);
  plan     `jaxrlhf.plan` of offline's DRO-V step on the 4x2 mesh: the
           memory XLA plans for its arguments against the bytes the real
           state and batch take on one device, the plan with micro-batches,
           and the FLOPs counted with 2 layers scanned and unrolled.
Prints one line "RESULT <json>".
"""

import json
import os
import pathlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from conftest import (FIXTURES, evaluated_by, from_scratch, tiny_config,  # noqa: E402
                      trainer_of)
from jaxrlhf import algorithms  # noqa: E402
from jaxrlhf import flops  # noqa: E402
from jaxrlhf import plan as plan_lib  # noqa: E402
from jaxrlhf import sharding  # noqa: E402
from jaxrlhf import sharding_rules  # noqa: E402
from jaxrlhf.algorithms.online import iteration  # noqa: E402
from jaxrlhf.algorithms import state as state_lib  # noqa: E402
from jaxrlhf.data import prompts as prompts_lib  # noqa: E402
from jaxrlhf.data import synthetic  # noqa: E402
from jaxrlhf.data import synthetic_feedback  # noqa: E402
from jaxrlhf.models import sampling  # noqa: E402
from jaxrlhf.models.layers import rotary  # noqa: E402
from jaxrlhf.models.loading import from_pretrained  # noqa: E402
from jaxrlhf.train import checkpointing  # noqa: E402
from jaxrlhf.train import loop  # noqa: E402

NEW_TOKENS = 8
ONE = jax.devices()[:1]


def _spec(array):
  return [None if a is None else str(a) for a in array.sharding.spec]


def _diff(single, sharded):
  return float(np.max(np.abs(np.asarray(single, np.float32)
                             - np.asarray(sharded, np.float32))))


def _norm(tree):
  return float(np.sqrt(sum(np.sum(np.float64(x) ** 2)
                           for x in jax.tree.leaves(tree))))


def _sum(tree):
  return float(sum(np.float64(np.asarray(x)).sum()
                   for x in jax.tree.leaves(tree)))


# --- models ---------------------------------------------------------------------


def _model(path, make_inputs, forward, sample, mesh, rules, kernel_path):
  out = {}
  module, _, params = from_pretrained(path)
  inputs = make_inputs()
  logits = jax.jit(forward, static_argnums=0)(module, params, *inputs)
  greedy = sample(module, params, *inputs, greedy=True)
  module, _, sharded = from_pretrained(path, mesh=mesh, rules=rules)
  kernel = sharded
  for key in kernel_path:
    kernel = kernel[key]
  out["kernel_spec"] = _spec(kernel)
  out["kernel_devices"] = len(kernel.sharding.device_set)
  batch = sharding.batch_sharding(mesh, rules, 2)
  sharded_inputs = [jax.device_put(x, batch) for x in inputs]
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    logits_8 = jax.jit(forward, static_argnums=0)(module, sharded,
                                                  *sharded_inputs)
    greedy_8 = sample(module, sharded, *sharded_inputs, greedy=True)
  out["logits_spec"] = _spec(logits_8)
  out["tokens_spec"] = _spec(greedy_8.tokens)
  out["logits_diff"] = _diff(logits, logits_8)
  out["greedy_equal"] = bool(np.array_equal(greedy.tokens, greedy_8.tokens))
  out["greedy_logprob_diff"] = _diff(greedy.logprobs, greedy_8.logprobs)
  out["greedy_has_eos"] = np.asarray(greedy.has_eos).tolist()
  out["greedy_tokens"] = np.asarray(greedy.tokens).tolist()
  return out


def models():
  mesh = sharding.create_mesh((4, 2), ("data", "model"))
  rules = sharding_rules.STANDARD_RULES
  results = {}
  encdec = FIXTURES / "t5x" / "encdec"
  e = np.load(encdec / "expected.npz")
  # 4 rows (the data axis): the fixture's 3 prompts and the first again.
  prompts = np.concatenate([e["encoder_input_tokens"],
                            e["encoder_input_tokens"][:1]])
  decoder_inputs = np.concatenate([e["decoder_input_tokens"],
                                   e["decoder_input_tokens"][:1]])
  results["t5"] = _model(
      encdec / "checkpoint_3", lambda: (prompts,),
      lambda m, p, x: m.apply({"params": p}, x, decoder_inputs),
      lambda m, p, x, **kw: sampling.sample_encoder_decoder(
          m, p, x, jax.random.PRNGKey(1), NEW_TOKENS, **kw),
      mesh, rules, ("decoder", "logits_dense", "kernel"))
  results["t5_expected_greedy"] = e["predict_greedy"].tolist()
  tokens = np.array([[5, 9, 12, 7, 3, 8], [0, 0, 4, 4, 11, 6],
                     [0, 0, 0, 0, 13, 2], [0, 17, 18, 19, 20, 21]], np.int32)
  mask = (tokens > 0).astype(np.int32)

  def llama_forward(m, p, x, a):
    return m.apply({"params": p}, x, rotary.positions_from_mask(a), a)

  results["llama"] = _model(
      FIXTURES / "hf" / "llama_gqa", lambda: (tokens, mask), llama_forward,
      lambda m, p, x, a, **kw: sampling.sample_decoder_only(
          m, p, x, a, jax.random.PRNGKey(2), NEW_TOKENS, eos_id=47, **kw),
      mesh, rules, ("decoder", "layers_0", "mlp", "wi_0", "kernel"))
  return results


# --- train steps ------------------------------------------------------------------


def _train(config, shape, algorithm, devices, metric_keys, num_steps):
  """(the initial parameters, [{metric: value}] of `num_steps` train steps
  of `algorithm` from its seeded initialisation, the final state) on a
  mesh of `shape` over `devices`."""
  mesh = sharding.create_mesh(shape, config.mesh.axis_names, devices)
  rules = sharding.as_rules(config.sharding.logical_axis_rules)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    trainer = trainer_of(algorithm, config, mesh)
    state = trainer._init(jax.random.PRNGKey(config.seed))  # pylint: disable=protected-access
    initial = jax.device_get(state.params)
    batches = trainer.train_batches(0)
    steps = []
    for _ in range(num_steps):
      batch = sharding.global_batch(next(batches), mesh, rules)
      state, metrics = trainer.train_step(state, batch)
      steps.append({k: float(metrics[k]) for k in metric_keys})
  return initial, steps, state


def _steps(config, shape, algorithm, devices, metric_keys):
  """Three train steps of `algorithm` from its seeded initialisation."""
  initial, steps, state = _train(config, shape, algorithm, devices,
                                 metric_keys, 3)
  kernel = state.params["policy"]["encoder"]["layers_0"]["mlp"]["wi_0"][
      "kernel"]
  return {"steps": steps, "initial": initial,
          "params": jax.device_get(state.params),
          "params_sum": _sum(state.params), "kernel_spec": _spec(kernel),
          "kernel_shards": len({s.device for s in kernel.addressable_shards})}


FEEDBACK = {"dpo": "pairs", "dro_v": "trajectory"}


def _offline_config(algorithm, shape, workdir, **overrides):
  """The tiny model on the feedback `offline` wrote for `algorithm`, 16
  rows a step. DRO-V's on 4x2 is also the step `plans` plans: the same
  program, so the suite's persistent compilation cache compiles its step
  and its initialisation once for both; 16 rows let 4 micro-batches split
  over the 4 data shards."""
  config = tiny_config(algorithm=algorithm, data__task=f"sharded_{algorithm}",
                       mesh__shape=shape, train__batch_size=16, **overrides)
  config.data.files.train = str(workdir / f"{FEEDBACK[algorithm]}.jsonl")
  return config


def offline(workdir):
  """DPO and DRO-V: three steps on one device and on 4x2."""
  results = {}
  examples = synthetic.make_examples("train", 64)
  for algorithm, kind in FEEDBACK.items():
    synthetic_feedback.write_synthetic_feedback(
        str(workdir / f"{kind}.jsonl"), kind, [e["inputs"] for e in examples],
        [[e["targets"], e["ideal"]] for e in examples],
        synthetic.gold_reward, beta=10.0)
    value = from_scratch(algorithms.get(algorithm))
    runs = {}
    for name, shape, devices in (("one", (1, 1), ONE),
                                 ("eight", (4, 2), None)):
      runs[name] = _steps(_offline_config(algorithm, shape, workdir), shape,
                          value, devices, ("loss",))
    results[algorithm] = runs
    one, eight = (runs[k].pop("params")["policy"] for k in ("one", "eight"))
    initial = runs["one"].pop("initial")["policy"]
    del runs["eight"]["initial"]
    # Without the token embedding: a token used alike in a pair's two
    # completions gets gradients that cancel to a rounding residue, which
    # Adafactor (epsilon 1e-30) scales to a full-size step in one layout and
    # not in the other (residue exactly 0).
    for tree in (one, eight, initial):
      del tree["token_embedder"]
    runs["policy_difference"] = _norm(jax.tree.map(np.subtract, one, eight))
    runs["policy_movement"] = _norm(jax.tree.map(np.subtract, one, initial))
  return results


def _ppo_config(shape, batch_size, num_microbatches):
  # No checkpoint is read: the networks are the seeded random initialisation.
  return tiny_config(algorithm="ppo", mesh__shape=shape,
                     train__batch_size=batch_size,
                     train__num_microbatches=num_microbatches,
                     init__policy_checkpoint="unused",
                     online__reward_model_checkpoint="unused",
                     online__num_epochs=2, online__num_minibatches=2,
                     optimizer__warmup_steps=0)


def online():
  """PPO: whole minibatches on one device; 16 responses, 2 minibatches of
  8, 2 micro-batches of 4 (one per data shard) on 4x2."""
  keys = ("loss", "value_loss", "score", "kl", "response_length",
          "clip_fraction")
  ppo = algorithms.get("ppo")
  results = {
      "one": _steps(_ppo_config((1, 1), 16, 1), (1, 1), ppo, ONE, keys),
      "eight": _steps(_ppo_config((4, 2), 16, 2), (4, 2), ppo, None, keys)}
  for run in results.values():
    del run["params"], run["initial"]
  # 8 responses / 2 minibatches / 2 micro-batches = 2 rows over 4 shards.
  config = _ppo_config((4, 2), 8, 2)
  try:
    with sharding.activate(config) as mesh:
      algorithms.build(config, mesh)
    results["uneven_error"] = None
  except ValueError as e:
    results["uneven_error"] = str(e)
  return results


def _overlap_config(**overrides):
  # No checkpoint is read; a host reward (the words of each response) that
  # a random policy's responses vary in.
  return tiny_config(algorithm="grpo", mesh__shape=(-1, 1),
                     train__batch_size=8, train__num_steps=2,
                     init__policy_checkpoint="unused",
                     rewards__reward_model__weight=0.0,
                     rewards__functions="reward_functions:word_count",
                     online__samples_per_prompt=2, online__max_new_tokens=8,
                     optimizer__warmup_steps=0, **overrides)


def _overlap_run(config, devices=None):
  """Two GRPO steps; and, for step 2's prompts sampled with step 2's key
  from the initial parameters, the masked token means of log pi_initial -
  log pi_after_step_1 (what approx_kl_k1 measures when step 2 trains on
  them with the initial policy as the old one) and of min(pi_after /
  pi_initial, 2) (the decoupled correction's weights)."""
  keys = ("loss", "score", "kl", "approx_kl_k1", "correction/weight_mean")
  mesh = sharding.training_mesh(config, devices)
  rules = sharding.as_rules(config.sharding.logical_axis_rules)
  grpo = from_scratch(algorithms.get("grpo"))
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    trainer = trainer_of(grpo, config, mesh)
    state = trainer._init(jax.random.PRNGKey(config.seed))  # pylint: disable=protected-access
    initial = jax.tree.map(jnp.copy, state.params)
    batches = trainer.train_batches(0)
    steps, after_first = [], None
    for _ in range(2):
      batch = sharding.global_batch(next(batches), mesh, rules)
      state, metrics = trainer.train_step(state, batch)
      steps.append({k: float(metrics[k]) for k in keys if k in metrics})
      if after_first is None:
        after_first = jax.tree.map(jnp.copy, state.params)
        second_key = iteration.split_step_key(state.rng)[1]
    prompts = sharding.global_batch(
        trainer.online.prompt_source.stream.batch_at(1), mesh, rules)[
            prompts_lib.PROMPT_FEATURE]

    @jax.jit
    def stale(initial, after_first):
      samples = iteration.sample(trainer, initial, state.frozen, prompts,
                                 second_key)
      old, new = (iteration.score(trainer, p, state.frozen, prompts, samples)
                  for p in (initial, after_first))
      mean = lambda x: jnp.sum(x * old.mask) / jnp.sum(old.mask)
      return {"approx_kl_k1": mean(old.logprobs - new.logprobs),
              "weight_mean": mean(jnp.minimum(
                  jnp.exp(new.logprobs - old.logprobs), 2.0))}
  return {"steps": steps,
          "stale": {k: float(v) for k, v in stale(initial,
                                                  after_first).items()},
          "policy_devices": sorted(
              d.id for d in jax.tree.leaves(state.params)[0].devices())}


def overlap():
  """Rollouts on 4 sampler devices and updates on the other 4, on-policy
  and one step ahead, against sampling and training on the same 4."""
  split = dict(online__sampler_devices=4)
  return {
      "same_devices": _overlap_run(_overlap_config(), jax.devices()[4:]),
      "split": _overlap_run(_overlap_config(**split)),
      "ahead": _overlap_run(_overlap_config(online__off_policy_steps=1,
                                            **split)),
      # (One step ahead on the training devices themselves.)
      "decoupled": _overlap_run(_overlap_config(
          online__off_policy_steps=1,
          online__off_policy_correction="decoupled"), jax.devices()[4:])}


def engine():
  """Two GRPO steps of a tiny Llama whose responses the continuous engine
  decodes on a paged KV cache, on one device and on the 4x2 mesh; and
  (`_overlap_run`) sampled on 4 sampler devices and trained on the other
  4, on-policy and one step ahead."""
  keys = ("loss", "score", "kl", "response_length")
  config = lambda shape, **overrides: tiny_config(
      algorithm="grpo", mesh__shape=shape, model__arch="llama",
      model__num_encoder_layers=None, train__batch_size=8,
      train__num_steps=2, init__policy_checkpoint="unused",
      rewards__reward_model__weight=0.0,
      rewards__functions="reward_functions:word_count",
      online__samples_per_prompt=2, online__max_new_tokens=8,
      online__engine="continuous", online__engine_page_size=4,
      optimizer__warmup_steps=0, **overrides)
  grpo = from_scratch(algorithms.get("grpo"))
  out = {}
  for name, shape, devices in (("one", (1, 1), ONE), ("eight", (4, 2), None)):
    _, steps, state = _train(config(shape), shape, grpo, devices, keys, 2)
    out[name] = {"steps": steps, "params_sum": _sum(state.params),
                 "devices": len(jax.tree.leaves(state.params)[0].devices())}
  for name, ahead in (("split", 0), ("ahead", 1)):
    out[name] = _overlap_run(config((-1, 1), online__sampler_devices=4,
                                    online__off_policy_steps=ahead))
  return out


# --- the training loop ----------------------------------------------------------


def _losses(workdir):
  rows = [json.loads(l) for l in open(workdir / "metrics.jsonl")]
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


def training_loop(workdir):
  """12 SFT steps through the loop on one device and on 4x2; the 4x2 run's
  final checkpoint restored the way the loop restores it."""
  results = {}
  # Without the evaluations before and after training (its greedy decodes
  # compile on each mesh; training is the same either way).
  sft = algorithms.REGISTRY["sft"]
  algorithms.REGISTRY["sft"] = evaluated_by(sft)
  for name, shape, devices in (("one", (1, 1), ONE),
                               ("eight", (4, 2), None)):
    config = tiny_config(train__num_steps=12, checkpoint__every_steps=3,
                         mesh__shape=shape)
    run = workdir / f"sft_{name}"
    loop.train(config, str(run), devices=devices)
    with sharding.activate(config, devices) as mesh:
      trainer = algorithms.build(config, mesh)
      ckpt = checkpointing.Checkpointer(str(run / "checkpoints"), 2)
      state, position = ckpt.restore(
          ckpt.latest_step(), state_lib.abstract_with_shardings(
              trainer.abstract_state, trainer.state_shardings))
      ckpt.close()
    kernel = state.params["policy"]["decoder"]["layers_0"]["mlp"]["wi_0"][
        "kernel"]
    results[name] = {
        "losses": {str(k): v for k, v in _losses(run).items()},
        "step": int(state.step), "position": position,
        "wi_0_spec": [str(a) for a in kernel.sharding.spec],
        "wi_0_global_shape": list(kernel.shape),
        "wi_0_shard_shape": list(kernel.addressable_shards[0].data.shape)}
  algorithms.REGISTRY["sft"] = sft
  return results


# --- the ahead-of-time plan -----------------------------------------------------


def _bytes_on(tree, device) -> int:
  return sum(s.data.nbytes for leaf in jax.tree.leaves(tree)
             for s in leaf.addressable_shards if s.device == device)


def _planned_flops_per_chip(config):
  """The FLOPs a plan counts (the step's jaxpr, `flops.function_flops`; no
  compile needed) per chip of the 4x2 mesh."""
  with sharding.activate(config) as mesh:
    trainer = algorithms.build(config, mesh, shapes_only=True)
    state = state_lib.abstract_with_shardings(trainer.abstract_state,
                                              trainer.state_shardings)
    return flops.function_flops(trainer.train_step, state,
                                trainer.batch_spec()) / jax.device_count()


def plans(workdir):
  """DRO-V on 4x2 (`offline`'s step): the plan, and what a real state and
  batch take on device 0; the plan with 4 micro-batches; and the FLOPs the
  plan counts, counted the plan's way without a compile, of that step and
  of the step with 2 layers scanned and unrolled (2, so that a count of the
  scan's body once would differ)."""
  def config(**overrides):
    return _offline_config("dro_v", (4, 2), workdir, **overrides)

  results = {}
  for name, overrides in (("whole", {}),
                          ("microbatches", {"train__num_microbatches": 4})):
    results[name] = plan_lib.make_plan(config(**overrides), jax.devices(),
                                       topology="cpu:8")
  results["whole_flops_per_chip"] = _planned_flops_per_chip(config())
  two_layers = dict(model__num_encoder_layers=2, model__num_decoder_layers=2)
  for name, scan in (("unrolled", False), ("scanned", True)):
    results[f"{name}_flops_per_chip"] = _planned_flops_per_chip(
        config(model__scan_layers=scan, **two_layers))
  base = config()
  with sharding.activate(base) as mesh:
    trainer = algorithms.build(base, mesh)
    state = trainer._init(jax.random.PRNGKey(0))  # pylint: disable=protected-access
    batch = sharding.global_batch(next(trainer.train_batches(0)), mesh,
                                  trainer.rules)
  device = jax.devices()[0]
  results["real_bytes"] = {"state": _bytes_on(state, device),
                           "batch": _bytes_on(batch, device),
                           "params": _bytes_on(state.params, device),
                           "opt_state": _bytes_on(state.opt_state, device),
                           "frozen": _bytes_on(state.frozen, device)}
  return results


def paged_kernel():
  """JAX's Pallas TPU paged-attention kernel (interpreted on these CPUs)
  under the 4x2 mesh, its 8 rows split over the batch axes
  (`jax.shard_map`: XLA does not partition a Mosaic kernel), against the
  XLA loop over the pages in use on the same rows: the largest
  difference, and whether the traced call maps the kernel over the mesh;
  and the same under the bare mesh, with no logical-axis rules (every
  device then runs all the rows)."""
  from jaxrlhf.models.layers import paged_attention  # pylint: disable=g-import-not-at-top
  from jaxrlhf.models.layers import paged_kv  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(3)
  lengths = np.array([1, 9, 30, 0, 17, 4, 12, 25])
  tables = paged_kv.reserve(paged_kv.init_tables(64, 4, 8, 8),
                            jnp.asarray(lengths, jnp.int32))
  pools = [jnp.asarray(rng.normal(size=(2, 64, 4, 8)), jnp.bfloat16)
           for _ in range(2)]
  index = paged_kv.PagedIndex(
      tables.page_table, jnp.asarray(np.maximum(lengths, 1) - 1, jnp.int32),
      4)
  query = jnp.asarray(rng.normal(size=(8, 1, 4, 8)), jnp.float32)
  # A new jit for each mesh context (the logical-axis rules are not in
  # its cache key).
  kernel = lambda: jax.jit(lambda q, k, v, i: paged_attention.tpu_kernel(
      q, k, v, i, scale=0.4, interpret=True))
  with sharding.activate(tiny_config(mesh__shape=(4, 2))) as mesh:
    got = kernel()(query, *pools, index)
    mapped = "shard_map" in str(kernel().trace(query, *pools, index).jaxpr)
  with jax.set_mesh(mesh):
    bare = kernel()(query, *pools, index)
    mapped = mapped and "shard_map" in str(
        kernel().trace(query, *pools, index).jaxpr)
  want = paged_attention.attend_pages(query, *pools, index, scale=0.4)
  return {"max_diff": float(jnp.max(jnp.abs(got - want))),
          "max_diff_bare": float(jnp.max(jnp.abs(bare - want))),
          "shard_map": mapped}


def episodes(workdir):
  """Two GRPO steps on multi-turn episodes (the agents' miniature config:
  its biased tiny Qwen2 and `Said`'s environment), on one device, and
  played on 4 sampler devices while the other 4 train, on-policy and one
  step ahead: each step's logged metrics."""
  import test_agent_training  # pylint: disable=g-import-not-at-top
  run = test_agent_training.make_policy_run(workdir / "agents")
  out = {}
  for name, devices, overrides in (
      ("one", ONE, {}),
      ("split", None, dict(mesh__shape=(-1, 1), online__sampler_devices=4)),
      ("ahead", None, dict(mesh__shape=(-1, 1), online__sampler_devices=4,
                           online__off_policy_steps=1))):
    config = test_agent_training._config(run["root"], **overrides)  # pylint: disable=protected-access
    config.train.num_steps, config.train.batch_size = 2, 4
    config.online.environment = "test_engine_episodes:Said"
    config.init.policy_checkpoint = run["workdir"]
    loop.train(config, str(run["root"] / name), devices=devices)
    rows = [json.loads(l) for l in open(run["root"] / name / "metrics.jsonl")]
    out[name] = [r for r in rows if "episode/turns" in r]
  return out


def main():
  workdir = pathlib.Path(sys.argv[1])
  assert jax.device_count() == 8, jax.devices()
  results = {"devices": jax.device_count(), "models": models(),
             "offline": offline(workdir), "online": online(),
             "overlap": overlap(), "engine": engine(),
             "paged_kernel": paged_kernel(), "episodes": episodes(workdir),
             "loop": training_loop(workdir), "plan": plans(workdir)}
  print("RESULT " + json.dumps(results))


if __name__ == "__main__":
  main()
