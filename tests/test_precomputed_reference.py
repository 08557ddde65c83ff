"""Reference log-probs precomputed once over the data (reference_cache).

The precomputed run must train exactly as the in-step run (same batches,
same losses, same parameters), the cached values must be the reference's
log-probs computed by hand, and a resumed run must reuse the cache while a
changed setup is caught.
"""

import json
import os

import flax.linen as nn
import jax
import numpy as np
import pytest

from conftest import from_scratch, tiny_config, trainer_of
from jaxrlhf import algorithms
from jaxrlhf.algorithms.offline import precomputed_reference
from jaxrlhf.algorithms.offline import reference_cache
from jaxrlhf import checkpoint_files
from jaxrlhf.data import synthetic
from jaxrlhf.data import synthetic_feedback
from jaxrlhf import defaults
from jaxrlhf import sharding
from jaxrlhf.train import checkpointing
from jaxrlhf.train import loop

NUM_EXAMPLES = 40  # 2.5 batches of 16: six steps cross two epoch boundaries


def _feedback_file(directory, kind="pairs"):
  examples = synthetic.make_examples("train", NUM_EXAMPLES)
  path = os.path.join(directory, f"{kind}.jsonl")
  synthetic_feedback.write_synthetic_feedback(
      path, kind, [e["inputs"] for e in examples],
      [[e["ideal"], e["targets"]] for e in examples], synthetic.gold_reward,
      beta=10.0)
  return path


def _config(data_path, checkpoint, arch="t5", algorithm="dpo", **overrides):
  settings = dict(algorithm=algorithm,
                  data__task=f"refcache_{algorithm}_{arch}",
                  optimizer__warmup_steps=0, train__num_steps=6,
                  checkpoint__every_steps=0)
  if arch != "t5":
    settings.update(model__arch=arch, model__num_encoder_layers=None)
  settings.update(overrides)
  config = tiny_config(**settings)
  config.data.files.train = data_path
  config.init.policy_checkpoint = checkpoint
  return config


def _mesh_and_rules(config):
  mesh = sharding.create_mesh((1, 1), ("data", "model"), jax.devices()[:1])
  return mesh, sharding.as_rules(config.sharding.logical_axis_rules)


def _save_reference(directory, data_path, arch):
  """A "SFT" checkpoint: a fresh policy saved as a jaxrlhf workdir."""
  config = _config(data_path, "", arch=arch)
  mesh, rules = _mesh_and_rules(config)

  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    state = trainer_of(from_scratch(algorithms.get("dpo")), config,
                       mesh).init_state()
  checkpointer = checkpointing.Checkpointer(
      os.path.join(directory, "checkpoints"), keep=1)
  checkpointer.save(0, state, 0)
  checkpointer.close()
  return directory


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp("refcache")
  data_path = _feedback_file(str(root))
  reference = _save_reference(str(root / "sft"), data_path, "t5")
  return root, data_path, reference


def _saved_policy(workdir):
  ckpt_dir = os.path.join(workdir, "checkpoints")
  step = max(int(d) for d in os.listdir(ckpt_dir) if d.isdigit())
  state = checkpoint_files.restore_state_as_numpy(
      os.path.join(ckpt_dir, str(step), "state"))
  return step, state


def _train_losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


class _CountBuilds:
  """Counts reference_cache.compute calls (each is one pass over the data)."""

  def __init__(self, monkeypatch):
    self.count = 0
    original = reference_cache.compute

    def counting(*args, **kwargs):
      self.count += 1
      return original(*args, **kwargs)

    monkeypatch.setattr(reference_cache, "compute", counting)


def _run(config, workdir, cache_dir):
  config.reference_logprobs.cache_dir = str(cache_dir)
  return loop.train(config, str(workdir))


