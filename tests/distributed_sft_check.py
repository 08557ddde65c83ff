"""Runs a tiny SFT in this process for tests/test_distributed.py.

Usage: python distributed_sft_check.py WORKDIR NUM_STEPS MESH_SHAPE
           [PROCESS_ID NUM_PROCESSES PORT]
MESH_SHAPE is like "4,2". With the last three arguments the process joins a
jax.distributed job on 127.0.0.1 (gloo CPU collectives). Prints one JSON line
with the parameter layout and a checksum of this process's parameter copy.

Faults for the tests, from the environment:
  LOST_PROCESS_TIMEOUT_S  config.train.lost_process_timeout_s.
  NO_EVALUATION=1         SFT without its evaluation (faster; training is the
                          same).
  DIE=<where>:<process>:<step>  that process kills itself (SIGKILL) where
                          `where` is "save" (as it starts saving the step)
                          or "manifest" (orbax has committed the step, its
                          manifest is not written).
"""

import json
import os
import signal
import sys

import jax

workdir, num_steps, mesh_shape = sys.argv[1], int(sys.argv[2]), sys.argv[3]
lost_process_timeout_s = int(os.environ.get("LOST_PROCESS_TIMEOUT_S", "60"))
if len(sys.argv) > 4:
  process_id, num_processes, port = map(int, sys.argv[4:7])
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  from jaxrlhf.train import peers  # noqa: E402
  peers.initialize(coordinator_address=f"127.0.0.1:{port}",
                   num_processes=num_processes, process_id=process_id,
                   lost_process_timeout_s=lost_process_timeout_s)

import flax.linen as nn  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from conftest import tiny_config  # noqa: E402
from jaxrlhf import algorithms  # noqa: E402
from jaxrlhf import sharding  # noqa: E402
from jaxrlhf.algorithms import state as state_lib  # noqa: E402
from jaxrlhf.train import checkpointing, loop  # noqa: E402

if os.environ.get("NO_EVALUATION"):
  from conftest import evaluated_by  # noqa: E402
  algorithms.REGISTRY["sft"] = evaluated_by(algorithms.get("sft"))
if os.environ.get("DIE"):
  where, process, at_step = os.environ["DIE"].split(":")
  if int(process) == jax.process_index():
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)
    if where == "save":
      real_save = checkpointing.Checkpointer.save
      checkpointing.Checkpointer.save = lambda self, step, *a: (
          die() if step == int(at_step) else real_save(self, step, *a))
    else:
      real_manifest = checkpointing.write_manifest
      checkpointing.write_manifest = lambda step_dir: (
          die() if str(step_dir).endswith(f"/{at_step}")
          else real_manifest(step_dir))

shape = tuple(int(x) for x in mesh_shape.split(","))
config = tiny_config(train__num_steps=num_steps, checkpoint__every_steps=3,
                     mesh__shape=shape,
                     train__lost_process_timeout_s=lost_process_timeout_s)
summary = loop.train(config, workdir)

# Restore the final checkpoint the way the loop does and report its layout.
mesh = sharding.create_mesh(shape, config.mesh.axis_names)
rules = sharding.as_rules(config.sharding.logical_axis_rules)
with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
  trainer = algorithms.build(config, mesh)
  ckpt = checkpointing.Checkpointer(os.path.join(workdir, "checkpoints"), 2)
  state, position = ckpt.restore(
      ckpt.latest_step(), state_lib.abstract_with_shardings(
          trainer.abstract_state, trainer.state_shardings))
  kernel = state.params["policy"]["decoder"]["layers_0"]["mlp"]["wi_0"]["kernel"]
  local = [np.asarray(s.data) for s in
           jax.tree.leaves(jax.tree.map(lambda a: a.addressable_shards[0],
                                        state.params))]
  print(json.dumps({
      "devices": jax.device_count(),
      "process": jax.process_index(),
      "step": int(state.step),
      "position": position,
      "wi_0_spec": [str(a) for a in kernel.sharding.spec],
      "wi_0_global_shape": list(kernel.shape),
      "wi_0_shard_shape": list(kernel.addressable_shards[0].data.shape),
      "checksum": float(sum(np.float64(x).sum() for x in local)),
      "gold_reward": summary.get("eval/gold_reward"),
  }), flush=True)
