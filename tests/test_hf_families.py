"""Qwen2, Qwen3, Gemma 3 and Mistral (and Llama 3's rotary scaling) against
transformers, on the fixtures transformers made
(experiments/make_family_fixtures.py; tests/fixtures/hf/<name>): greedy
generation through the KV cache past every sliding window, the scanned
layout, that each fixture exercises what sets its family apart, the
published configs and parameter counts, the SFT step of each family from
`config.model.arch`, and the special tokens of each family's tokenizer
layout. The logits and the export back to the
same file are checked with the other fixtures' in test_hf_io.py, as is the
export loaded by transformers itself (with torch installed).
"""

import dataclasses
import functools
import math
import pathlib

import flax.linen as nn
import jax
import numpy as np
import pytest

from conftest import from_scratch, one_device_mesh, tiny_config, trainer_of
from jaxrlhf import algorithms
from jaxrlhf import sharding
from jaxrlhf.models import gemma3
from jaxrlhf.models import hf_io
from jaxrlhf.models import mistral
from jaxrlhf.models import qwen2
from jaxrlhf.models import qwen3
from jaxrlhf.models import registry
from jaxrlhf.models import sampling
from jaxrlhf.models.layers import attentions
from jaxrlhf.models.layers import rotary

HF_FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "hf"
FIXTURES = ("qwen2", "qwen3", "gemma3", "mistral", "llama3_rope")
SLIDING, FULL = attentions.SLIDING_ATTENTION, attentions.FULL_ATTENTION


@functools.lru_cache(maxsize=None)
def _loaded(name, **overrides):
  return hf_io.load_hf_checkpoint(HF_FIXTURES / name, **overrides)


@functools.lru_cache(maxsize=None)
def _apply(config):
  return jax.jit(registry.module_for_config(config).apply)


def _logit_error(name, config, params):
  """The largest difference from transformers' logits at real tokens."""
  e = np.load(HF_FIXTURES / name / "expected.npz")
  logits = _apply(config)({"params": params}, e["tokens"], e["positions"],
                          e["attention_mask"])
  real = e["attention_mask"] == 1
  return np.abs(np.asarray(logits)[real] - e["logits"][real]).max()


def _greedy(name, config, params):
  g = dict(np.load(HF_FIXTURES / name / "generate.npz"))
  samples = sampling.sample_decoder_only(
      registry.module_for_config(config), params, g["prompt_tokens"],
      g["prompt_attention_mask"], jax.random.PRNGKey(0),
      int(g["max_new_tokens"]), greedy=True, eos_id=int(g["eos_id"]))
  return np.asarray(samples.tokens), g["generated"]


