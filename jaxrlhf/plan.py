r"""An ahead-of-time plan of a config's train step on a slice you do not have.

  pip install -e ".[tpu-plan]"    # libtpu: compiles for TPU topologies on a CPU host
  python -m jaxrlhf.plan --config=configs/dro_t5xl.py --topology=v5e:4x8
  python -m jaxrlhf.plan --config=configs/quickstart.py --topology=cpu:8 \
      --config.train.num_microbatches=2 --out=/tmp/plan.json

Builds the config's real train step (every algorithm; an online step's
rollout and updates included) over abstract state and batch: no parameter
is materialised and no data, vocabulary or checkpoint is read (shapes come
from the config; a model whose vocabulary is in a file gets
config.model.vocab_size or its size preset's, a built-in task its word
list's size, and batches the layout of their data kind's feature converter:
`jaxrlhf.data.shapes`), so TensorFlow and seqio are not loaded (except for
a task only its seqio registration describes). The step is compiled by XLA
for the topology's chips, as it would be on them, and the plan says:

  - memory per chip, XLA's figures: arguments (the train state and the
    batch) + outputs - what the outputs alias (the donated state) +
    temporaries (activations, gradients, optimizer updates) + code, against
    the chip's HBM, and whether it fits with --headroom_gib to spare; with
    the train state's own share (trained parameters, optimizer state, frozen
    networks), counted from its shapes and shardings;
  - FLOPs per chip and step: the matmuls of the step's jaxpr, loops counted
    by their trip count (`jaxrlhf.flops`; XLA's own count, which counts a
    scanned layer or micro-batch once, is given beside it), the tokens a
    step learns from, and the lower bound on the step time at the chip's
    peak bf16 FLOP/s (`jaxrlhf.accelerators`: the data sheets);
  - the traffic of the collectives the step states itself (inside
    `jax.shard_map`: a mixture-of-experts block's gathers and scatters
    when its experts are split, `jaxrlhf.models.layers.moe`), in bytes per
    chip and step, loops by their trip count; those XLA adds for the
    logical-axis shardings are not counted. Expert weights, like every
    parameter, count in the train state at each chip's share;
  - for an online step decoding with the continuous engine
    (`online.engine` 'continuous', or 'auto' where it resolves to it,
    `online.options.decoding`), the KV cache its engine holds per
    rollout part: slots x (prompt + budget - 1) positions of contiguous
    rows, or on pages (`online.engine_page_size`; 'auto': 16) the page
    pool (`online.engine_pages`, or the engine's default, slots x the pages of
    those positions; episodes: always pages, by default the step's
    episodes x the pages of the longest episode, held outside the compiled
    step), x the bytes of a position (layers x kv heads x head_dim x 2
    (keys, values) x the cache dtype's bytes, from the policy's cache
    shapes); XLA's memory figures hold a single-turn step's among the
    temporaries; and whether its decode steps read the pages with JAX's
    Pallas TPU kernel (traced for the chips' platform:
    `paged_attention.compiled_for`);
  - for a step that does not fit, a one-line suggestion.

Topologies: `cpu:N` (N simulated CPU devices, what the tests plan on) or a
TPU slice as libtpu names it: `v5e:4x8`, `v5e:2x2`, `v6e:4x8`,
`v5p:2x2x2`, `v4:2x2x1`. `config.mesh.shape` must fit its chips.
"""

import dataclasses
import json
import math
import os
import re
import sys
import time
from typing import Any, Dict

from absl import app
from absl import flags

from jaxrlhf import cli

_TOPOLOGY = flags.DEFINE_string(
    "topology", None, "Device topology to compile for: cpu:N or a TPU slice "
    "such as v5e:4x8; required.")
_HEADROOM = flags.DEFINE_float(
    "headroom_gib", 2.0, "Memory per chip that must stay free for the step "
    "to count as fitting (GiB).")
_OUT = flags.DEFINE_string("out", None,
                           "Also write the plan to this JSON file.")
_OUR_FLAGS = ("config", "topology", "headroom_gib", "out")

GIB = 2**30


class PlanError(ValueError):
  """A topology that cannot be planned for here (one line)."""


