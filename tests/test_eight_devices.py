"""The same computations on one device and on a 4x2 mesh of 8 simulated
devices give the same numbers, with parameters and activations split as the
logical-axis rules say.

tests/eight_devices.py runs every check in one subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (the flag must be set
before JAX starts), comparing against one of its own devices: models loaded
with `from_pretrained` (logits, greedy KV-cache decodes), DPO and DRO-V
train steps, PPO iterations with and without micro-batches, GRPO with its
rollouts on 4 sampler devices (on-policy and one step ahead), and a run of
the training loop; and the ahead-of-time plan of a step against the real
state and batch on a device.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, quiet_env


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("eight_devices")
  proc = subprocess.run(
      [sys.executable, str(REPO / "tests" / "eight_devices.py"), str(workdir)],
      env=quiet_env(XLA_FLAGS="--xla_force_host_platform_device_count=8"),
      cwd=REPO, capture_output=True, text=True, timeout=1500)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  assert proc.returncode == 0 and lines, (proc.stdout[-3000:]
                                          + proc.stderr[-3000:])
  out = json.loads(lines[-1][len("RESULT "):])
  assert out["devices"] == 8
  return out


@pytest.mark.parametrize("model", ["t5", "llama"])
def test_sharded_logits_and_greedy_equal_one_device(result, model):
  r = result["models"][model]
  # The parameters really are split: the vocab / mlp axis over 'model' and
  # copies over 'data' use all 8 devices.
  assert r["kernel_spec"] == [None, "model"] and r["kernel_devices"] == 8
  # Activations follow the logical rules: batch over data, vocab over model.
  assert r["logits_spec"] == ["data", None, "model"]
  assert r["tokens_spec"][0] == "data"
  # Only the order of float reductions differs.
  assert r["logits_diff"] < 1e-4
  assert r["greedy_equal"]
  assert r["greedy_logprob_diff"] < 1e-4


def test_sharded_t5_greedy_is_t5xs(result):
  t5, expected = result["models"]["t5"], result["models"]["t5_expected_greedy"]
  # Row 3 repeats row 0 to fill the data axis.
  assert t5["greedy_tokens"][:3] == expected
  assert t5["greedy_tokens"][3] == expected[0]
  assert t5["greedy_has_eos"] == [True, True, False, True]


@pytest.mark.parametrize("algorithm", ["dpo", "dro_v"])
def test_offline_steps_match_across_meshes(result, algorithm):
  one, eight = (result["offline"][algorithm][k] for k in ("one", "eight"))
  np.testing.assert_allclose([s["loss"] for s in eight["steps"]],
                             [s["loss"] for s in one["steps"]], rtol=1e-4,
                             atol=1e-5)
  # The parameters (but the embedding, see eight_devices.py), to float
  # rounding: the two runs differ by a thousandth of how far the three steps
  # moved them.
  r = result["offline"][algorithm]
  assert r["policy_difference"] < 1e-3 * r["policy_movement"], r
  # The policy really is split over the model axis on the 4x2 mesh.
  assert eight["kernel_spec"] == [None, "model"]


def test_ppo_iterations_match_across_meshes(result):
  """16 responses, 2 minibatches of 8, 2 micro-batches of 4 (one per data
  shard) on 4x2; whole minibatches on one device: the same updates to float
  rounding. Updates whose gradient rows do not split over the data shards
  are refused (XLA gave NaN gradients for them)."""
  r = result["online"]
  for a, b in zip(r["one"]["steps"], r["eight"]["steps"]):
    for key in a:
      np.testing.assert_allclose(b[key], a[key], rtol=1e-4, atol=1e-5,
                                 err_msg=key)
  np.testing.assert_allclose(r["eight"]["params_sum"], r["one"]["params_sum"],
                             rtol=1e-6)
  assert r["eight"]["kernel_spec"] == [None, "model"]
  assert r["eight"]["kernel_shards"] == 8
  assert "cannot be split evenly over 4 data-parallel shards" in (
      r["uneven_error"] or "")


def test_training_loop_on_4x2_matches_one_device_and_shards_parameters(
    result):
  one, eight = result["loop"]["one"], result["loop"]["eight"]
  steps = [str(s) for s in range(1, 13)]
  assert sorted(one["losses"], key=int) == sorted(eight["losses"],
                                                  key=int) == steps
  np.testing.assert_allclose([eight["losses"][s] for s in steps],
                             [one["losses"][s] for s in steps], rtol=2e-5)
  assert one["step"] == eight["step"] == 12
  assert eight["position"] == 12
  # The MLP kernel [embed, mlp] is split over the 2-way model axis.
  assert eight["wi_0_spec"] == ["None", "model"]
  assert eight["wi_0_shard_shape"] == [eight["wi_0_global_shape"][0],
                                       eight["wi_0_global_shape"][1] // 2]
  assert one["wi_0_shard_shape"] == one["wi_0_global_shape"]


GIB = 2**30


def test_plan_counts_the_state_and_batch_a_device_really_holds(result):
  """XLA's argument bytes per chip are the train state and batch: equal to
  what the initialised state and a real batch take on device 0, and the
  plan's own count of the state's shards agrees."""
  plan, real = result["plan"]["whole"], result["plan"]["real_bytes"]
  memory = plan["memory_gib_per_chip"]
  assert memory["arguments"] * GIB == real["state"] + real["batch"]
  state = plan["train_state_gib_per_chip"]
  assert state["trained_parameters"] * GIB == real["params"]
  assert state["optimizer_state"] * GIB == real["opt_state"]
  assert state["frozen_networks"] * GIB == real["frozen"]
  assert plan["batch_gib_per_chip"] * GIB == real["batch"]
  # The donated state is what the outputs alias.
  assert memory["aliased"] * GIB == real["state"]
  assert plan["chips"] == 8 and plan["mesh"] == {"data": 4, "model": 2}


def test_micro_batches_lower_the_planned_memory_not_the_flops(result):
  whole = result["plan"]["whole"]
  micro = result["plan"]["microbatches"]
  assert (micro["memory_gib_per_chip"]["temporaries"]
          < 0.8 * whole["memory_gib_per_chip"]["temporaries"])
  assert (micro["memory_gib_per_chip"]["arguments"]
          == whole["memory_gib_per_chip"]["arguments"])
  # The same matmuls over the same rows: the jaxpr count is unchanged, while
  # XLA's own count sees the micro-batch loop's body once.
  assert micro["flops_per_chip_per_step"] == whole["flops_per_chip_per_step"]
  assert (micro["xla_flops_per_chip_per_step"]
          < 0.5 * whole["xla_flops_per_chip_per_step"])


def test_scanned_layers_plan_the_same_flops(result):
  """The plan's FLOP count (the jaxpr's matmuls, loops by trip count) of
  the step with 2 scanned layers equals the unrolled step's; the plan's
  figure is that count."""
  plan = result["plan"]
  whole = plan["whole"]
  assert not whole["model"]["scan_layers"]
  assert whole["flops_per_chip_per_step"] == pytest.approx(
      plan["whole_flops_per_chip"], rel=1e-9)
  assert plan["scanned_flops_per_chip"] == pytest.approx(
      plan["unrolled_flops_per_chip"], rel=1e-9)
  # The second layer's matmuls are counted (the scan's body twice).
  assert (plan["unrolled_flops_per_chip"]
          > 1.2 * whole["flops_per_chip_per_step"] > 0)


def test_the_continuous_engine_on_pages_trains_alike_on_4x2(result):
  """The continuous engine's slots and page pool under the 4x2 mesh's
  sharding: each response draws from its own key, whatever the layout, so
  two GRPO steps give one device's numbers to float rounding."""
  r = result["engine"]
  assert r["eight"]["devices"] == 8 and r["one"]["devices"] == 1
  for a, b in zip(r["one"]["steps"], r["eight"]["steps"]):
    for key in a:
      np.testing.assert_allclose(b[key], a[key], rtol=1e-4, atol=1e-5,
                                 err_msg=key)
  np.testing.assert_allclose(r["eight"]["params_sum"],
                             r["one"]["params_sum"], rtol=1e-6)


