"""`from_pretrained` on each checkpoint kind, `export_hf`, `build_model`.

Truths: the outputs t5x and transformers computed for their fixtures
(tests/fixtures/t5x, tests/fixtures/hf), the parameters a test writes
with orbax itself, and the published t5x gin / fixture configs.
"""

import functools
import dataclasses
import json
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import defaults
from jaxrlhf import sharding
from jaxrlhf import sharding_rules
from jaxrlhf.models import gpt_neox
from jaxrlhf.models import llama
from jaxrlhf.models import loading
from jaxrlhf.models import t5
from jaxrlhf.models import t5x_decoder_only as t5x_do
from jaxrlhf.models.layers import decoders
from jaxrlhf.models.layers import rotary
from jaxrlhf.models.loading import export_hf
from jaxrlhf.models.loading import from_pretrained
from jaxrlhf.models.registry import build_model
from jaxrlhf.train import checkpointing

HF_FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "hf"


def _mesh():
  return sharding.create_mesh((1, -1), ("data", "model"))


def _flat(tree):
  return {jax.tree_util.keystr(k): np.asarray(v)
          for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def _assert_same_params(a, b):
  fa, fb = _flat(a), _flat(b)
  assert fa.keys() == fb.keys()
  for key in fa:
    np.testing.assert_array_equal(fa[key], fb[key], err_msg=key)


def _t5_logits(module, params, e):
  return np.asarray(jax.jit(module.apply)(
      {"params": params}, e["encoder_input_tokens"],
      e["decoder_input_tokens"], e["decoder_target_tokens"]))


# ----------------------------------------------------------------------------
# T5X.

def test_t5x_encdec_config_is_inferred_from_shapes(t5x_fixtures):
  root = t5x_fixtures / "encdec"
  module, config, params = from_pretrained(root, mesh=_mesh())
  written = json.loads((root / "config.json").read_text())["T5Config"]
  want = t5.T5Config(**{k: tuple(v) if isinstance(v, list) else v
                        for k, v in written.items()})
  assert config == want
  assert isinstance(module, t5.T5)
  kernel = params["decoder"]["logits_dense"]["kernel"]
  assert isinstance(kernel.sharding, jax.sharding.NamedSharding)
  assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "model")
  e = dict(np.load(root / "expected.npz"))
  np.testing.assert_allclose(_t5_logits(module, params, e), e["logits"],
                             atol=1e-4, rtol=0)


def test_t5x_checkpoint_into_scanned_layout(t5x_fixtures):
  root = t5x_fixtures / "encdec"
  module, config, params = from_pretrained(
      root / "checkpoint_3", scan_layers=True, attention_impl="dot_product")
  assert config.scan_layers and config.attention_impl == "dot_product"
  assert params["encoder"]["layers"]["attention"]["query"]["kernel"].shape[
      0] == config.num_encoder_layers
  e = dict(np.load(root / "expected.npz"))
  np.testing.assert_allclose(_t5_logits(module, params, e), e["logits"],
                             atol=1e-4, rtol=0)


def test_t5x_decoder_only_config_is_inferred(t5x_fixtures):
  root = t5x_fixtures / "decoder_only"
  module, config, params = from_pretrained(root, dtype="float32")
  written = json.loads((root / "config.json").read_text())
  assert config == t5x_do.T5xDecoderOnlyConfig.from_t5x(
      written["TransformerConfig"])
  assert config == t5x_do.T5xDecoderOnlyConfig.preset("tiny")
  e = dict(np.load(root / "expected.npz"))
  logits = jax.jit(functools.partial(module.apply,
                                     method=module.t5x_logits))(
      {"params": params}, e["decoder_input_tokens"],
      e["decoder_target_tokens"])
  np.testing.assert_allclose(logits, e["logits"], atol=1e-4, rtol=0)


def test_t5x_overrides_and_wrong_config_errors(t5x_fixtures):
  root = t5x_fixtures / "encdec"
  _, config, _ = from_pretrained(root, mlp_activations=("silu", "linear"),
                                 param_dtype=jnp.bfloat16)
  assert config.mlp_activations == ("silu", "linear")
  wrong = t5.t5_config("tiny", vocab_size=128)  # other dimensions
  with pytest.raises(loading.PretrainedError, match="token_embedder|shape"):
    from_pretrained(root, model_config=wrong)


# ----------------------------------------------------------------------------
# Hugging Face.

