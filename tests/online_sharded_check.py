"""Three PPO iterations from random networks; for tests/test_online_sharded.py.

Usage: python online_sharded_check.py MESH_SHAPE [NUM_MICROBATCHES]
Prints one JSON line: per-step metrics, the parameters' sum, and the error a
config with micro-batches of 2 responses gives (only on several data
shards, where 2 does not split evenly). Sampling,
scoring and the scan of minibatch updates all run under the mesh, so the
numbers depend on nothing but the mesh.
"""

import json
import os
import sys

import flax.linen as nn
import jax
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from conftest import tiny_config  # noqa: E402
from jaxrlhf import algorithms  # noqa: E402
from jaxrlhf import sharding  # noqa: E402

shape = tuple(int(x) for x in sys.argv[1].split(","))
micro = int(sys.argv[2]) if len(sys.argv) > 2 else 1


def ppo_config(batch_size, num_microbatches):
  # No checkpoint is read: the networks are the seeded random initialisation.
  return tiny_config(algorithm="ppo", mesh__shape=shape,
                     train__batch_size=batch_size,
                     train__num_microbatches=num_microbatches,
                     init__policy_checkpoint="unused",
                     online__reward_model_checkpoint="unused",
                     online__num_epochs=2, online__num_minibatches=2,
                     optimizer__warmup_steps=0)


config = ppo_config(16, micro)
mesh = sharding.create_mesh(shape, config.mesh.axis_names)
rules = sharding.as_rules(config.sharding.logical_axis_rules)

with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
  uneven_error = None
  if shape[0] > 2:  # 8 responses / 2 minibatches / 2 micro-batches = 2 rows
    try:
      algorithms.build(ppo_config(8, 2), mesh)
    except ValueError as e:
      uneven_error = str(e)
  trainer = algorithms.build(config, mesh)
  state = trainer._init(jax.random.PRNGKey(config.seed))  # pylint: disable=protected-access
  batches = trainer.train_batches(0)
  steps = []
  for _ in range(3):
    batch = sharding.global_batch(next(batches), mesh, rules)
    state, metrics = trainer.train_step(state, batch)
    steps.append({k: float(metrics[k]) for k in (
        "loss", "value_loss", "score", "kl", "response_length",
        "clip_fraction")})
  kernel = state.params["policy"]["encoder"]["layers_0"]["mlp"]["wi_0"]["kernel"]
  print(json.dumps({
      "steps": steps,
      "params_sum": float(sum(np.float64(np.asarray(x)).sum()
                              for x in jax.tree.leaves(state.params))),
      "kernel_spec": [str(s) for s in kernel.sharding.spec],
      "kernel_shards": len({s.device for s in kernel.addressable_shards}),
      "uneven_error": uneven_error,
  }))