def test_the_tpu_kernel_runs_its_rows_split_over_the_mesh(result):
  r = result["paged_kernel"]
  assert r["shard_map"]  # with the rules and without
  assert r["max_diff"] < 1e-5 and r["max_diff_bare"] < 1e-5


def test_episodes_are_played_on_sampler_devices(result):
  """Episodes played on 4 sampler devices, the update on the other 4:
  on-policy the run is the one-device run, step for step; one step ahead,
  its first step too, and its second trains on episodes of the
  parameters before the first update (its ratios start away from 1)."""
  r = result["episodes"]
  timing = ("seconds", "occupancy", "decode_steps", "preemptions")
  for one, split in zip(r["one"], r["split"]):
    for name, value in one.items():
      if isinstance(value, float) and not any(t in name for t in timing):
        atol = 1e-5 if name.startswith("gap/") else 1e-6
        np.testing.assert_allclose(split[name], value, rtol=1e-5, atol=atol,
                                   err_msg=name)
  split, ahead = r["split"], r["ahead"]
  for name in ("loss", "reward/episode", "episode/turns"):
    np.testing.assert_allclose(ahead[0][name], split[0][name], rtol=1e-5,
                               atol=1e-7, err_msg=name)
  assert abs(split[1]["approx_kl_k1"]) < 1e-6
  assert abs(ahead[1]["approx_kl_k1"]) > 1e-5