@pytest.mark.parametrize("name", ["llama_gqa", "pythia", "t5_gated"])
def test_hf_folders_load_sharded_and_match_transformers(name):
  module, config, params = from_pretrained(HF_FIXTURES / name, mesh=_mesh())
  e = dict(np.load(HF_FIXTURES / name / "expected.npz"))
  if isinstance(config, t5.T5Config):
    logits, real = _t5_logits(module, params, e), e["decoder_target_tokens"] > 0
  else:
    logits = np.asarray(jax.jit(module.apply)(
        {"params": params}, e["tokens"], e["positions"], e["attention_mask"]))
    real = e["attention_mask"] == 1
  np.testing.assert_allclose(logits[real], e["logits"][real], atol=1e-5,
                             rtol=1e-5)
  assert all(isinstance(x.sharding, jax.sharding.NamedSharding)
             for x in jax.tree.leaves(params))


@pytest.mark.parametrize("name,overrides", [
    ("llama_gqa", dict(scan_layers=True)),
    ("t5_relu_tied", dict(scan_layers=True)),
    ("neox_sequential", {})])
def test_export_round_trip(tmp_path, name, overrides):
  module, config, params = from_pretrained(HF_FIXTURES / name, **overrides)
  out = export_hf(module, params, tmp_path / "export")
  # The exported tensors are the fixture's (layers unstacked again).
  from safetensors import numpy as safetensors_np  # pylint: disable=g-import-not-at-top
  original = safetensors_np.load_file(HF_FIXTURES / name / "model.safetensors")
  exported = safetensors_np.load_file(out / "model.safetensors")
  for key, value in exported.items():
    np.testing.assert_array_equal(value, original[key], err_msg=key)
  _, config_back, params_back = from_pretrained(out, **overrides)
  assert config_back == config
  _assert_same_params(params_back, params)


def test_export_rejects_t5x_decoder_only(tmp_path):
  config = t5x_do.T5xDecoderOnlyConfig.preset("tiny")
  with pytest.raises(loading.PretrainedError,
                     match="no model for the t5x_decoder_only family"):
    export_hf(config, {}, tmp_path)


# ----------------------------------------------------------------------------
# jaxrlhf runs (orbax).

def _random_params(module, seed):
  abstract = nn.meta.unbox(loading.abstract_params(module))
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda a: rng.standard_normal(a.shape).astype(np.float32), abstract)


def _write_run(workdir, model_overrides, step, seed):
  """A jaxrlhf-style workdir: config.json and an orbax checkpoint of a
  train state whose policy is random."""
  config = defaults.base_config()
  for key, value in model_overrides.items():
    config.model[key] = value
  module, model_config = build_model(config.model, 100)
  params = _random_params(module, seed)
  workdir.mkdir(parents=True, exist_ok=True)
  (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
  state = {"step": jnp.int32(step), "params": {"policy": params},
           "opt_state": {"mu": params}, "frozen": {},
           "rng": jax.random.PRNGKey(0)}
  ckpt = checkpointing.Checkpointer(str(workdir / "checkpoints"), keep=3)
  ckpt.save(step, state, data_position=0)
  ckpt.close()
  return model_config, params


def test_orbax_workdir_of_a_t5_run(tmp_path):
  workdir = tmp_path / "run"
  model_config, params = _write_run(workdir, {}, 7, seed=0)
  _write_run(workdir, {}, 3, seed=1)  # an older step, other values
  for path in (workdir, workdir / "checkpoints", workdir / "checkpoints" / "7",
               workdir / "checkpoints" / "7" / "state"):
    module, config, loaded = from_pretrained(path, mesh=_mesh())
    assert config == model_config and isinstance(module, t5.T5)
    _assert_same_params(loaded, params)
  _, _, older = from_pretrained(workdir, step=3)
  assert not np.array_equal(older["token_embedder"]["embedding"],
                            params["token_embedder"]["embedding"])


def test_a_scanned_run_starts_from_an_unscanned_t5x_checkpoint(t5x_fixtures):
  """A trainer whose model scans its layers (the paper configs' layout)
  reads t5x's unrolled checkpoint into the stacked one, sharded like its
  state (`pretrained.load_lm_params`)."""
  from jaxrlhf.models import pretrained  # pylint: disable=g-import-not-at-top
  path = str(t5x_fixtures / "encdec" / "checkpoint_3")
  _, config, unrolled = from_pretrained(path)
  scanned_config = dataclasses.replace(config, scan_layers=True)
  module = t5.T5(scanned_config)
  mesh = _mesh()
  boxed = jax.eval_shape(functools.partial(module.init, jax.random.PRNGKey(0)),
                         jnp.ones((1, 4), jnp.int32), jnp.ones((1, 4), jnp.int32),
                         jnp.ones((1, 4), jnp.int32))["params"]
  shardings = sharding.tree_shardings(boxed, mesh,
                                      sharding_rules.STANDARD_RULES)
  target = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      nn.unbox(boxed), shardings)
  loaded = pretrained.load_lm_params(path, target, module=module)
  expected = unrolled
  for stack, count in (("encoder", config.num_encoder_layers),
                       ("decoder", config.num_decoder_layers)):
    expected = decoders.stack_layer_params(expected, count, stack)
  _assert_same_params(loaded, expected)
  assert all(jax.tree.leaves(jax.tree.map(
      lambda a, t: a.sharding == t.sharding, loaded, target)))


