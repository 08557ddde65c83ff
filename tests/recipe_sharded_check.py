"""Three train steps of an offline algorithm; for tests/test_recipes_sharded.py.

Usage: python recipe_sharded_check.py ALGORITHM DATA_FILE MESH_SHAPE
Prints one JSON line: the per-step losses and the policy's parameter sum.
The networks start from a seeded random initialisation (no checkpoint), so
the run depends only on the mesh.
"""

import json
import os
import sys

import flax.linen as nn
import jax
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from conftest import from_scratch, tiny_config, trainer_of  # noqa: E402
from jaxrlhf import algorithms  # noqa: E402
from jaxrlhf import sharding  # noqa: E402

algorithm, data_file, mesh_shape = sys.argv[1:4]
shape = tuple(int(x) for x in mesh_shape.split(","))
config = tiny_config(algorithm=algorithm, data__task=f"sharded_{algorithm}",
                     mesh__shape=shape, train__batch_size=8)
config.data.files.train = data_file
mesh = sharding.create_mesh(shape, config.mesh.axis_names)
rules = sharding.as_rules(config.sharding.logical_axis_rules)
with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
  trainer = trainer_of(from_scratch(algorithms.get(algorithm)), config, mesh)
  state = trainer.init_state()
  batches = trainer.train_batches(0)
  losses = []
  for _ in range(3):
    batch = sharding.global_batch(next(batches), mesh, rules)
    state, metrics = trainer.train_step(state, batch)
    losses.append(float(metrics["loss"]))
  kernel = state.params["policy"]["encoder"]["layers_0"]["mlp"]["wi_0"]["kernel"]
  print(json.dumps({
      "losses": losses,
      "policy_sum": float(sum(np.float64(np.asarray(x)).sum()
                              for x in jax.tree.leaves(state.params["policy"]))),
      "kernel_spec": [str(a) for a in kernel.sharding.spec],
  }))
