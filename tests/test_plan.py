"""The ahead-of-time plan (`python -m jaxrlhf.plan`) and what it is made of:
the FLOP count of a jaxpr, the batch layout a trainer derives from its
config alone, the command line, and a TPU topology where libtpu is
installed.

The plan's memory figures against the bytes a real state and batch take
on a device, and micro-batches against whole batches, are checked on 8
devices (tests/eight_devices.py).
"""

import json
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from conftest import REPO, cli_args, quiet_env, synthetic_feedback_file
from conftest import tiny_config
from jaxrlhf import algorithms
from jaxrlhf import flops
from jaxrlhf import plan as plan_lib
from jaxrlhf import sharding
from jaxrlhf import sharding_rules
from jaxrlhf.data import alignment_kinds
from jaxrlhf.data import feature_converters
from jaxrlhf.data import names
from jaxrlhf.data import shapes
from jaxrlhf.data import synthetic
from jaxrlhf.models.layers import moe

LLAMA = dict(model__arch="llama", model__size="tiny",
             model__num_encoder_layers=None)


# --- FLOPs of a jaxpr ----------------------------------------------------------


def test_flops_of_a_matmul_and_an_einsum_by_hand():
  x, w = jnp.ones((6, 5)), jnp.ones((5, 7))
  assert flops.function_flops(jnp.matmul, x, w) == 2 * 6 * 5 * 7
  # Batched attention-style contraction: [b, q, d] x [b, k, d] -> [b, q, k].
  q, k = jnp.ones((3, 4, 8)), jnp.ones((3, 9, 8))
  assert flops.function_flops(
      lambda a, b: jnp.einsum("bqd,bkd->bqk", a, b), q, k) == 2 * 3 * 4 * 9 * 8


def _layers(x, w, length):
  def body(c, _):
    return jnp.tanh(c @ w), None
  return jax.lax.scan(body, x, None, length=length)[0].sum()


def test_flops_count_each_scan_iteration_and_remat_recomputation():
  x, w = jnp.ones((16, 32)), jnp.ones((32, 32))
  one = 2 * 16 * 32 * 32
  assert flops.function_flops(jax.jit(lambda x, w: _layers(x, w, 10)),
                              x, w) == 10 * one
  # Nested loops multiply.
  nested = lambda x, w: jax.lax.scan(
      lambda c, _: (c + _layers(x, w, 3), None), 0.0, None, length=4)[0]
  assert flops.function_flops(nested, x, w) == 12 * one
  # Backward: dL/dx and dL/dw per layer (2 matmuls) after the forward (1);
  # rematerialised, the forward runs once more.
  grad = jax.grad(lambda w: _layers(x, w, 10))
  assert flops.function_flops(jax.jit(grad), w) == 30 * one
  remat = jax.grad(jax.checkpoint(lambda w: _layers(x, w, 10)))
  assert flops.function_flops(jax.jit(remat), w) == 40 * one


def test_flops_of_a_cond_are_its_costlier_branch():
  x, w = jnp.ones((16, 32)), jnp.ones((32, 32))
  f = lambda p, x, w: jax.lax.cond(p, lambda: (x @ w @ w).sum(),
                                   lambda: (x @ w).sum())
  assert flops.function_flops(f, True, x, w) == 2 * (2 * 16 * 32 * 32)


def test_flops_of_a_while_loop_with_a_counter_bound_are_the_bound():
  x, w = jnp.ones((16, 32)), jnp.ones((32, 32))
  one = 2 * 16 * 32 * 32

  def loop(x, w, start, limit, stride, early_exit=True):
    def keep_going(c):
      i, x = c
      more = i < limit
      return (more & (jnp.max(x) < 1e6)) if early_exit else more
    return jax.lax.while_loop(keep_going, lambda c: (c[0] + stride,
                                                     jnp.tanh(c[1] @ w)),
                              (jnp.int32(start), x))[1]
  # i = 1, 4, 7 run the body (ceil((10 - 1) / 3) = 3), and-ed with an
  # early exit or not.
  assert flops.function_flops(lambda x, w: loop(x, w, 1, 10, 3), x, w) == (
      3 * one)
  assert flops.function_flops(
      lambda x, w: loop(x, w, 1, 10, 3, early_exit=False), x, w) == 3 * one
  # No bound to read (a traced limit, or a counter that does not grow):
  # the body once.
  assert flops.function_flops(
      lambda x, w, n: loop(x, w, 0, n, 1), x, w, 10) == one
  assert flops.function_flops(lambda x, w: loop(x, w, 0, 10, 0), x, w) == one


