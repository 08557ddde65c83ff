"""Expert parallelism: `MoeMlp` with its experts split over a mesh of 8
simulated CPU devices gives the outputs and gradients of the unsplit block
(up to the order of float32 sums), and really computes only each device's
experts.

Two SFT steps of a tiny Qwen3-MoE on a 4 x 2 mesh with the experts over
the data axis equal the same steps on one device, and `jaxrlhf.plan`
counts their exchange of tokens.

The 8-device checks run in one subprocess (this file run as a script, with
XLA_FLAGS=--xla_force_host_platform_device_count=8 set before JAX starts)
and print one line "RESULT <json>"; the reference is the same block with no
mesh, which takes the unsplit path.
"""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

# Mesh shape, axis names, the mesh axes the experts go over, experts,
# (batch, length) of the input.
CASES = {
    # Experts over the data axis, the tokens split over it too: all-gather
    # then reduce-scatter; 2 experts on each device.
    "data8": ((8, 1), "data", 16, (8, 3)),
    # 4 x 2: experts over data while the model axis splits each expert's
    # mlp dimension (left to the compiler).
    "data4_model2": ((4, 2), "data", 8, (4, 5)),
    # Experts over the model axis, one per device.
    "model4": ((2, 4), "model", 4, (2, 6)),
    # Experts over both axes; 3 x 3 tokens do not split over 8 devices:
    # padded with tokens routed to no expert.
    "both_uneven": ((4, 2), ("data", "model"), 8, (3, 3)),
}
TOP_K, MLP, EMBED = 2, 6, 5


def _collect_ragged_dots(jaxpr, found):
  """The weights' shapes of every ragged_dot_general in a (nested) jaxpr,
  and the names of the collectives."""
  from jaxrlhf import flops  # pylint: disable=g-import-not-at-top
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "ragged_dot_general" and eqn.invars[1].aval.ndim == 3:
      # (The weights' gradients contract two [rows, ...] operands.)
      found["rhs"].append(list(eqn.invars[1].aval.shape))
    if name in ("all_gather", "reduce_scatter", "psum", "psum_scatter",
                "psum_invariant"):
      found["collectives"].add(name)
    for sub in flops.sub_jaxprs(eqn.params):
      _collect_ragged_dots(sub, found)
  return found


