"""Gemma 2 against transformers: logits and greedy generation of the
fixtures transformers made (by experiments/make_gemma_fixtures.py:
tests/fixtures/hf/gemma2, four layers alternating local and global, a
sliding window shorter than the inputs, soft caps that bend the logits;
gemma2_odd, three layers in the pattern its config.json lists), the export
back to transformers' file, and the scanned layout. test_hf_io.py loads the
export of each in transformers itself (with torch installed)."""

import dataclasses
import functools
import pathlib

import jax
import numpy as np
import pytest

from jaxrlhf.models import gemma
from jaxrlhf.models import hf_io
from jaxrlhf.models import registry
from jaxrlhf.models import sampling
from jaxrlhf.models.layers import attentions

HF_FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "hf"
SLIDING, FULL = attentions.SLIDING_ATTENTION, attentions.FULL_ATTENTION


@functools.lru_cache(maxsize=None)
def _loaded(name="gemma2"):
  return hf_io.load_hf_checkpoint(HF_FIXTURES / name)


@functools.lru_cache(maxsize=None)
def _apply(config):
  return jax.jit(registry.module_for_config(config).apply)


def _logits(config, params, name="gemma2"):
  e = np.load(HF_FIXTURES / name / "expected.npz")
  logits = _apply(config)({"params": params}, e["tokens"], e["positions"],
                          e["attention_mask"])
  return np.asarray(logits), e["logits"], e["attention_mask"] == 1


def test_config_reads_the_fixture():
  config, params = _loaded()
  assert isinstance(config, gemma.GemmaConfig)
  assert (config.num_layers, config.sliding_window) == (4, 4)
  assert (config.attn_logit_softcap, config.final_logit_softcap) == (2.0, 5.0)
  assert config.query_pre_attn_scalar == 6
  assert (config.bos_token_id, config.eos_token_id) == (2, 1)
  # The alternating pattern, local first, is the config's default; one
  # parameter subtree per layer; the output layer is tied.
  assert config.layer_types is None
  assert config.attention_types == (SLIDING, FULL) * 2
  assert set(params["decoder"]) == {"token_embedder", "decoder_norm",
                                    "layers_0", "layers_1", "layers_2",
                                    "layers_3"}
  config, params = _loaded("gemma2_odd")
  assert config.num_layers == 3
  assert config.layer_types == (SLIDING, SLIDING, FULL)
  assert "layers_2" in params["decoder"]


@pytest.mark.parametrize("name", ["gemma2", "gemma2_odd"])
def test_logits_match_transformers(name):
  config, params = _loaded(name)
  ours, theirs, real = _logits(config, params, name)
  assert (~real).any()  # left and right padding are exercised
  np.testing.assert_allclose(ours[real], theirs[real], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name, change", [
    ("gemma2", dict(attn_logit_softcap=None)),
    ("gemma2", dict(final_logit_softcap=None)),
    ("gemma2", dict(sliding_window=64)),
    ("gemma2", dict(query_pre_attn_scalar=8)),
    ("gemma2_odd", dict(layer_types=None))])
def test_the_fixture_exercises_each_gemma_detail(name, change):
  """Without any one of them the logits are not transformers' (so the match
  above is not an accident of inputs that never reach it); gemma2_odd's
  pattern is not the default one."""
  config, params = _loaded(name)
  ours, theirs, real = _logits(dataclasses.replace(config, **change), params,
                               name)
  assert np.abs(ours[real] - theirs[real]).max() > 1e-2


@pytest.mark.parametrize("name", ["gemma2", "gemma2_odd"])
def test_greedy_generation_matches_transformers(name):
  config, params = _loaded(name)
  g = dict(np.load(HF_FIXTURES / name / "generate.npz"))
  # 6 prompt + 8 new tokens through a KV cache: the window slides.
  samples = sampling.sample_decoder_only(
      registry.module_for_config(config), params, g["prompt_tokens"],
      g["prompt_attention_mask"], jax.random.PRNGKey(0),
      int(g["max_new_tokens"]), greedy=True, eos_id=int(g["eos_id"]))
  np.testing.assert_array_equal(samples.tokens, g["generated"])
  assert bool(samples.has_eos[0]) and not bool(samples.has_eos[1])


@pytest.mark.parametrize("name", ["gemma2", "gemma2_odd"])
def test_export_gives_back_the_transformers_file(name, tmp_path):
  config, params = _loaded(name)
  hf_io.export_hf_checkpoint(config, params, tmp_path)
  original = hf_io.read_safetensors(HF_FIXTURES / name)
  exported = hf_io.read_safetensors(tmp_path)
  assert sorted(exported) == sorted(original)
  for key, value in original.items():
    np.testing.assert_array_equal(exported[key], value, err_msg=key)
  assert hf_io.load_hf_checkpoint(tmp_path)[0] == config


@pytest.mark.parametrize("name, options", [
    ("gemma2", dict(scan_layers=True)),
    ("gemma2_odd", dict(scan_layers=True, remat_policy="full")),
    ("gemma2_odd", dict(remat_policy="dots_saveable"))])
def test_scanned_and_rematerialised_layers_compute_the_same_logits(
    name, options):
  """One scanned layer body serves local and global layers (each layer's
  window comes from its traced index), an odd count too; rematerialised,
  an unrolled layer's index stays a Python value."""
  config, params = hf_io.load_hf_checkpoint(HF_FIXTURES / name, **options)
  if config.scan_layers:
    leaf = params["decoder"]["layers"]["mlp"]["wo"]["kernel"]
    assert leaf.shape[0] == config.num_layers
  ours, theirs, real = _logits(config, params, name)
  np.testing.assert_allclose(ours[real], theirs[real], atol=2e-5, rtol=1e-5)


def test_config_errors_name_the_field():
  with pytest.raises(ValueError, match="query_pre_attn_scalar must be a "
                     "positive integer"):
    gemma.GemmaConfig.preset("tiny", query_pre_attn_scalar=6.0)
  with pytest.raises(ValueError, match="layer_types has 2 entries for "
                     "num_layers=3"):
    gemma.GemmaConfig.preset("tiny", num_layers=3, layer_types=(SLIDING,
                                                                FULL))
  with pytest.raises(ValueError, match="cannot soft-cap"):
    gemma.GemmaConfig.preset("tiny", attention_impl="dot_product")
  with pytest.raises(ValueError, match="Unknown gemma preset"):
    gemma.GemmaConfig.preset("gemma2-3b")


def test_gemma2_2b_preset_has_the_published_parameter_count():
  # google/gemma-2-2b: 2,614,341,888 parameters (its model card).
  shapes = registry.param_shapes(gemma.GemmaConfig.preset("gemma2-2b",
                                                          scan_layers=True))
  assert sum(int(np.prod(s)) for s in shapes.values()) == 2_614_341_888