def test_a_shard_map_body_counts_once_per_device():
  mesh = jax.sharding.AbstractMesh((4, 2), ("data", "model"))
  x, w = jnp.ones((16, 32)), jnp.ones((32, 8))
  split = lambda x, w: jax.shard_map(
      jnp.matmul, mesh=mesh, in_specs=(P("data"), P(None, "model")),
      out_specs=P("data", "model"))(x, w)
  with jax.sharding.use_abstract_mesh(mesh):
    assert flops.function_flops(split, x, w) == 2 * 16 * 32 * 8


@pytest.mark.parametrize("expert_devices", [1, 4])
def test_flops_of_a_mixture_of_experts_by_hand(expert_devices):
  """Every (token, expert) copy once through its expert's SwiGLU, whether
  the experts are all held or split over 4 devices (each multiplying
  every device's copies by its 2 experts: a quarter of them in its groups
  when the routing is balanced); gradients with respect to the weights."""
  tokens, embed, experts, top_k, mlp = 2 * 6, 12, 8, 2, 16
  layer = moe.MoeMlp(num_experts=experts, top_k=top_k, mlp_dim=mlp)
  x = jnp.ones((2, 6, embed))
  mesh = jax.sharding.AbstractMesh((expert_devices, 1), ("data", "model"))
  router = 2 * tokens * embed * experts
  one_projection = 2 * tokens * top_k * embed * mlp
  with nn.logical_axis_rules(sharding.experts_over(
      sharding_rules.STANDARD_RULES, "data")):
    params = jax.eval_shape(lambda: layer.init(jax.random.key(0), x))
    with jax.sharding.use_abstract_mesh(mesh):
      forward = lambda p: layer.apply(p, x)[0].astype(jnp.float32).sum()
      assert moe.expert_mesh_axes(experts) == (
          ("data",) if expert_devices > 1 else ())
      assert flops.function_flops(forward, params) == (
          router + 3 * one_projection)
      # Backward: the router's weight gradient, the three experts' weight
      # gradients and the gradient through wo into its inputs (x itself
      # is not differentiated).
      assert flops.function_flops(jax.grad(forward), params) == (
          2 * router + (3 + 3 + 1) * one_projection)


# --- a batch's layout from the config alone ----------------------------------------


def _file(tmp_path, kind):
  if kind != "thumbs":
    return synthetic_feedback_file(tmp_path, kind, count=16,
                                   completions=("ideal", "targets", "inputs"))
  path = tmp_path / "thumbs.jsonl"
  with open(path, "w") as f:
    for i, e in enumerate(synthetic.make_examples("train", 16)):
      f.write(json.dumps({"prompt": e["inputs"], "completion": e["targets"],
                          "label": float(i % 2)}) + "\n")
  return str(path)