def test_configs_read_the_fixtures():
  config, params = _loaded("qwen2")
  assert isinstance(config, qwen2.Qwen2Config) and config.tie_embeddings
  assert config.rope_theta == 1e6 and config.attention_types == (FULL,) * 2
  assert params["decoder"]["layers_0"]["self_attention"]["query"][
      "bias"].shape == (4, 8)
  config, params = _loaded("qwen3")
  assert isinstance(config, qwen3.Qwen3Config) and not config.tie_embeddings
  assert (config.head_dim, config.emb_dim // config.num_heads) == (16, 8)
  assert config.attention_types == (FULL, SLIDING)
  assert config.sliding_window == 3
  assert params["decoder"]["layers_1"]["self_attention"]["key_norm"][
      "scale"].shape == (16,)
  config, _ = _loaded("gemma3")
  assert isinstance(config, gemma3.Gemma3Config)
  # transformers' default pattern is ours: the config leaves it implicit.
  assert config.layer_types is None
  assert config.attention_types == (SLIDING,) * 5 + (FULL, SLIDING)
  assert (config.rope_theta, config.local_rope_theta) == (1e6, 1e4)
  assert config.rope_scaling == rotary.RopeScaling("linear", 4.0)
  kinds = config.layer_attention()
  assert kinds[5] == attentions.LayerAttention(1e6, config.rope_scaling, None)
  assert kinds[6] == attentions.LayerAttention(1e4, None, 3)
  config, _ = _loaded("mistral")
  assert isinstance(config, mistral.MistralConfig)
  assert config.sliding_window == 3 and config.attention_types == (SLIDING,) * 2


@pytest.mark.parametrize("name", FIXTURES)
def test_greedy_generation_matches_transformers(name):
  # 6 prompt positions and 8 new tokens through the KV cache: past the
  # windows (3) of qwen3, gemma3 and mistral (without which the fixtures'
  # generations are others: experiments/make_family_fixtures.py).
  ours, theirs = _greedy(name, *_loaded(name))
  np.testing.assert_array_equal(ours, theirs)


def test_scanned_layers_that_differ_compute_the_same():
  """One scanned layer body for Gemma 3's local and global layers: each
  layer's window and rotary base come from its traced index."""
  name = "gemma3"
  config, params = _loaded(name, scan_layers=True)
  assert config.scan_layers and "layers" in params["decoder"]
  assert _logit_error(name, config, params) < 2e-5
  ours, theirs = _greedy(name, config, params)
  np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("name, change", [
    ("qwen2", dict(rope_theta=1e4)),
    ("qwen3", dict(layer_types=None, sliding_window=None)),
    ("qwen3", dict(layer_types=(SLIDING, SLIDING))),
    ("gemma3", dict(local_rope_theta=1e6)),
    ("gemma3", dict(rope_scaling=None)),
    ("gemma3", dict(layer_types=(SLIDING,) * 7)),
    ("gemma3", dict(sliding_window=64)),
    ("gemma3", dict(query_pre_attn_scalar=8)),
    ("mistral", dict(sliding_window=None)),
    ("llama3_rope", dict(rope_scaling=None)),
    # Each band of Llama 3's scaling: the interpolated band's edges, the
    # slowed band's factor.
    ("llama3_rope", dict(rope_scaling=rotary.RopeScaling("llama3", 32.0, 2.0,
                                                         4.0, 64))),
    ("llama3_rope", dict(rope_scaling=rotary.RopeScaling("llama3", 32.0, 1.0,
                                                         2.0, 64))),
    ("llama3_rope", dict(rope_scaling=rotary.RopeScaling("llama3", 8.0, 1.0,
                                                         4.0, 64))),
])
def test_the_fixtures_exercise_each_detail(name, change):
  """Without any one of them the logits are not transformers' (so the match
  is not an accident of inputs that never reach it)."""
  config, params = _loaded(name)
  assert _logit_error(name, dataclasses.replace(config, **change),
                      params) > 1e-2


# ----------------------------------------------------------------------------
# Published configs (transformers 4.x keys) and sizes.

QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu",
    "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
    "max_position_embeddings": 32768, "max_window_layers": 24,
    "model_type": "qwen2", "num_attention_heads": 14,
    "num_hidden_layers": 24, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
    "initializer_range": 0.02, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28,
    "model_type": "qwen3", "num_attention_heads": 16,
    "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "attn_logit_softcapping": None,
    "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1,
    "final_logit_softcapping": None, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
    "initializer_range": 0.02, "intermediate_size": 6912,
    "max_position_embeddings": 32768, "model_type": "gemma3_text",
    "num_attention_heads": 4, "num_hidden_layers": 26,
    "num_key_value_heads": 1, "pad_token_id": 0,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": 512,
    "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 262144}
# The text decoder of google/gemma-3-4b-pt (its text_config, with
# transformers' defaults for the keys it leaves out).
GEMMA3_4B_TEXT = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
    "hidden_size": 2560, "intermediate_size": 10240,
    "num_hidden_layers": 34, "num_attention_heads": 8,
    "num_key_value_heads": 4, "head_dim": 256, "query_pre_attn_scalar": 256,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
    "sliding_window": 1024, "sliding_window_pattern": 6,
    "max_position_embeddings": 131072, "vocab_size": 262208}
MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral",
    "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "sliding_window": 4096, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32000}


@pytest.mark.parametrize("published, preset, ids", [
    (QWEN25_05B, qwen2.Qwen2Config.preset("qwen2.5-0.5b"), (151643, 151643)),
    (QWEN3_06B, qwen3.Qwen3Config.preset("qwen3-0.6b"), (151643, 151645)),
    (GEMMA3_1B, gemma3.Gemma3Config.preset("gemma3-1b"), (2, 1)),
    (GEMMA3_4B_TEXT, gemma3.Gemma3Config.preset("gemma3-4b"), (None, None)),
    (MISTRAL_7B, mistral.MistralConfig.preset("mistral-7b"), (1, 2)),
], ids=["qwen2.5-0.5b", "qwen3-0.6b", "gemma3-1b", "gemma3-4b",
        "mistral-7b"])
def test_published_configs_translate_to_presets(published, preset, ids):
  config = hf_io.config_from_hf(published)
  bos, eos = ids
  assert dataclasses.replace(config, pad_token_id=None) == dataclasses.replace(
      preset, bos_token_id=bos, eos_token_id=eos)


@pytest.mark.parametrize("preset, published", [
    # Totals of the released checkpoints (their model cards and safetensors
    # metadata).
    (qwen2.Qwen2Config.preset("qwen2.5-0.5b"), 494_032_768),
    (qwen2.Qwen2Config.preset("qwen2.5-7b"), 7_615_616_512),
    (qwen3.Qwen3Config.preset("qwen3-0.6b"), 596_049_920),
    (qwen3.Qwen3Config.preset("qwen3-8b"), 8_190_735_360),
    (gemma3.Gemma3Config.preset("gemma3-1b"), 999_885_952),
    # gemma-3-4b-pt's 4,300,079,472 less its SigLIP vision tower
    # (416,866,032) and the projection into the text model (1152 x 2560 and
    # a norm of 1152).
    (gemma3.Gemma3Config.preset("gemma3-4b"),
     4_300_079_472 - 416_866_032 - 1152 * 2560 - 1152),
    (mistral.MistralConfig.preset("mistral-7b"), 7_241_732_096),
    (mistral.MistralConfig.preset("mistral-7b-v0.3"), 7_248_023_552),
], ids=lambda v: getattr(v, "emb_dim", v))
def test_presets_have_published_parameter_counts(preset, published):
  # Scanned, so that only one layer is traced.
  shapes = registry.param_shapes(dataclasses.replace(preset, scan_layers=True))
  assert sum(math.prod(s) for s in shapes.values()) == published


def test_layer_type_errors_name_the_field():
  with pytest.raises(ValueError, match="layer_types has 3 entries for "
                     "num_layers=2"):
    qwen3.Qwen3Config.preset("tiny", sliding_window=4,
                             layer_types=(SLIDING,) * 3)
  with pytest.raises(ValueError, match="sliding_window is None"):
    qwen2.Qwen2Config.preset("tiny", layer_types=(FULL, SLIDING))
  with pytest.raises(ValueError, match="layer_types"):
    qwen2.Qwen2Config.preset("tiny", sliding_window=4,
                             layer_types=(FULL, "local"))
  with pytest.raises(ValueError, match="MistralConfig: layer_types must be "
                     "None"):
    mistral.MistralConfig.preset("tiny", layer_types=(FULL, SLIDING))


# ----------------------------------------------------------------------------
# config.model.arch: SFT runs of the new families, from scratch.

def _sft_trainer(arch, **overrides):
  config = tiny_config(algorithm="sft", model__arch=arch, model__size="tiny",
                       model__num_encoder_layers=None,
                       model__num_decoder_layers=2, train__batch_size=4,
                       optimizer__warmup_steps=0, **overrides)
  mesh, rules = one_device_mesh(config)
  trainer = trainer_of(from_scratch(algorithms.get("sft")), config, mesh)
  assert registry.family_of(trainer.model).name == arch
  return trainer, mesh, rules