def _check(case):
  """One case's figures: largest differences of output and gradients to
  the unsplit block, and what the split step computes."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jaxrlhf import plan as plan_lib  # pylint: disable=g-import-not-at-top
  from jaxrlhf import sharding  # pylint: disable=g-import-not-at-top
  from jaxrlhf import sharding_rules  # pylint: disable=g-import-not-at-top
  from jaxrlhf.models.layers import moe  # pylint: disable=g-import-not-at-top

  shape, axes, experts, (batch, length) = CASES[case]
  block = moe.MoeMlp(num_experts=experts, top_k=TOP_K, mlp_dim=MLP)
  kx, kc, kp = jax.random.split(jax.random.PRNGKey(len(case)), 3)
  x = jax.random.normal(kx, (batch, length, EMBED))
  probe = jax.random.normal(kc, (batch, length, EMBED))
  boxed = block.init(kp, x)["params"]
  params = nn.unbox(boxed)

  def loss(params, x):
    y, logits = block.apply({"params": params}, x)
    return (jnp.sum(y * probe) + jnp.sum(y ** 2)
            + moe.load_balancing_loss(logits, TOP_K, experts))

  def outputs(params, x):
    y, logits = block.apply({"params": params}, x)
    grads = jax.grad(loss, argnums=(0, 1))(params, x)
    return y, logits, grads

  want = jax.jit(outputs)(params, x)

  rules = sharding.experts_over(sharding_rules.STANDARD_RULES, axes)
  mesh = sharding.create_mesh(shape, ("data", "model"))
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    placed = jax.device_put(params,
                            sharding.tree_shardings(boxed, mesh, rules))
    if batch % mesh.shape["data"] == 0:
      x_in = jax.device_put(x, sharding.batch_sharding(mesh, rules, 3))
    else:
      x_in = x
    # The block initialised under the split rules is the same block.
    init_split = nn.unbox(jax.jit(block.init)(kp, x)["params"])
    got = jax.jit(outputs)(placed, x_in)
    forward = jax.make_jaxpr(
        lambda p, x: block.apply({"params": p}, x))(placed, x_in)
    forward_bytes = plan_lib.collective_bytes(forward, dict(mesh.shape))
    found = _collect_ragged_dots(
        jax.make_jaxpr(outputs)(placed, x_in).jaxpr,
        {"rhs": [], "collectives": set()})

  def diff(a, b):
    return max(float(np.max(np.abs(np.asarray(u, np.float64)
                                   - np.asarray(v, np.float64))))
               for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

  def scale(a):
    return max(float(np.max(np.abs(np.asarray(u)))) for u in
               jax.tree.leaves(a))

  wi_0 = placed["wi_0"]
  return {
      "y_diff": diff(want[0], got[0]),
      "y_scale": scale(want[0]),
      "logits_diff": diff(want[1], got[1]),
      "grad_diff": diff(want[2], got[2]),
      "grad_scale": scale(want[2]),
      "grad_names": sorted(
          "/".join(str(getattr(k, "key", k)) for k in path)
          for path, _ in jax.tree_util.tree_flatten_with_path(got[2][0])[0]),
      "init_diff": diff(params, init_split),
      "wi_0_spec": [list(a) if isinstance(a, tuple) else a
                    for a in wi_0.sharding.spec],
      "wi_0_shard": list(wi_0.addressable_shards[0].data.shape),
      "ragged_rhs": found["rhs"],
      "collectives": sorted(found["collectives"]),
      "forward_bytes": forward_bytes,
      "devices": len(mesh.devices.flat),
  }


def _data_parallel():
  """The experts whole (no expert rule) on meshes whose data axis splits the
  batch: the block's outputs and gradients against the unsplit block's, the
  rows of every forward grouped product, the collectives of the compiled
  load-balancing loss over stacked layers' logits."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jaxrlhf import sharding  # pylint: disable=g-import-not-at-top
  from jaxrlhf import sharding_rules  # pylint: disable=g-import-not-at-top
  from jaxrlhf.models.layers import moe  # pylint: disable=g-import-not-at-top

  # (An embedding of 8: fully sharded rules split it over the data axis.)
  experts, batch, length, layers, embed = 8, 8, 3, 2, 8
  block = moe.MoeMlp(num_experts=experts, top_k=TOP_K, mlp_dim=MLP)
  kx, kp, kl = jax.random.split(jax.random.PRNGKey(7), 3)
  x = jax.random.normal(kx, (batch, length, embed))
  boxed = block.init(kp, x)["params"]
  params = nn.unbox(boxed)

  def outputs(params, x):
    def loss(params, x):
      y, _ = block.apply({"params": params}, x)
      return jnp.sum(jnp.sin(y))
    return block.apply({"params": params}, x)[0], jax.grad(
        loss, argnums=(0, 1))(params, x)

  want = jax.jit(outputs)(params, x)
  logits = jax.random.normal(kl, (layers, batch, length, experts))
  mask = (jnp.arange(length) < 2).astype(jnp.float32)
  mask = jnp.broadcast_to(mask, (layers, batch, length))
  aux = lambda l, m: moe.load_balancing_loss(l, TOP_K, experts, m)
  load = lambda l, m: moe.expert_load(l, TOP_K, m)
  want_aux, want_load = float(aux(logits, mask)), np.asarray(load(logits,
                                                                   mask))
  out = {}
  for key, shape, rules in (
      ("data8", (8, 1), sharding_rules.STANDARD_RULES),
      ("fsdp4_model2", (4, 2), sharding_rules.FULLY_SHARDED_RULES)):
    mesh = sharding.create_mesh(shape, ("data", "model"))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      placed = jax.device_put(params,
                              sharding.tree_shardings(boxed, mesh, rules))
      x_in = jax.device_put(x, sharding.batch_sharding(mesh, rules, 3))
      got = jax.jit(outputs)(placed, x_in)
      rows = []
      forward = jax.make_jaxpr(
          lambda p, x: block.apply({"params": p}, x))(placed, x_in)

      def collect(jaxpr):
        from jaxrlhf import flops  # pylint: disable=g-import-not-at-top
        for eqn in jaxpr.eqns:
          if eqn.primitive.name == "ragged_dot_general":
            rows.append(eqn.invars[0].aval.shape[0])
          for sub in flops.sub_jaxprs(eqn.params):
            collect(sub)
      collect(forward.jaxpr)
      split = jax.sharding.NamedSharding(
          mesh, jax.sharding.PartitionSpec(None, "data"))
      l_in, m_in = jax.device_put(logits, split), jax.device_put(mask, split)
      hlo = jax.jit(aux).lower(l_in, m_in).compile().as_text()
      got_aux = float(jax.jit(aux)(l_in, m_in))
      got_load = np.asarray(jax.jit(load)(l_in, m_in))
    out[key] = {
        "y_diff": float(np.max(np.abs(np.asarray(want[0])
                                      - np.asarray(got[0])))),
        "grad_diff": max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                         for a, b in zip(jax.tree.leaves(want[1]),
                                         jax.tree.leaves(got[1]))),
        "rows": rows, "data": mesh.shape["data"],
        # What each all-gather of the compiled loss computes (its op name).
        "aux_gathers": [
            re.search(r'op_name="([^"]*)"', line).group(1)
            for line in hlo.splitlines()
            if re.search(r"= \S+ all-gather\(", line)],
        "aux_diff": abs(got_aux - want_aux),
        "load_diff": float(np.max(np.abs(got_load - want_load)))}
  out["copies"] = batch * length * TOP_K
  return out