def test_precomputed_run_equals_in_step_run_and_cache_is_reused_or_caught(
    setup, monkeypatch):
  root, data_path, reference = setup
  builds = _CountBuilds(monkeypatch)
  in_step, precomputed = root / "in_step", root / "precomputed"
  cache = precomputed / "reference_logprobs"
  loop.train(_config(data_path, reference), str(in_step))
  _run(_config(data_path, reference, reference_logprobs__mode="precomputed"),
       precomputed, cache)
  assert builds.count == 1

  # Same batches, same losses, same parameters (to float tolerance): the
  # precomputed values stand in for the in-step reference exactly.
  losses_a, losses_b = _train_losses(in_step), _train_losses(precomputed)
  assert sorted(losses_a) == sorted(losses_b) == list(range(1, 7))
  np.testing.assert_allclose([losses_b[s] for s in range(1, 7)],
                             [losses_a[s] for s in range(1, 7)], rtol=1e-4)
  # The policy moved, so the later losses really compare log-ratios.
  assert abs(losses_a[6] - losses_a[1]) > 1e-3
  step_a, state_a = _saved_policy(str(in_step))
  step_b, state_b = _saved_policy(str(precomputed))
  assert step_a == step_b == 6
  # Only the in-step run holds the reference.
  assert "reference" in state_a["frozen"] and not state_b.get("frozen")
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5),
               state_a["params"]["policy"], state_b["params"]["policy"])

  # A resumed run (the loop restores the state, then asks for batches at the
  # saved position; SFT's resume tests cover restoring frozen={}) reads the
  # cache instead of scoring the data again.
  same = _config(data_path, reference, reference_logprobs__mode="precomputed")
  same.reference_logprobs.cache_dir = str(cache)
  manifest = cache / reference_cache.MANIFEST
  mtime = os.path.getmtime(manifest)
  mesh, rules = _mesh_and_rules(same)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    batch = next(algorithms.build(same, mesh).train_batches(6))
  assert builds.count == 1 and os.path.getmtime(manifest) == mtime
  assert batch["reference_logp_rejected"].shape == (same.train.batch_size,)

  # The same workdir resumed with other lengths: the cache no longer
  # matches, and a run trained on it must not silently recompute.
  changed = _config(data_path, reference, data__targets_length=12,
                    reference_logprobs__mode="precomputed")
  changed.reference_logprobs.cache_dir = str(cache)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    with pytest.raises(reference_cache.CacheMismatchError,
                       match="feature_lengths"):
      algorithms.build(changed, mesh).train_batches(6)
    assert builds.count == 1
    # A new run pointed at that stale cache recomputes it instead.
    trainer = algorithms.build(changed, mesh)
    trainer.precomputed_reference.prepare(trainer.initial_policy_params,
                                          new_run=True)
  assert builds.count == 2
  manifest = reference_cache.read_manifest(str(cache))
  assert manifest["fingerprint"]["feature_lengths"]["chosen"] == 12
  # Only the new build's directory is left.
  assert [p.name for p in cache.iterdir()
          if p.name.startswith("build-")] == [manifest["build"]]


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _features_t5(vocab, prompt, completion, lp, lc):
  """Hand-built features of one example, and the (logit row, token) pairs
  whose log-probs sum to log pi(completion | prompt)."""
  enc = (vocab.encode(prompt) + [1] + [0] * lp)[:lp]
  tgt = vocab.encode(completion) + [1]
  n = len(tgt)
  tgt = tgt + [0] * (lc - n)
  features = {"encoder_input_tokens": enc,
              "x_decoder_target_tokens": tgt,
              "x_decoder_input_tokens": [0] + tgt[:-1],
              "x_decoder_loss_weights": [1] * n + [0] * (lc - n)}
  return features, [(t, tgt[t]) for t in range(n)]


def _features_decoder(vocab, prompt, completion, lp, lc):
  prompt_ids = vocab.encode(prompt)  # the converter drops the prompt's EOS
  completion_ids = vocab.encode(completion) + [1]
  ids = prompt_ids + completion_ids
  pad = lp + lc - len(ids)
  features = {
      "x_tokens": ids + [0] * pad,
      "x_positions": list(range(len(ids))) + [0] * pad,
      "x_attention_mask": [1] * len(ids) + [0] * pad,
      "x_loss_weights": ([0] * len(prompt_ids) + [1] * len(completion_ids)
                         + [0] * pad)}
  # The logits at t - 1 predict token t.
  return features, [(t - 1, ids[t]) for t in range(len(prompt_ids), len(ids))]


def _logits(model, params, arch, features):
  if arch == "t5":
    out = model.apply({"params": params}, features["encoder_input_tokens"],
                      features["x_decoder_input_tokens"],
                      features["x_decoder_target_tokens"], deterministic=True)
  else:
    out = model.apply({"params": params}, features["x_tokens"],
                      features["x_positions"], features["x_attention_mask"])
  return np.asarray(out, np.float64)


@pytest.mark.parametrize("arch,algorithm", [("t5", "dpo"),
                                             ("llama", "dro_v")])