def test_the_continuous_engine_samples_on_sampler_devices(result):
  """The engine on 4 sampler devices, the update on the other 4: on-policy
  it trains as one device does (the same responses, whatever the
  devices); one step ahead, step 1 is on-policy and step 2's ratios are
  against the initial policy that sampled its responses."""
  r = result["engine"]
  split, ahead = r["split"], r["ahead"]
  assert split["policy_devices"] == ahead["policy_devices"] == [4, 5, 6, 7]
  for a, b in zip(r["one"]["steps"], split["steps"]):
    for key in ("loss", "score", "kl"):
      np.testing.assert_allclose(b[key], a[key], rtol=1e-4, atol=1e-5,
                                 err_msg=key)
  assert abs(split["steps"][1]["approx_kl_k1"]) < 1e-6
  for key in ("loss", "score", "kl"):
    np.testing.assert_allclose(ahead["steps"][0][key],
                               split["steps"][0][key], rtol=1e-5, atol=1e-7)
  # Stale: ten times the on-policy step's bound above, at least; the run
  # and the recomputation score on different meshes (0.3% apart seen).
  truth = ahead["stale"]["approx_kl_k1"]
  assert abs(truth) > 1e-5
  np.testing.assert_allclose(ahead["steps"][1]["approx_kl_k1"], truth,
                             rtol=1e-2)


def test_rollouts_on_sampler_devices_overlapped_with_the_update(result):
  """GRPO with rollouts on 4 sampler devices and updates on the other 4
  (online_overlap): on-policy it trains exactly as sampling and training on
  the same 4 devices; one step ahead (split, or on the same devices), step
  2 trains on responses the initial policy sampled, corrected against its
  log-probs."""
  r = result["overlap"]
  same, split = r["same_devices"], r["split"]
  for run in r.values():  # the sampler's devices hold none of it
    assert run["policy_devices"] == [4, 5, 6, 7]
  for a, b in zip(same["steps"], split["steps"]):
    for name in ("loss", "score", "kl", "approx_kl_k1"):
      np.testing.assert_allclose(b[name], a[name], rtol=1e-5, atol=1e-7,
                                 err_msg=name)
  # The first step has no rollout in flight: it samples on-policy.
  for mode in ("ahead", "decoupled"):
    for name in ("loss", "score", "kl"):
      np.testing.assert_allclose(r[mode]["steps"][0][name],
                                 same["steps"][0][name], rtol=1e-5,
                                 atol=1e-7)
  # On-policy, the update starts at ratio 1; one step ahead ('sampling'),
  # its ratios are against the initial policy, which sampled step 2's
  # responses (recomputed here from the initial parameters).
  assert abs(same["steps"][1]["approx_kl_k1"]) < 1e-6
  truth = r["ahead"]["stale"]
  assert abs(truth["approx_kl_k1"]) > 1e-4
  np.testing.assert_allclose(r["ahead"]["steps"][1]["approx_kl_k1"],
                             truth["approx_kl_k1"], rtol=1e-3)
  # 'decoupled' (sampling one step ahead on the training devices): the
  # ratios start at 1 again and the advantages carry the truncated weights
  # pi_start / pi_sample of those responses.
  decoupled = r["decoupled"]["steps"]
  assert abs(decoupled[1]["approx_kl_k1"]) < 1e-6
  np.testing.assert_allclose(decoupled[0]["correction/weight_mean"], 1.0,
                             rtol=1e-6)
  np.testing.assert_allclose(decoupled[1]["correction/weight_mean"],
                             truth["weight_mean"], rtol=1e-5)