def _errors():
  """The one-line errors of a split that cannot be made."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from jaxrlhf import sharding  # pylint: disable=g-import-not-at-top
  from jaxrlhf import sharding_rules  # pylint: disable=g-import-not-at-top
  from jaxrlhf.models.layers import moe  # pylint: disable=g-import-not-at-top
  x = jax.numpy.ones((8, 2, EMBED))
  out = {}
  mesh = sharding.create_mesh((8, 1), ("data", "model"))
  for key, experts, axes in (("uneven", 6, "data"), ("no_axis", 8, "expert")):
    rules = sharding.experts_over(sharding_rules.STANDARD_RULES, axes)
    try:
      with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        moe.MoeMlp(num_experts=experts, top_k=2, mlp_dim=MLP).init(
            jax.random.PRNGKey(0), x)
      out[key] = ""
    except ValueError as e:
      out[key] = str(e)
  return out


def _sft_steps(shape, rules, devices):
  """Two SFT steps of the tiny Qwen3-MoE from its seeded initialisation:
  (losses, parameters, the parameters' specs by name, the times the split
  experts' path was traced)."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from conftest import from_scratch, tiny_config, trainer_of  # pylint: disable=g-import-not-at-top
  from jaxrlhf import algorithms  # pylint: disable=g-import-not-at-top
  from jaxrlhf import sharding  # pylint: disable=g-import-not-at-top
  from jaxrlhf.models.layers import moe  # pylint: disable=g-import-not-at-top
  config = tiny_config(algorithm="sft", model__arch="qwen3_moe",
                       model__size="tiny", model__num_encoder_layers=None,
                       mesh__shape=shape, train__batch_size=8)
  config.sharding.logical_axis_rules = rules
  mesh = sharding.create_mesh(shape, config.mesh.axis_names, devices)
  traced = []
  split = moe._expert_parallel  # pylint: disable=protected-access

  def counted(*args):
    traced.append(1)
    return split(*args)

  moe._expert_parallel = counted  # pylint: disable=protected-access
  try:
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      trainer = trainer_of(from_scratch(algorithms.get("sft")), config, mesh)
      state = trainer._init(jax.random.PRNGKey(config.seed))  # pylint: disable=protected-access
      batches = trainer.train_batches(0)
      losses = []
      for _ in range(2):
        batch = sharding.global_batch(next(batches), mesh, rules)
        state, metrics = trainer.train_step(state, batch)
        losses.append(float(metrics["loss"]))
  finally:
    moe._expert_parallel = split  # pylint: disable=protected-access
  specs = {
      "/".join(str(getattr(k, "key", k)) for k in path):
          [list(a) if isinstance(a, tuple) else a for a in leaf.sharding.spec]
      for path, leaf in jax.tree_util.tree_flatten_with_path(
          state.params)[0]}
  return losses, jax.device_get(state.params), specs, len(traced)


def _training():
  """Two SFT steps on one device against a 4 x 2 mesh with the experts over
  the data axis (and each expert's mlp dimension over the model axis)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jaxrlhf import sharding  # pylint: disable=g-import-not-at-top
  from jaxrlhf import sharding_rules  # pylint: disable=g-import-not-at-top
  one = _sft_steps((1, 1), sharding_rules.STANDARD_RULES, jax.devices()[:1])
  eight = _sft_steps((4, 2), sharding.experts_over(
      sharding_rules.STANDARD_RULES, "data"), None)
  diffs = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), one[1],
                       eight[1])
  moved = jax.tree.map(lambda a: float(np.max(np.abs(a))), one[1])
  wi_0 = {k: v for k, v in eight[2].items() if k.endswith("wi_0")}
  return {"losses_one": one[0], "losses_eight": eight[0],
          "param_diff": max(jax.tree.leaves(diffs)),
          "param_scale": max(jax.tree.leaves(moved)),
          "wi_0_specs": wi_0, "traced_one": one[3], "traced_eight": eight[3]}


def _plan():
  """`jaxrlhf.plan` of a tiny Qwen3-MoE SFT step with its experts over the
  data axis of a 4 x 2 mesh."""
  import jax  # pylint: disable=g-import-not-at-top
  from conftest import tiny_config  # pylint: disable=g-import-not-at-top
  from jaxrlhf import plan as plan_lib  # pylint: disable=g-import-not-at-top
  from jaxrlhf import sharding  # pylint: disable=g-import-not-at-top
  from jaxrlhf import sharding_rules  # pylint: disable=g-import-not-at-top
  config = tiny_config(algorithm="sft", model__arch="qwen3_moe",
                       model__size="tiny", model__num_encoder_layers=None,
                       mesh__shape=(4, 2), train__batch_size=8)
  config.sharding.logical_axis_rules = sharding.experts_over(
      sharding_rules.STANDARD_RULES, "data")
  plan = plan_lib.make_plan(config, jax.devices(), topology="cpu:8")
  return {"collective_bytes": plan["collective_gib_per_chip_per_step"]
                              * plan_lib.GIB,
          "described": plan_lib.describe(plan),
          "row_length": config.data.inputs_length + config.data.targets_length,
          "layers": config.model.num_decoder_layers}


def main():
  import jax  # pylint: disable=g-import-not-at-top
  assert len(jax.devices()) == 8, jax.devices()
  result = {case: _check(case) for case in CASES}
  result["errors"] = _errors()
  result["data_parallel"] = _data_parallel()
  result["training"] = _training()
  result["plan"] = _plan()
  print("RESULT " + json.dumps(result), flush=True)


@pytest.fixture(scope="module")
def result():
  from conftest import REPO, quiet_env  # pylint: disable=g-import-not-at-top
  proc = subprocess.run(
      [sys.executable, os.path.abspath(__file__)],
      env=quiet_env(XLA_FLAGS="--xla_force_host_platform_device_count=8"),
      cwd=REPO, capture_output=True, text=True, timeout=900)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  assert proc.returncode == 0 and lines, (proc.stdout[-3000:]
                                          + proc.stderr[-3000:])
  return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("case", sorted(CASES))
def test_split_experts_equal_the_unsplit_block(result, case):
  r = result[case]
  assert r["devices"] == 8
  # float32 sums in another order: differences at rounding level.
  assert r["y_diff"] <= 1e-5 * max(1.0, r["y_scale"]), r
  assert r["logits_diff"] <= 1e-5, r
  assert r["grad_diff"] <= 1e-5 * max(1.0, r["grad_scale"]), r
  assert r["init_diff"] == 0.0
  # Every parameter has its gradient (the input's is in grad_diff).
  assert r["grad_names"] == ["router/kernel", "wi_0", "wi_1", "wo"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_device_holds_and_computes_only_its_experts(result, case):
  r = result[case]
  shape, axes, experts, _ = CASES[case]
  names = axes if isinstance(axes, tuple) else (axes,)
  ways = 1
  for a in names:
    ways *= shape[("data", "model").index(a)]
  expected_spec = list(names) if len(names) > 1 else names[0]
  assert r["wi_0_spec"][0] == expected_spec
  assert r["wi_0_shard"][0] == experts // ways
  # Every grouped product (forward and backward) runs on the device's own
  # experts' weights only.
  assert r["ragged_rhs"] and all(s[0] == experts // ways
                                 for s in r["ragged_rhs"]), r["ragged_rhs"]
  # Tokens gathered to the experts' devices, outputs scattered back.
  assert {"all_gather", "reduce_scatter"} <= set(r["collectives"]), r
  # The plan's count of the forward's traffic per device, by hand: rings
  # over D devices move (D-1)/D of the gathered tokens [T, embed], their
  # routing weights and expert ids [T, top_k] (4 bytes each) and of the
  # partial outputs [T, embed] reduce-scattered; T padded to a multiple of D.
  batch, length = CASES[case][3]
  tokens = -(-batch * length // ways) * ways
  expected = (ways - 1) / ways * 4 * tokens * (2 * EMBED + 2 * TOP_K)
  assert r["forward_bytes"] == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("case", ["data8", "fsdp4_model2"])
def test_whole_experts_compute_each_devices_own_tokens(result, case):
  """With the batch split over D data devices and the experts whole, each
  device sorts and multiplies only its own tokens' copies: every forward
  grouped product has 1/D of the batch's (token, expert) copies as rows
  (the whole batch's, gathered to every device, before); the same outputs
  and gradients as the unsplit block."""
  r = result["data_parallel"][case]
  copies = result["data_parallel"]["copies"]
  assert r["rows"] and all(n == copies // r["data"] for n in r["rows"]), r
  assert r["y_diff"] <= 1e-5 and r["grad_diff"] <= 1e-5, r


@pytest.mark.parametrize("case", ["data8", "fsdp4_model2"])
def test_router_losses_keep_the_batch_split(result, case):
  """The load-balancing loss over [layers, batch, length, experts] logits
  split over the batch: per-device sums reduced, the softmax and its sums
  on each device's own logits (gathered whole for them, when the token
  axes were flattened: reduce_max, exp, ... gathers); the unsplit values.
  (The CPU's top_k gathers its operand, the TPU's does not: it is let be.)"""
  r = result["data_parallel"][case]
  assert all(name.endswith("/top_k") for name in r["aux_gathers"]), r
  assert r["aux_diff"] <= 1e-5 and r["load_diff"] <= 1e-6, r


def test_splits_that_cannot_be_made_say_how_to_fix_them(result):
  errors = result["errors"]
  assert "num_experts=6" in errors["uneven"]
  assert "8 devices" in errors["uneven"]
  assert "lacks" in errors["no_axis"] and "'expert'" in errors["no_axis"]


def test_sft_steps_with_split_experts_equal_one_device(result):
  """A tiny Qwen3-MoE's two SFT steps: the same losses and parameters."""
  r = result["training"]
  # The (one) layer's 4 experts split over data, one per data shard.
  assert r["wi_0_specs"] and all(
      s == ["data", None, "model"] for s in r["wi_0_specs"].values()), r
  assert r["traced_one"] == 0 and r["traced_eight"] > 0
  np.testing.assert_allclose(r["losses_eight"], r["losses_one"], rtol=1e-5)
  assert r["losses_one"][1] != r["losses_one"][0]
  assert r["param_diff"] <= 1e-5 * r["param_scale"], r


def test_the_plan_counts_the_split_experts_exchange(result):
  """Per MoE layer and device, rings over the D = 4 data devices move
  (D-1)/D of: forward, the gathered tokens [T, embed], routing weights and
  expert ids [T, top_k] and the reduce-scattered outputs [T, embed];
  backward, the gathered output gradient [T, embed] and the
  reduce-scattered gradients of the tokens [T, embed] and of the routing
  weights [T, top_k]; 4 bytes each, T = 8 rows of the decoder's length
  (the tiny Qwen3-MoE: top 2, embed 32)."""
  r = result["plan"]
  tokens, embed, top_k, ways = 8 * r["row_length"], 32, 2, 4
  per_layer = (ways - 1) / ways * 4 * tokens * (
      (2 * embed + 2 * top_k) + (2 * embed + top_k))
  assert r["collective_bytes"] == pytest.approx(r["layers"] * per_layer,
                                                rel=1e-9)
  assert "collectives per chip and step" in r["described"]


def test_experts_over_puts_the_expert_rule_first():
  """Under fully sharded rules `embed` takes the data axis; the expert rule
  must come first for the expert weights to split over it instead."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from jaxrlhf import sharding  # pylint: disable=g-import-not-at-top
  from jaxrlhf import sharding_rules  # pylint: disable=g-import-not-at-top
  rules = sharding.experts_over(sharding_rules.FULLY_SHARDED_RULES, "data")
  assert rules[0] == ("expert", "data")
  assert [r for r in rules if r[0] == "expert"] == [("expert", "data")]
  spec = nn.logical_to_mesh_axes(("expert", "embed", "mlp"), rules)
  assert tuple(spec) == ("data", None, "model")
  # The dense weights keep the fully sharded plan.
  assert tuple(nn.logical_to_mesh_axes(("embed", "mlp"), rules)) == (
      "data", "model")
  assert sharding.experts_over(sharding_rules.STANDARD_RULES,
                               ["data", "model"])[0] == ("expert",
                                                         ("data", "model"))


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  main()