def prepare_platform(topology: str) -> None:
  """Environment for JAX before it starts: the host is the CPU, with N
  devices for `cpu:N`; libtpu is only asked to describe a topology, so its
  probing for local TPU chips and hosts is told there are none."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if "jax" in sys.modules:
    sys.modules["jax"].config.update("jax_platforms",
                                     os.environ["JAX_PLATFORMS"])
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  # No chip is opened: several plans may run at once.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  if topology.startswith("cpu:"):
    count = topology.split(":", 1)[1]
    flag = f"--xla_force_host_platform_device_count={count}"
    # Read when JAX starts its CPU backend (the config file may have
    # imported jax already; no computation has run).
    if flag not in os.environ.get("XLA_FLAGS", ""):
      os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " "
                                 + flag).strip()


def topology_devices(topology: str):
  """The devices of `topology` ("cpu:8", "v5e:4x8", ...)."""
  import jax  # pylint: disable=g-import-not-at-top
  if topology.startswith("cpu:"):
    try:
      count = int(topology.split(":", 1)[1])
    except ValueError:
      count = 0
    if count < 1:
      raise PlanError(f"--topology={topology}: cpu:N needs a device count "
                      "N >= 1, e.g. cpu:8.")
    devices = jax.devices("cpu")
    if len(devices) < count:
      raise PlanError(
          f"--topology={topology}: this process has {len(devices)} CPU "
          f"devices; start it with XLA_FLAGS=--xla_force_host_platform_"
          f"device_count={count} (python -m jaxrlhf.plan sets it itself).")
    return devices[:count]
  try:
    import libtpu  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    raise PlanError(
        f"--topology={topology}: planning for a TPU needs libtpu, which "
        "this machine lacks; install it with pip install -e \".[tpu-plan]\" "
        "(or plan on cpu:N).") from None
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  try:
    return topologies.get_topology_desc(platform="tpu",
                                        topology_name=topology).devices
  except Exception as e:  # pylint: disable=broad-except
    detail = str(e).strip().splitlines()
    raise PlanError(
        f"--topology={topology}: libtpu could not describe it "
        f"({detail[0] if detail else type(e).__name__}); TPU slices are "
        "named as v5e:4x8, v6e:2x4, v5p:2x2x2 or v4:2x2x1.") from None


def _per_chip_bytes(abstract, shardings) -> int:
  """Bytes one chip holds of a tree of arrays placed by `shardings`: each
  array's shard (the largest, when a dimension does not split evenly)."""
  import jax  # pylint: disable=g-import-not-at-top
  total = 0
  for leaf, sharding in zip(jax.tree.leaves(abstract),
                            jax.tree.leaves(shardings)):
    mesh_shape = dict(sharding.mesh.shape)
    shard = list(leaf.shape)
    for dim, axes in enumerate(sharding.spec):
      if axes is None:
        continue
      axes = axes if isinstance(axes, tuple) else (axes,)
      ways = math.prod(mesh_shape[a] for a in axes)
      shard[dim] = -(-shard[dim] // ways)
    total += math.prod(shard) * leaf.dtype.itemsize
  return total


def states_primitive(jaxpr, name: str) -> bool:
  """Whether a (closed) jaxpr, or one inside it, states primitive
  `name`."""
  from jaxrlhf import flops  # pylint: disable=g-import-not-at-top
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  return any(eqn.primitive.name == name
             or any(states_primitive(sub, name)
                    for sub in flops.sub_jaxprs(eqn.params))
             for eqn in jaxpr.eqns)


def collective_bytes(jaxpr, axis_sizes: Dict[str, int]) -> float:
  """Bytes one device sends or receives in the collectives a (closed)
  jaxpr states (within `jax.shard_map`), as ring algorithms move them
  over D devices: an all-gather receives (D-1)/D of its output, a
  reduce-scatter and an all-to-all send (D-1)/D of their input, a psum
  both (2 (D-1)/D of it); a ragged all-to-all is counted at its whole input.
  Loops count by their trip count (`flops.while_trip_bound` for a while),
  a cond by its costlier branch. axis_sizes: mesh axis name -> size.
  """
  from jaxrlhf import flops  # pylint: disable=g-import-not-at-top
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  factor = {"all_gather": ("out", 1), "reduce_scatter": ("in", 1),
            "all_to_all": ("in", 1), "psum": ("in", 2),
            "psum_invariant": ("in", 2), "ragged_all_to_all": ("in", None)}
  total = 0.0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    params = eqn.params
    if name in factor:
      side, times = factor[name]
      avals = [v.aval for v in (eqn.outvars if side == "out" else
                                eqn.invars) if hasattr(v.aval, "shape")]
      size = sum(math.prod(a.shape) * a.dtype.itemsize for a in avals)
      axes = params.get("axis_name", params.get("axes", ()))
      axes = axes if isinstance(axes, (tuple, list)) else (axes,)
      ways = params.get("axis_size") or math.prod(
          axis_sizes.get(a, 1) for a in axes)
      total += size if times is None else times * size * (ways - 1) / ways
    elif name == "scan":
      total += params["length"] * collective_bytes(params["jaxpr"],
                                                   axis_sizes)
    elif name == "cond":
      total += max(collective_bytes(b, axis_sizes)
                   for b in params["branches"])
    elif name == "while":
      trips = flops.while_trip_bound(eqn) or 1
      total += trips * collective_bytes(params["body_jaxpr"], axis_sizes)
    else:
      total += sum(collective_bytes(sub, axis_sizes)
                   for sub in flops.sub_jaxprs(params))
  return total


def _compile_error_figures(error: Exception) -> Dict[str, float]:
  """What XLA said when the step did not fit ("Used 19.30G of 15.75G hbm",
  or "HLO temporaries (44.87G) exceeds available HBM (15.75G)"), in GiB."""
  text = str(error)
  scale = {"K": 2**-20, "M": 2**-10, "G": 1.0, "T": 2**10}
  for pattern, name in (
      (r"Used ([\d.]+)([KMGT]) of ([\d.]+)([KMGT]) hbm", "total"),
      (r"temporaries \(([\d.]+)([KMGT])\) exceeds available HBM "
       r"\(([\d.]+)([KMGT])\)", "temporaries")):
    found = re.search(pattern, text)
    if found:
      return {name: float(found.group(1)) * scale[found.group(2)],
              "usable_hbm": float(found.group(3)) * scale[found.group(4)]}
  return {}


def engine_kv_cache(config, trainer) -> Dict[str, Any]:
  """The KV cache of `trainer`'s continuous engine in one rollout part
  (see the module docstring), or {} when the step does not decode with
  the engine."""
  import jax  # pylint: disable=g-import-not-at-top
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from jaxrlhf.models import engine  # pylint: disable=g-import-not-at-top
  from jaxrlhf.models.layers import paged_kv  # pylint: disable=g-import-not-at-top

  from jaxrlhf.algorithms.online import options  # pylint: disable=g-import-not-at-top

  if not trainer.algorithm.online:
    return {}
  decoder, page_size = options.decoding(config)
  if decoder != "continuous":
    return {}
  o = config.online
  settings = trainer.online
  rows = (config.train.batch_size // o.rollout_microbatches
          * settings.samples_per_prompt)
  episodes = bool(o.environment or o.tools)
  if episodes:  # agents.continuous: always on pages, the step's episodes
    from jaxrlhf.algorithms.online import episode_step  # pylint: disable=g-import-not-at-top
    lim = episode_step.limits(config, trainer.prompt_length,
                              settings.max_new_tokens)
    slots = o.engine_slots or engine.default_slots(rows)
    width = lim.max_opening_tokens + lim.max_episode_tokens
    default = paged_kv.default_num_pages(rows, width, page_size)
  else:
    slots = o.engine_slots or engine.default_slots(  # as the rollout's
        rows, settings.samples_per_prompt if page_size else 1)
    width = trainer.prompt_length + settings.max_new_tokens - 1
    default = (None if page_size is None else
               paged_kv.default_num_pages(slots, width, page_size))
  if page_size is None:
    positions, num_pages = slots * width, None
  else:
    num_pages = o.engine_pages or default
    positions = num_pages * page_size
  # A position's bytes: the policy's cache as a pool of one one-position
  # page (every layer's keys and values).
  params = nn.meta.unbox(trainer.abstract_state.params["policy"])
  pool = jax.eval_shape(lambda p: paged_kv.make_pool(
      trainer.lm.module, p, 1, 1), params)
  per_position = sum(x.size * x.dtype.itemsize
                     for x in jax.tree.leaves(pool))
  return {"slots": slots, "width": width, "page_size": page_size,
          "num_pages": num_pages, "positions": positions,
          "episodes": episodes,
          "bytes_per_position": per_position,
          "gib": positions * per_position / GIB}


def suggestion(config, memory: Dict[str, float], state_gib: float,
               budget_gib: float, algorithm=None) -> str:
  """One line on what to change when the step does not fit `budget_gib`
  (`algorithm`, when given: an online step's rollout is split by
  online.rollout_microbatches, not by micro-batches; an algorithm that
  estimates a statistic from the whole batch refuses micro-batches)."""
  if state_gib > budget_gib * 0.6:
    return (f"the train state alone takes {state_gib:.1f} GiB per chip: use "
            "a larger slice, or shard it over more chips (a larger model "
            "axis in config.mesh.shape).")
  online = algorithm is not None and algorithm.online
  tips = []
  if config.model.remat_policy != "full":
    tips.append("--config.model.remat_policy=full (recompute each layer's "
                "activations in the backward pass)")
  if (algorithm is None
      or not algorithm.training.whole_batch_statistic(config)):
    micro = config.train.num_microbatches
    tips.append(f"--config.train.num_microbatches={2 * micro} (activations "
                "of half as many rows at a time" + (
                    "; the updates only, not the rollout" if online else "")
                + ")")
  if online:
    parts = config.online.rollout_microbatches
    tips.append(f"--config.online.rollout_microbatches={2 * parts} (sample "
                "and score half as many prompts at a time)")
  shape = tuple(config.mesh.shape)
  if len(shape) == 2 and shape[0] > 1 and shape[0] % 2 == 0:
    tips.append(f"--config.mesh.shape=\"({shape[0] // 2},{shape[1] * 2})\" "
                "(split activations over more model shards)")
  total = memory.get("total", memory.get("temporaries", 0.0) + state_gib)
  over = total - budget_gib
  return (f"{over:.2f} GiB over the budget, mostly activations and "
          f"gradients: try {'; or '.join(tips)}.")


def make_plan(config, devices, *, headroom_gib: float = 2.0,
              topology: str = "") -> Dict[str, Any]:
  """The plan of `config`'s train step on `devices` (see the module
  docstring), as a JSON-able dict."""
  import jax  # pylint: disable=g-import-not-at-top
  from jaxrlhf import accelerators  # pylint: disable=g-import-not-at-top
  from jaxrlhf import algorithms  # pylint: disable=g-import-not-at-top
  from jaxrlhf import defaults  # pylint: disable=g-import-not-at-top
  from jaxrlhf import flops  # pylint: disable=g-import-not-at-top
  from jaxrlhf import sharding  # pylint: disable=g-import-not-at-top
  from jaxrlhf.algorithms import state as state_lib  # pylint: disable=g-import-not-at-top
  from jaxrlhf.models.layers import paged_attention  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  defaults.validate(config)
  chips = len(devices)
  # Paged reads as the chips read them (the TPU kernel on TPU chips).
  with sharding.activate(config, devices) as mesh, \
      paged_attention.compiled_for(devices[0].platform):
    trainer = algorithms.build(config, mesh, shapes_only=True)
    state = state_lib.abstract_with_shardings(trainer.abstract_state,
                                              trainer.state_shardings)
    batch = trainer.batch_spec()
    batch_shardings = {k: sharding.batch_sharding(mesh, trainer.rules,
                                                  len(v.shape))
                       for k, v in batch.items()}
    # A step split around the host (host rewards) or between sampler and
    # training devices is planned as its device work in one function.
    step = getattr(trainer.train_step, "fused", trainer.train_step)
    jaxpr = (step.trace(state, batch).jaxpr if hasattr(step, "trace")
             else jax.make_jaxpr(step)(state, batch))
    step_flops = flops.jaxpr_flops(jaxpr)
    exchange = collective_bytes(jaxpr, dict(mesh.shape))
    start = time.perf_counter()
    compile_error = None
    try:
      compiled = step.lower(state, batch).compile()
    except Exception as e:  # pylint: disable=broad-except
      if "RESOURCE_EXHAUSTED" not in str(e) and "hbm" not in str(e):
        raise
      compiled, compile_error = None, e
    compile_s = time.perf_counter() - start

    engine_cache = engine_kv_cache(config, trainer)
    if engine_cache and not engine_cache["episodes"]:
      # Whether its decode steps read the pages with the TPU kernel.
      engine_cache["tpu_kernel"] = states_primitive(jaxpr, "pallas_call")

  shardings = trainer.state_shardings
  abstract = trainer.abstract_state
  state_gib = {
      "trained_parameters": _per_chip_bytes(abstract.params,
                                            shardings.params) / GIB,
      "optimizer_state": _per_chip_bytes(abstract.opt_state,
                                         shardings.opt_state) / GIB,
      "frozen_networks": _per_chip_bytes(abstract.frozen,
                                         shardings.frozen) / GIB,
      "step_rng_and_algorithm_state": _per_chip_bytes(
          (abstract.step, abstract.rng, abstract.algorithm_state),
          (shardings.step, shardings.rng, shardings.algorithm_state)) / GIB,
  }
  batch_gib = _per_chip_bytes(batch, batch_shardings) / GIB
  if compiled is not None:
    stats = compiled.memory_analysis()
    memory = {
        "arguments": stats.argument_size_in_bytes / GIB,
        "outputs": stats.output_size_in_bytes / GIB,
        "aliased": stats.alias_size_in_bytes / GIB,
        "temporaries": stats.temp_size_in_bytes / GIB,
        "code": stats.generated_code_size_in_bytes / GIB,
    }
    memory["total"] = (memory["arguments"] + memory["outputs"]
                       - memory["aliased"] + memory["temporaries"]
                       + memory["code"])
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
      cost = cost[0] if cost else {}
    xla_flops = float((cost or {}).get("flops", 0.0))
  else:
    memory = _compile_error_figures(compile_error)
    xla_flops = None

  chip = accelerators.chip(devices[0].device_kind)
  ones = {k: np.ones(v.shape, v.dtype) for k, v in batch.items()}
  tokens = trainer.tokens_in(ones) // jax.process_count()
  flops_per_chip = step_flops / chips
  model = {k: config.model[k] for k in (
      "arch", "size", "dtype", "remat_policy", "scan_layers")}
  # The kernel the step compiled with ('auto' resolved).
  model["attention_impl"] = getattr(trainer.model_config, "attention_impl",
                                    "xla")
  plan = {
      "algorithm": config.algorithm,
      "model": model,
      "topology": topology,
      "device_kind": devices[0].device_kind,
      "chips": chips,
      "mesh": dict(mesh.shape),
      "batch_size": config.train.batch_size,
      "num_microbatches": config.train.num_microbatches,
      "lengths": {"inputs": config.data.inputs_length,
                  "targets": config.data.targets_length},
      "tokens_per_step": int(tokens),
      "memory_gib_per_chip": memory,
      "train_state_gib_per_chip": state_gib,
      "batch_gib_per_chip": batch_gib,
      "flops_per_chip_per_step": flops_per_chip,
      "xla_flops_per_chip_per_step": xla_flops,
      "collective_gib_per_chip_per_step": exchange / GIB,
      "compile_seconds": round(compile_s, 1),
  }
  if engine_cache:
    plan["engine_kv_cache"] = engine_cache
  if compile_error is not None:
    plan["compile_error"] = str(compile_error).strip().splitlines()[0]
  if chip is not None:
    budget = chip.hbm_gib - headroom_gib
    total = memory.get("total")
    plan.update({
        "chip": dataclasses.asdict(chip),
        "required_headroom_gib": headroom_gib,
        "headroom_gib": None if total is None else chip.hbm_gib - total,
        "fits": (compile_error is None and total is not None
                 and total <= budget),
        "step_time_lower_bound_s": flops_per_chip / (
            chip.peak_bf16_tflops * 1e12),
    })
    if not plan["fits"]:
      plan["suggestion"] = suggestion(config, memory,
                                      sum(state_gib.values()), budget,
                                      trainer.algorithm)
  else:
    plan.update({"chip": None, "fits": None})
  return plan


def _gib(value: float) -> str:
  """A GiB figure in the unit that shows it (tiny test models included)."""
  if value >= 0.1:
    return f"{value:.2f} GiB"
  if value * 1024 >= 0.1:
    return f"{value * 1024:.1f} MiB"
  return f"{value * 2**20:.1f} KiB"


def _flop(value: float) -> str:
  for scale, unit in ((1e15, "PFLOP"), (1e12, "TFLOP"), (1e9, "GFLOP")):
    if value >= scale:
      return f"{value / scale:.2f} {unit}"
  return f"{value / 1e6:.2f} MFLOP"


def describe(plan: Dict[str, Any]) -> str:
  """The plan as the lines the command prints."""
  m = plan["memory_gib_per_chip"]
  s = plan["train_state_gib_per_chip"]
  chip = plan["chip"]
  mesh = " x ".join(f"{n} {a}" for a, n in plan["mesh"].items())
  model = plan["model"]
  lines = [
      f"Plan: {plan['algorithm']} on {model['arch']} {model['size']} "
      f"({model['dtype']}, remat {model['remat_policy']}, scan_layers "
      f"{model['scan_layers']}, attention "
      f"{model.get('attention_impl', 'xla')}), {plan['topology']}: "
      f"{plan['chips']} x "
      f"{plan['device_kind']}, mesh {mesh}; batch {plan['batch_size']} in "
      f"{plan['num_microbatches']} micro-batch(es), "
      f"{plan['tokens_per_step']:,} tokens per step.",
  ]
  if "compile_error" in plan:
    lines.append(f"  XLA could not fit the step: {plan['compile_error']}")
  if "arguments" in m:
    lines.append(
        f"  memory per chip: {_gib(m['total'])} = arguments "
        f"{_gib(m['arguments'])} + outputs {_gib(m['outputs'])} - aliased "
        f"{_gib(m['aliased'])} + temporaries {_gib(m['temporaries'])} + "
        f"code {_gib(m['code'])}")
  lines.append(
      f"  train state per chip: {_gib(sum(s.values()))} (trained parameters "
      f"{_gib(s['trained_parameters'])}, optimizer "
      f"{_gib(s['optimizer_state'])}, frozen networks "
      f"{_gib(s['frozen_networks'])}); batch "
      f"{_gib(plan['batch_gib_per_chip'])}")
  xla = plan["xla_flops_per_chip_per_step"]
  lines.append(
      f"  FLOPs per chip and step: {_flop(plan['flops_per_chip_per_step'])} "
      "(matmuls, loops by trip count"
      + (f"; XLA counts {_flop(xla)}, each loop body once" if xla else "")
      + ")")
  cache = plan.get("engine_kv_cache")
  if cache:
    pool = ("contiguous rows" if cache["page_size"] is None else
            f"a pool of {cache['num_pages']:,} pages of "
            f"{cache['page_size']}")
    where = ("held beside the step, which the episodes' turns run "
             "outside" if cache["episodes"] else "among the temporaries")
    if cache.get("tpu_kernel"):
      where += "; decode steps read it with the TPU kernel"
    lines.append(
        f"  engine KV cache per rollout part: {_gib(cache['gib'])} "
        f"({cache['slots']} slots x {cache['width']} positions as {pool}: "
        f"{cache['positions']:,} positions x "
        f"{cache['bytes_per_position']:,} bytes; {where})")
  exchange = plan.get("collective_gib_per_chip_per_step")
  if exchange:
    lines.append(f"  collectives per chip and step: {_gib(exchange)} (the "
                 "step's own, e.g. split experts' token exchange)")
  if chip:
    bound = plan["step_time_lower_bound_s"]
    lines.append(
        f"  {chip['name']}: {chip['hbm_gib']} GiB HBM, "
        f"{chip['peak_bf16_tflops']} TFLOP/s bf16 peak: step time >= "
        + (f"{bound:.3f} s" if bound >= 0.1 else f"{bound * 1e3:.3f} ms"))
    if plan["fits"]:
      lines.append(f"  Fits, with {plan['headroom_gib']:.2f} GiB to spare "
                   f"per chip (required: {plan['required_headroom_gib']}).")
    else:
      lines.append(f"  Does not fit with {plan['required_headroom_gib']} GiB "
                   f"to spare: {plan['suggestion']}")
  else:
    lines.append("  No data sheet for this device kind: memory is not judged "
                 "against a capacity.")
  lines.append(f"  Compiled in {plan['compile_seconds']:.0f} s.")
  return "\n".join(lines)


def main(argv):
  cli.no_arguments(argv)
  config = cli.loaded_config()
  if not _TOPOLOGY.value:
    cli.fail("--topology is required, e.g. --topology=v5e:4x8 or cpu:8.")
  prepare_platform(_TOPOLOGY.value)
  from jaxrlhf import console  # pylint: disable=g-import-not-at-top
  console.silence_library_noise(python_loggers=True)
  try:
    devices = topology_devices(_TOPOLOGY.value)
    plan = make_plan(config, devices, headroom_gib=_HEADROOM.value,
                     topology=_TOPOLOGY.value)
  except ValueError as e:
    cli.fail(str(e))
  print(describe(plan), flush=True)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(plan, f, indent=1)
      f.write("\n")
    print(f"  written to {_OUT.value}")


def run():
  app.run(main, flags_parser=cli.flags_parser(
      lambda: cli.usage(__doc__, _OUR_FLAGS)))


if __name__ == "__main__":
  run()