CASES = {
    "sft-t5": ({}, None),
    "sft-llama": (LLAMA, None),
    "dpo-t5": ({"algorithm": "dpo"}, "pairs"),
    "dpo-llama": (dict(LLAMA, algorithm="dpo"), "pairs"),
    "ranking-t5": ({"algorithm": "reward_model_ranking"}, "ranking"),
    "kto-llama": (dict(LLAMA, algorithm="kto"), "trajectory"),
    "thumbs-t5": ({"algorithm": "kto_thumbs"}, "thumbs"),
    "ppo-t5": ({"algorithm": "ppo", "online__reward_model_checkpoint": "x"},
               None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_batch_spec_is_the_layout_of_a_real_batch(case, tmp_path):
  """What a plan compiles for (no data read) is what training feeds: every
  feature's shape and dtype, for the data kinds on both architectures; and
  a shapes-only trainer lays out the same train state."""
  overrides, kind = CASES[case]
  config = tiny_config(**overrides, train__batch_size=4)
  if kind:
    with config.unlocked():
      config.data.task = f"plan_{case.replace('-', '_')}"
      config.reward_model.num_completions = 3
    config.data.files.train = _file(tmp_path, kind)
  with sharding.activate(config, jax.devices()[:1]) as mesh:
    real = algorithms.build(config, mesh)
    planned = algorithms.build(config, mesh, shapes_only=True)
    batch = next(real.train_batches(0))
    spec = planned.batch_spec()
  assert {k: (v.shape, np.dtype(v.dtype)) for k, v in spec.items()} == {
      k: (np.shape(v), np.asarray(v).dtype) for k, v in batch.items()}
  same = jax.tree.map(lambda a, b: (a.shape, a.dtype) == (b.shape, b.dtype),
                      real.abstract_state, planned.abstract_state)
  assert all(jax.tree.leaves(same))


# (kind or None for SFT, converter options) for `shapes.example_spec`
# against the seqio converters: every data kind on both architectures, and
# the decoder-only prompt with a BOS and with its EOS kept.
LAYOUTS = [(kind, arch, {}) for kind in (None, "pairs", "ranking",
                                         "trajectory", "thumbs")
           for arch in shapes.ARCHITECTURES] + [
               (None, "decoder_only", {"prompt_bos_id": 7}),
               ("pairs", "decoder_only", {"strip_prompt_eos": False,
                                          "eos_id": 5})]


@pytest.mark.parametrize("kind, arch, options", LAYOUTS)
@pytest.mark.parametrize("pack", [0, 3])
def test_the_planned_layout_is_the_converters(kind, arch, options, pack):
  """What a plan lays out without seqio (`data.shapes`) is what the seqio
  converter and the packer make of an example, feature by feature, so the
  two cannot drift; a ranking (K rows per example) is not packed by
  either."""
  ranked = kind == "ranking"
  lengths = ({"inputs": 7, "targets": 5} if kind is None else
             {"prompt": 7, **{f: 5 for f in alignment_kinds.get_kind(
                 kind).completion_fields}})
  k = 3 if ranked else None
  planned = shapes.example_spec(kind, arch, lengths, num_completions=k,
                                **options)
  if kind is None:
    converter = feature_converters.sft_feature_converter(arch, **options)
  else:
    converter = feature_converters.feature_converter_for(
        kind, arch, num_completions=k, **options)
  real = feature_converters.output_spec(converter, kind, lengths)
  if pack and ranked:
    with pytest.raises(ValueError, match="cannot be packed"):
      shapes.packed_spec(planned, pack)
    with pytest.raises(ValueError, match="cannot be packed"):
      feature_converters.Packer(real, pack)
    return
  if pack:
    planned = shapes.packed_spec(planned, pack)
    real = feature_converters.Packer(real, pack).output_spec()
  assert planned == {name: (tuple(s.shape), np.dtype(s.dtype.as_numpy_dtype))
                     for name, s in real.items()}


def test_builtin_vocabulary_sizes_are_the_registered_tasks():
  """A plan counts a built-in task's vocabulary from its word list: the
  size seqio's vocabulary of the registered task has; the files' default
  is the synthetic task's; any other task is left to its registration."""
  from jaxrlhf.data import pipeline  # pylint: disable=g-import-not-at-top
  from jaxrlhf.data import tasks  # pylint: disable=g-import-not-at-top
  for task in (names.SYNTHETIC_SUMMARIZE, names.SYNTHETIC_SUMMARIZE_GRADED,
               names.SYNTHETIC_ARITHMETIC):
    features = pipeline.get_task(task).output_features
    for feature in features.values():
      assert shapes.builtin_vocab_size(task) == feature.vocabulary.vocab_size
  assert shapes.files_vocab_size() == (
      tasks.synthetic_vocabulary().vocab_size)
  assert shapes.builtin_vocab_size("plan_not_builtin") is None


def test_a_plan_without_the_vocabulary_file_takes_the_presets_size(tmp_path):
  """A vocabulary file may be on gs://: a plan reads none, and lays the
  model out at config.model.vocab_size, else its preset's (T5 1.1: 32128)."""
  config = tiny_config(algorithm="dpo", data__task="plan_vocab")
  config.data.files.train = str(tmp_path / "not_read_*.jsonl")
  config.data.files.vocabulary = "gs://nowhere/spm.model"
  with sharding.activate(config, jax.devices()[:1]) as mesh:
    planned = algorithms.build(config, mesh, shapes_only=True)
    assert planned.model_config.vocab_size == 32128
    config.model.vocab_size = 256
    assert algorithms.build(
        config, mesh, shapes_only=True).model_config.vocab_size == 256


# --- what a plan says -------------------------------------------------------------


def test_xla_out_of_memory_messages_are_read_in_gib():
  read = plan_lib._compile_error_figures  # pylint: disable=protected-access
  assert read(RuntimeError(
      "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory "
      "required for HLO temporaries (44.87G) exceeds available HBM "
      "(15.75G).")) == {"temporaries": 44.87, "usable_hbm": 15.75}
  assert read(RuntimeError(
      "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of "
      "memory in memory space hbm. Used 16.52G of 15.75G hbm. Exceeded hbm "
      "capacity by 784.0M.")) == {"total": 16.52, "usable_hbm": 15.75}


def test_a_step_that_does_not_fit_gets_a_suggestion():
  config = tiny_config(mesh__shape=(4, 8))
  tip = plan_lib.suggestion(config, {"total": 15.6}, state_gib=4.0,
                            budget_gib=14.0)
  assert tip.startswith("1.60 GiB over the budget")
  assert "remat_policy=full" in tip and "num_microbatches=2" in tip
  assert 'mesh.shape="(2,16)"' in tip
  # A state that alone fills the chip needs more chips, not remat.
  tip = plan_lib.suggestion(config, {"total": 30.0}, state_gib=12.0,
                            budget_gib=14.0)
  assert "larger slice" in tip and "remat" not in tip
  # An online step's rollout is not split by micro-batches.
  assert "rollout" not in plan_lib.suggestion(config, {"total": 15.6}, 4.0,
                                              14.0)
  tip = plan_lib.suggestion(config, {"total": 15.6}, state_gib=4.0,
                            budget_gib=14.0, algorithm=algorithms.get("ppo"))
  assert "not the rollout" in tip
  assert "online.rollout_microbatches=2 " in tip
  # KTO estimates its KL baseline from the whole batch: no micro-batches.
  tip = plan_lib.suggestion(tiny_config(algorithm="kto"), {"total": 15.6},
                            state_gib=4.0, budget_gib=14.0,
                            algorithm=algorithms.get("kto"))
  assert "num_microbatches" not in tip and "remat_policy=full" in tip


# A GRPO step whose rollout decodes with the continuous engine.
ENGINE_GRPO = dict(**LLAMA, model__num_decoder_layers=None,
                   model__dtype="bfloat16", algorithm="grpo",
                   train__batch_size=4, rewards__reward_model__weight=0.0,
                   rewards__gold_reward__weight=0.0,
                   rewards__functions="reward_functions:word_count",
                   online__reward_model_checkpoint="",
                   online__samples_per_prompt=2,
                   online__engine="continuous", online__engine_slots=3)


@pytest.mark.parametrize("page_size", [None, 5])
def test_the_engines_kv_cache_is_counted_by_hand(page_size):
  """Contiguous: slots x (prompt + budget - 1) positions; paged: the
  engine's default pool, slots x ceil(width / page_size) pages of
  page_size; each position layers x kv heads x head_dim x 2 (keys,
  values) x 2 bytes (bfloat16). A lockstep step has no engine cache."""
  config = tiny_config(**ENGINE_GRPO, online__engine_page_size=page_size)
  with sharding.activate(config, jax.devices()[:1]) as mesh:
    trainer = algorithms.build(config, mesh, shapes_only=True)
    cache = plan_lib.engine_kv_cache(config, trainer)
    model = trainer.model_config
    per_position = (model.num_layers * model.num_kv_heads * model.head_dim
                    * 2 * 2)
    width = trainer.prompt_length + trainer.online.max_new_tokens - 1
    if page_size is None:
      positions = 3 * width
    else:
      positions = 3 * -(-width // page_size) * page_size
      assert cache["num_pages"] == 3 * -(-width // page_size)
    assert (cache["slots"], cache["width"]) == (3, width)
    assert cache["bytes_per_position"] == per_position
    assert cache["positions"] == positions
    assert cache["gib"] * 2**30 == positions * per_position
    config.online.engine, config.online.engine_page_size = "lockstep", None
    assert plan_lib.engine_kv_cache(config, trainer) == {}


def test_the_engines_pool_is_online_engine_pages_and_episodes_own():
  """online.engine_pages is the pool counted; episodes (online.tools) are
  always on pages (16 positions unset), by default each of the step's
  batch x samples episodes at its longest: its opening (the prompt) and
  max_turns x max_new_tokens."""
  config = tiny_config(**ENGINE_GRPO, online__engine_page_size=5,
                       online__engine_pages=9)
  with sharding.activate(config, jax.devices()[:1]) as mesh:
    trainer = algorithms.build(config, mesh, shapes_only=True)
    cache = plan_lib.engine_kv_cache(config, trainer)
    assert (cache["num_pages"], cache["positions"]) == (9, 45)
    assert not cache["episodes"]
    # The same step's rollout as episodes of the stateless tool loop
    # (the count reads the config: the trainer's shapes are the same).
    config.online.tools, config.online.max_turns = "agent_envs:multiply", 3
    config.online.engine_page_size = config.online.engine_pages = None
    cache = plan_lib.engine_kv_cache(config, trainer)
    width = trainer.prompt_length + 3 * trainer.online.max_new_tokens
    assert cache["episodes"] and cache["page_size"] == 16
    assert cache["width"] == width
    assert cache["num_pages"] == 4 * 2 * -(-width // 16)
    config.online.engine_pages = 50
    assert plan_lib.engine_kv_cache(config, trainer)["num_pages"] == 50


def test_a_paged_engine_step_plans_and_says_its_pool():
  """The planned step decodes on pages (online.engine_page_size reaches
  engine.generate) and the plan prints the pool."""
  config = tiny_config(**ENGINE_GRPO, online__engine_page_size=4)
  plan = plan_lib.make_plan(config, jax.devices()[:1], topology="cpu:1")
  cache = plan["engine_kv_cache"]
  assert cache["page_size"] == 4 and cache["positions"] == (
      cache["num_pages"] * 4)
  assert (f"a pool of {cache['num_pages']:,} pages of 4"
          in plan_lib.describe(plan))
  assert cache["tpu_kernel"] is False  # CPU devices: the XLA reads


def test_a_page_size_without_the_continuous_engine_is_refused():
  from jaxrlhf import defaults  # pylint: disable=g-import-not-at-top
  config = tiny_config(**dict(ENGINE_GRPO, online__engine="lockstep"),
                       online__engine_page_size=4)
  with pytest.raises(ValueError, match="online.engine_page_size"):
    defaults.validate(config)


def _plan_command(tmp_path, *args):
  return subprocess.run(
      [sys.executable, "-m", "jaxrlhf.plan", "--config=configs/quickstart.py",
       *args], env=quiet_env(), capture_output=True, text=True, cwd=REPO)


def test_command_line_plans_on_cpu_devices_and_writes_json(tmp_path):
  out = tmp_path / "plan.json"
  result = _plan_command(tmp_path, "--topology=cpu:2", f"--out={out}",
                         *cli_args(mesh__shape="(2,1)"))
  assert result.returncode == 0, result.stderr
  assert result.stderr == ""
  assert result.stdout.startswith("Plan: sft on t5 tiny")
  plan = json.loads(out.read_text())
  assert plan["chips"] == 2 and plan["mesh"] == {"data": 2, "model": 1}
  assert plan["fits"] is None  # a CPU has no data sheet
  memory = plan["memory_gib_per_chip"]
  state = sum(plan["train_state_gib_per_chip"].values())
  assert memory["arguments"] == pytest.approx(
      state + plan["batch_gib_per_chip"], rel=1e-12)
  # 16 rows of data.targets_length target tokens, all learned from.
  assert plan["tokens_per_step"] == 16 * 16
  assert plan["flops_per_chip_per_step"] > 0
  # attention_impl 'auto' on CPU devices: the XLA attention.
  assert plan["model"]["attention_impl"] == "xla"


@pytest.mark.parametrize("args, message", [
    ((), "--topology is required"),
    (("--topology=cpu:x",), "cpu:N needs a device count"),
    (("--topology=cpu:2", "--config.mesh.shape=(4,2)"),
     "mesh.shape (4, 2) needs 8 devices but 2 are available"),
])
def test_command_line_errors_are_one_line(tmp_path, args, message):
  result = _plan_command(tmp_path, *args)
  assert result.returncode == 2
  assert result.stderr.count("\n") == 1 and message in result.stderr, (
      result.stderr)


def _has_libtpu():
  try:
    import libtpu  # pylint: disable=g-import-not-at-top,unused-import
    return True
  except ImportError:
    return False


@pytest.mark.skipif(_has_libtpu(), reason="libtpu is installed here")
def test_a_tpu_topology_without_libtpu_names_the_extra(tmp_path):
  result = _plan_command(tmp_path, "--topology=v5e:2x2")
  assert result.returncode == 2
  assert '".[tpu-plan]"' in result.stderr and result.stderr.count("\n") == 1


@pytest.mark.skipif(not _has_libtpu(), reason=(
    "libtpu is not installed: pip install -e \".[tpu-plan]\" plans for TPU "
    "topologies"))
def test_tiny_t5_plans_for_a_v5e_2x2_slice(tmp_path):
  out = tmp_path / "plan.json"
  result = _plan_command(tmp_path, "--topology=v5e:2x2", f"--out={out}",
                         *cli_args(mesh__shape="(2,2)"))
  assert result.returncode == 0, result.stderr
  plan = json.loads(out.read_text())
  assert plan["chips"] == 4 and plan["chip"]["name"] == "TPU v5e"
  assert plan["fits"] and plan["chip"]["hbm_gib"] == 16
  # A TPU lays small arrays out in padded tiles: at least the state.
  state = sum(plan["train_state_gib_per_chip"].values())
  assert plan["memory_gib_per_chip"]["arguments"] >= state
  assert plan["step_time_lower_bound_s"] == pytest.approx(
      plan["flops_per_chip_per_step"] / 197e12)


@pytest.mark.skipif(not _has_libtpu(), reason=(
    "libtpu is not installed: pip install -e \".[tpu-plan]\" plans for TPU "
    "topologies"))
def test_a_decoder_only_plan_for_tpu_chips_compiles_splash_attention(
    tmp_path):
  # attention_impl 'auto' resolves from the plan's devices (TPU chips, on
  # this CPU host): the Pallas kernel, compiled by Mosaic for the chips.
  out = tmp_path / "plan.json"
  result = _plan_command(tmp_path, "--topology=v5e:2x2", f"--out={out}",
                         "--config.mesh.shape=(4,1)",
                         "--config.model.arch=llama",
                         "--config.model.size=tiny")
  assert result.returncode == 0, result.stderr
  plan = json.loads(out.read_text())
  assert plan["model"]["attention_impl"] == "splash" and plan["fits"]


@pytest.mark.skipif(not _has_libtpu(), reason=(
    "libtpu is not installed: pip install -e \".[tpu-plan]\" plans for TPU "
    "topologies"))
def test_a_grpo_plan_for_tpu_chips_compiles_the_engines_pallas_kernel(
    tmp_path):
  """online.engine 'auto' on a bfloat16 decoder-only policy with a
  head_dim of 128: the engine's decode steps read their pages through
  JAX's Pallas TPU kernel, compiled by Mosaic for the chips (the plan
  traces for the chips' platform, not this CPU host's)."""
  out = tmp_path / "plan.json"
  result = _plan_command(
      tmp_path, "--topology=v5e:2x2", f"--out={out}",
      "--config.mesh.shape=(4,1)", "--config.pipeline.stages=",
      "--config.model.arch=llama", "--config.model.size=tiny",
      "--config.model.dtype=bfloat16", "--config.model.head_dim=128",
      "--config.algorithm=grpo",
      "--config.train.batch_size=8",
      "--config.rewards.reward_model.weight=0.0",
      "--config.rewards.gold_reward.weight=1.0",
      "--config.online.samples_per_prompt=2")
  assert result.returncode == 0, result.stderr
  plan = json.loads(out.read_text())
  assert plan["engine_kv_cache"]["tpu_kernel"] is True and plan["fits"]
  assert "read it with the TPU kernel" in result.stdout
