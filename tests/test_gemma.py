"""Gemma 2 against transformers: logits and greedy generation of the
fixture transformers made (tests/fixtures/hf/gemma2, by
experiments/make_gemma_fixtures.py: two local/global layer pairs, a sliding
window shorter than the inputs, soft caps that bend the logits), the export
back to transformers' file, and the scanned layout."""

import dataclasses
import functools
import pathlib

import jax
import numpy as np
import pytest

from jaxrlhf import models
from jaxrlhf.models import gemma
from jaxrlhf.models import hf_io
from jaxrlhf.models import sampling

FIXTURE = pathlib.Path(__file__).resolve().parent / "fixtures" / "hf" / "gemma2"


@functools.lru_cache(maxsize=None)
def _loaded():
  return hf_io.load_hf_checkpoint(FIXTURE)


@functools.lru_cache(maxsize=None)
def _apply(config):
  return jax.jit(models.module_for_config(config).apply)


def _logits(config, params):
  e = np.load(FIXTURE / "expected.npz")
  logits = _apply(config)({"params": params}, e["tokens"], e["positions"],
                          e["attention_mask"])
  return np.asarray(logits), e["logits"], e["attention_mask"] == 1


def test_config_reads_the_fixture():
  config, params = _loaded()
  assert isinstance(config, gemma.GemmaConfig)
  assert (config.num_layers, config.sliding_window) == (4, 4)
  assert (config.attn_logit_softcap, config.final_logit_softcap) == (2.0, 5.0)
  assert config.query_pre_attn_scalar == 6.0
  assert (config.bos_token_id, config.eos_token_id) == (2, 1)
  # Two pairs of a local and a global layer; the output layer is tied.
  assert set(params["decoder"]) == {"token_embedder", "decoder_norm",
                                    "layers_0", "layers_1"}
  assert set(params["decoder"]["layers_1"]) == {"local", "global"}


def test_logits_match_transformers():
  config, params = _loaded()
  ours, theirs, real = _logits(config, params)
  assert (~real).any()  # left and right padding are exercised
  np.testing.assert_allclose(ours[real], theirs[real], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("change", [
    dict(attn_logit_softcap=None), dict(final_logit_softcap=None),
    dict(sliding_window=64), dict(query_pre_attn_scalar=8.0)])
def test_the_fixture_exercises_each_gemma_detail(change):
  """Without any one of them the logits are not transformers' (so the match
  above is not an accident of inputs that never reach it)."""
  config, params = _loaded()
  ours, theirs, real = _logits(dataclasses.replace(config, **change), params)
  assert np.abs(ours[real] - theirs[real]).max() > 1e-2


def test_greedy_generation_matches_transformers():
  config, params = _loaded()
  g = dict(np.load(FIXTURE / "generate.npz"))
  # 6 prompt + 8 new tokens through a KV cache: the window slides.
  samples = sampling.sample_decoder_only(
      models.module_for_config(config), params, g["prompt_tokens"],
      g["prompt_attention_mask"], jax.random.PRNGKey(0),
      int(g["max_new_tokens"]), greedy=True, eos_id=int(g["eos_id"]))
  np.testing.assert_array_equal(samples.tokens, g["generated"])
  assert bool(samples.has_eos[0]) and not bool(samples.has_eos[1])


def test_export_gives_back_the_transformers_file(tmp_path):
  config, params = _loaded()
  hf_io.export_hf_checkpoint(config, params, tmp_path)
  original = hf_io.read_safetensors(FIXTURE)
  exported = hf_io.read_safetensors(tmp_path)
  assert sorted(exported) == sorted(original)
  for key, value in original.items():
    np.testing.assert_array_equal(exported[key], value, err_msg=key)
  assert hf_io.load_hf_checkpoint(tmp_path)[0] == config


def test_scanned_pairs_compute_the_same_logits():
  config, _ = _loaded()
  scanned, params = hf_io.load_hf_checkpoint(FIXTURE, scan_layers=True)
  assert scanned.scan_layers
  leaf = params["decoder"]["layers"]["local"]["mlp"]["wo"]["kernel"]
  assert leaf.shape[0] == 2  # pairs stacked along the leading axis
  ours, theirs, real = _logits(scanned, params)
  np.testing.assert_allclose(ours[real], theirs[real], atol=2e-5, rtol=1e-5)


def test_config_errors_name_the_field():
  with pytest.raises(ValueError, match="num_layers=3 must be even"):
    gemma.GemmaConfig.preset("tiny", num_layers=3)
  with pytest.raises(ValueError, match="cannot soft-cap"):
    gemma.GemmaConfig.preset("tiny", attention_impl="dot_product")
  with pytest.raises(ValueError, match="Unknown gemma preset"):
    gemma.GemmaConfig.preset("gemma2-3b")


def test_gemma2_2b_preset_has_the_published_parameter_count():
  # google/gemma-2-2b: 2,614,341,888 parameters (its model card).
  shapes = models.param_shapes(gemma.GemmaConfig.preset("gemma2-2b",
                                                        scan_layers=True))
  assert sum(int(np.prod(s)) for s in shapes.values()) == 2_614_341_888