def test_gemma3_trains_from_the_run_config():
  """Two SFT steps of a scanned Gemma 3 whose two layers differ (set by
  config.model.family_fields): q/k norms and each layer's window and
  rotary from its traced index, differentiated; the loss falls."""
  trainer, mesh, rules = _sft_trainer(
      "gemma3", model__scan_layers=True,
      model__family_fields=f"layer_types=({SLIDING!r}, {FULL!r})")
  assert trainer.model.config.layers_differ()
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    state = trainer.init_state()
    batch = sharding.global_batch(next(trainer.train_batches(0)), mesh, rules)
    state, first = trainer.train_step(state, batch)
    _, second = trainer.train_step(state, batch)
  assert float(second["loss"]) < float(first["loss"])


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_each_family_builds_a_training_step(arch):
  """The SFT step of each other new family, traced (not compiled: the
  trainer is the same for every family, and each model's numbers are the
  parity tests'): the run config builds the model, and its loss has
  gradients."""
  trainer, mesh, rules = _sft_trainer(arch)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    traced = trainer.train_step.trace(trainer.abstract_state,
                                      trainer.batch_spec())
  metrics = traced.out_info[1]
  assert metrics["loss"].shape == metrics["grad_norm"].shape == ()


# ----------------------------------------------------------------------------
# Tokenizers: each family's tokenizer.json layout of special tokens.

def _tokenizer_file(path, words, specials, tokenizer_config):
  """A tiny tokenizer.json: `words` are its first ids, `specials` its
  special tokens (new ones after the words), with its
  tokenizer_config.json."""
  import json  # pylint: disable=g-import-not-at-top
  import tokenizers  # pylint: disable=g-import-not-at-top
  from tokenizers import pre_tokenizers  # pylint: disable=g-import-not-at-top
  vocab = {w: i for i, w in enumerate(words)}
  tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(
      vocab, unk_token=words[0]))
  tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tokenizer.add_special_tokens(specials)
  path.mkdir()
  tokenizer.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
  return path / "tokenizer.json"


@pytest.mark.parametrize("words, specials, tokenizer_config, expected", [
    # Qwen2.5 / Qwen3: id 0 is the text token "!", the special tokens come
    # last, and the padding declared is the EOS: a new padding id (one past
    # the last) trades places with id 0.
    (["!", "the", "cat"], ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
     {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
      "bos_token": None}, dict(eos_id=3, pad_id=0, token_swap=(0, 6))),
    # Gemma: <pad> is id 0, <eos> 1, <bos> 2.
    (["<pad>", "<eos>", "<bos>", "<unk>", "the", "cat"],
     ["<pad>", "<eos>", "<bos>", "<unk>"],
     {"eos_token": "<eos>", "pad_token": "<pad>", "bos_token": "<bos>"},
     dict(eos_id=1, pad_id=0, token_swap=None)),
    # Mistral (Llama 2's layout): <unk> 0, <s> 1, </s> 2, no padding token:
    # <unk> pads.
    (["<unk>", "<s>", "</s>", "the", "cat"], ["<unk>", "<s>", "</s>"],
     {"eos_token": "</s>", "bos_token": "<s>", "unk_token": "<unk>"},
     dict(eos_id=2, pad_id=0, token_swap=None)),
], ids=["qwen", "gemma", "mistral"])
def test_the_families_tokenizers_read_as_vocabularies(
    tmp_path, words, specials, tokenizer_config, expected):
  from jaxrlhf.data import hf_tokenizer  # pylint: disable=g-import-not-at-top
  vocabulary = hf_tokenizer.HFTokenizerVocabulary(_tokenizer_file(
      tmp_path / "tok", words, specials, tokenizer_config))
  assert {k: getattr(vocabulary, k) for k in expected} == expected
  ids = vocabulary.encode("the cat")
  assert vocabulary.decode(ids + [vocabulary.eos_id, 0]) == "the cat"