def test_orbax_workdir_of_a_llama_run_into_scanned_layout(tmp_path):
  workdir = tmp_path / "run"
  model_config, params = _write_run(workdir, {"arch": "llama"}, 2, seed=2)
  assert isinstance(model_config, llama.LlamaConfig)
  module, config, loaded = from_pretrained(workdir, scan_layers=True)
  assert config == dataclasses.replace(model_config, scan_layers=True)
  _assert_same_params(loaded, decoders.stack_layer_params(
      params, model_config.num_layers))
  tokens = jnp.array([[0, 3, 4, 5]], jnp.int32)
  mask = (tokens > 0).astype(jnp.int32)
  positions = rotary.positions_from_mask(mask)
  unscanned = jax.jit(llama.Llama(model_config).apply)(
      {"params": params}, tokens, positions, mask)
  scanned = jax.jit(module.apply)({"params": loaded}, tokens, positions, mask)
  np.testing.assert_allclose(scanned, unscanned, atol=1e-5, rtol=1e-5)


def test_bare_orbax_params_need_a_model_config(tmp_path):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  config = gpt_neox.GPTNeoXConfig.preset("tiny")
  params = _random_params(gpt_neox.GPTNeoX(config), seed=3)
  ocp.PyTreeCheckpointer().save(tmp_path / "params", params)
  with pytest.raises(loading.PretrainedError, match="model_config"):
    from_pretrained(tmp_path / "params")
  _, loaded_config, loaded = from_pretrained(tmp_path / "params",
                                             model_config=config)
  assert loaded_config == config
  _assert_same_params(loaded, params)


def test_unknown_directory_is_a_clear_error(tmp_path):
  (tmp_path / "notes.txt").write_text("hi")
  with pytest.raises(loading.PretrainedError, match="Hugging Face folder"):
    from_pretrained(tmp_path)
  with pytest.raises(loading.PretrainedError, match="does not exist"):
    from_pretrained(tmp_path / "missing")


# ----------------------------------------------------------------------------
# build_model.

@pytest.mark.parametrize("arch,size,cls,preset", [
    ("llama", "tinyllama-1.1b", llama.Llama, llama.LLAMA_PRESETS),
    ("gpt_neox", "pythia-1b", gpt_neox.GPTNeoX, gpt_neox.PYTHIA_PRESETS),
    ("t5x_decoder_only", "base", t5x_do.T5xDecoderOnly,
     t5x_do.T5X_DECODER_ONLY_PRESETS)])
def test_build_model_decoder_only_presets(arch, size, cls, preset):
  config = defaults.base_config()
  config.model.arch, config.model.size = arch, size
  config.model.vocab_size = 32000
  if arch == "t5x_decoder_only":
    config.model.logits_via_embedding = True  # as t5x's gin files
  module, model_config = build_model(config.model, 32000)
  assert isinstance(module, cls)
  want = preset[size]
  assert dataclasses.replace(model_config, vocab_size=want.vocab_size) == want


def test_build_model_dimension_overrides_and_errors():
  config = defaults.base_config()
  config.model.arch, config.model.size = "llama", "tiny"
  config.model.num_decoder_layers = 3
  config.model.mlp_dim = 96
  _, model_config = build_model(config.model, 100)
  assert (model_config.num_layers, model_config.mlp_dim,
          model_config.vocab_size) == (3, 96, 128)
  config.model.num_encoder_layers = 2
  with pytest.raises(ValueError, match="num_encoder_layers"):
    build_model(config.model, 100)
  config = defaults.base_config()
  config.model.arch = "gpt2"
  with pytest.raises(ValueError, match="config.model.arch"):
    build_model(config.model, 100)
  # The T5 branch is unchanged.
  config = defaults.base_config()
  module, model_config = build_model(config.model, 100)
  assert isinstance(module, t5.T5)
  assert model_config == t5.t5_config("tiny", vocab_size=128)