def test_cached_values_are_the_references_log_probs(setup, tmp_path, arch,
                                                    algorithm):
  _, data_path, reference = setup
  algorithm_value = algorithms.get(algorithm)
  columns = ("chosen", "rejected")
  if arch != "t5":
    # DRO-V's single trajectories on a decoder-only policy, with no
    # checkpoint: the reference is the policy's random initialisation (read
    # below from the state the run starts from).
    data_path = _feedback_file(str(tmp_path), "trajectory")
    columns = ("completion",)
    reference = ""
    algorithm_value = from_scratch(algorithm_value)
  config = _config(data_path, reference, arch=arch, algorithm=algorithm,
                   reference_logprobs__mode="precomputed",
                   reference_logprobs__batch_size=8)
  config.reference_logprobs.cache_dir = str(tmp_path / "cache")
  defaults.validate(config)
  mesh, rules = _mesh_and_rules(config)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    trainer = trainer_of(algorithm_value, config, mesh)
    state = trainer.init_state()
    assert state.frozen == {}
    table = trainer.precomputed_reference.table
  if reference:
    ref_params = checkpoint_files.restore_state_as_numpy(os.path.join(
        reference, "checkpoints", "0", "state"))["params"]["policy"]
    # Evaluation reloads the reference, which the train state lacks.
    jax.tree.map(np.testing.assert_array_equal,
                 jax.device_get(trainer.reference_params(state)), ref_params)
  else:
    ref_params = jax.device_get(state.params["policy"])
  with open(data_path) as f:
    rows = [json.loads(line) for line in f]
  # One entry per distinct (prompt, completion): repeats (a pair whose
  # completions are equal, a completion sampled twice) share theirs.
  distinct = {(r["prompt"], r[c]) for r in rows for c in columns}
  assert len(table) == len(distinct) < len(columns) * len(rows)

  make = _features_t5 if arch == "t5" else _features_decoder
  lp, lc = config.data.inputs_length, config.data.targets_length
  examples = [make(trainer.vocabulary, row["prompt"], row[column], lp, lc)
              for row in rows[:4] for column in columns]
  features = {k: np.asarray([f[k] for f, _ in examples], np.int32)
              for k in examples[0][0]}
  logp = _log_softmax(_logits(trainer.model, ref_params, arch, features))
  expected = [sum(logp[i, t, token] for t, token in scored)
              for i, (_, scored) in enumerate(examples)]
  keys = reference_cache.row_keys(
      features, reference_cache.scoring_features(trainer.lm, "x"))
  np.testing.assert_allclose(table.lookup(keys), expected, rtol=1e-4,
                             atol=1e-4)

  # Training batches carry the values, looked up for their own rows.
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    batch = next(trainer.train_batches(0))
  for column in columns:
    values = batch[reference_cache.feature_name(column)]
    assert values.shape == (config.train.batch_size,) and np.all(values < 0)


def test_unknown_example_is_an_error_and_repeats_are_merged():
  table = reference_cache.ReferenceTable(
      np.array([5, 3, 5], np.uint64), np.array([-1.0, -2.0, -1.000001]))
  assert len(table) == 2
  np.testing.assert_allclose(table.lookup(np.array([3, 5], np.uint64)),
                             [-2.0, -1.0])
  with pytest.raises(reference_cache.MissingExampleError,
                     match="1 completion rows"):
    table.lookup(np.array([3, 4], np.uint64))
  with pytest.raises(ValueError, match="collision"):
    reference_cache.ReferenceTable(np.array([7, 7], np.uint64),
                                   np.array([-1.0, -9.0]))


def test_row_keys_depend_on_content_only():
  a = {"t": np.array([[1, 2, 0], [1, 2, 0], [1, 3, 0]], np.int32),
       "w": np.array([[1, 1, 0], [1, 1, 0], [1, 1, 0]], np.int32)}
  keys = reference_cache.row_keys(a, ("t", "w"))
  assert keys[0] == keys[1] != keys[2]
  # Another feature name with the same content gives the same key.
  b = {"u": a["t"], "v": a["w"]}
  np.testing.assert_array_equal(reference_cache.row_keys(b, ("u", "v")), keys)


def test_half_written_cache_is_never_read(tmp_path):
  fingerprint = {"task": "t"}
  directory = str(tmp_path / "cache")
  keys, values = np.array([1, 2], np.uint64), np.array([-1.0, -2.0])
  reference_cache.write(directory, fingerprint, keys, values)
  assert len(reference_cache.load(directory, fingerprint)) == 2
  # A crash before the manifest is renamed into place: parts, no manifest.
  os.remove(os.path.join(directory, reference_cache.MANIFEST))
  assert reference_cache.load(directory, fingerprint) is None
  reference_cache.write(directory, fingerprint, keys, values)
  with pytest.raises(reference_cache.CacheMismatchError, match="task"):
    reference_cache.load(directory, {"task": "other"})


def test_fingerprint_follows_the_checkpoint_step(tmp_path):
  workdir = tmp_path / "sft"

  def complete_step(step):  # the file orbax writes into a finished item
    state = workdir / "checkpoints" / str(step) / "state"
    state.mkdir(parents=True)
    (state / "_METADATA").write_text("{}")

  complete_step(100)
  first = precomputed_reference.checkpoint_fingerprint(str(workdir))
  complete_step(200)
  second = precomputed_reference.checkpoint_fingerprint(str(workdir))
  assert first["path"] == second["path"]
  assert first["resolved"].endswith(os.path.join("100", "state"))
  assert second["resolved"].endswith(os.path.join("200", "state"))


def test_kto_rejects_precomputed_reference():
  config = tiny_config(algorithm="kto",
                       reference_logprobs__mode="precomputed")
  with pytest.raises(ValueError, match="reference_logprobs.mode"):
    defaults.validate(config)
