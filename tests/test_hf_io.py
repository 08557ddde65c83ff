"""Hugging Face safetensors import/export.

The fixtures in tests/fixtures/hf/ were written by transformers itself
(experiments/make_hf_fixtures.py, make_gemma_fixtures.py,
make_family_fixtures.py): tiny random checkpoints and the float32 logits
transformers computed. Loading them needs no torch. The export tests that
load our files back into transformers (every fixture's, and random models')
skip when torch is not installed; the round trips through our own reader,
and the check that an export's config.json says what transformers' own
said, in the same JSON types, do not need it.
"""

import dataclasses
import functools
import json
import pathlib
import shutil

import flax.linen as nn
import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors import numpy as safetensors_np

from jaxrlhf.models import family
from jaxrlhf.models import gpt_neox
from jaxrlhf.models import hf_io
from jaxrlhf.models import llama
from jaxrlhf.models import registry
from jaxrlhf.models import sampling
from jaxrlhf.models import t5
from jaxrlhf.models.layers import rotary

HF_FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "hf"
DECODER_ONLY = ("llama_gqa", "llama_tied", "pythia", "neox_sequential",
                "neox_odd_rotary", "llama3_rope", "qwen2", "qwen3", "gemma3",
                "mistral")
# Tested on their own in test_gemma.py, exported here too.
GEMMA2 = ("gemma2", "gemma2_odd")
ENCODER_DECODER = ("t5_gated", "t5_relu_tied", "t5_tied")


@functools.lru_cache(maxsize=None)
def _jitted_apply(config):
  return jax.jit(registry.module_for_config(config).apply)


def _logits(config, params, inputs):
  """Logits and the [batch, length] mask of positions that are real."""
  apply = _jitted_apply(config)
  if "encoder_input_tokens" in inputs:
    logits = apply({"params": params}, inputs["encoder_input_tokens"],
                   inputs["decoder_input_tokens"],
                   inputs["decoder_target_tokens"])
    return np.asarray(logits, np.float32), inputs["decoder_target_tokens"] > 0
  logits = apply({"params": params}, inputs["tokens"], inputs["positions"],
                 inputs["attention_mask"])
  return np.asarray(logits), inputs["attention_mask"] == 1


def _expected(name):
  return dict(np.load(HF_FIXTURES / name / "expected.npz"))


def _equal_trees(a, b):
  flat_a, flat_b = family.flat_paths(a), family.flat_paths(b)  # pylint: disable=protected-access
  assert sorted(flat_a) == sorted(flat_b)
  for key in flat_a:
    assert flat_a[key].dtype == flat_b[key].dtype, key
    np.testing.assert_array_equal(flat_a[key], flat_b[key], err_msg=key)


# ----------------------------------------------------------------------------
# Import parity with transformers' logits (no torch needed).

@pytest.mark.parametrize("name", DECODER_ONLY + ENCODER_DECODER)
def test_logits_match_transformers(name):
  config, params = hf_io.load_hf_checkpoint(HF_FIXTURES / name)
  expected = _expected(name)
  logits, real = _logits(config, params, expected)
  assert real.sum() < real.size  # padding is exercised
  np.testing.assert_allclose(logits[real], expected["logits"][real],
                             atol=1e-5, rtol=1e-5)


def test_fixture_configs_translate_as_written():
  config, _ = hf_io.load_hf_checkpoint(HF_FIXTURES / "llama_gqa")
  assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 8)
  assert config.rope_scaling == rotary.RopeScaling("llama3", 8.0, 1.0, 4.0, 16)
  assert config.rope_theta == 500000.0 and not config.tie_embeddings
  config, params = hf_io.load_hf_checkpoint(HF_FIXTURES / "llama_tied")
  assert config.tie_embeddings and config.head_dim == 16
  assert "logits_dense" not in params["decoder"]
  config, _ = hf_io.load_hf_checkpoint(HF_FIXTURES / "neox_sequential")
  assert (config.rotary_pct, config.rope_theta) == (0.5, 1000.0)
  assert not config.use_parallel_residual
  config, params = hf_io.load_hf_checkpoint(HF_FIXTURES / "t5_gated")
  assert config.mlp_activations == ("gelu", "linear")
  assert not config.logits_via_embedding
  assert (config.relpos_num_buckets, config.relpos_max_distance) == (8, 16)
  assert (config.num_encoder_layers, config.num_decoder_layers) == (2, 1)
  config, params = hf_io.load_hf_checkpoint(HF_FIXTURES / "t5_relu_tied")
  assert config.mlp_activations == ("relu",) and config.logits_via_embedding
  assert "logits_dense" not in params["decoder"]
  assert "wi" in params["encoder"]["layers_0"]["mlp"]


def test_scanned_bfloat16_import():
  name = "llama_gqa"
  expected = _expected(name)
  config, params = hf_io.load_hf_checkpoint(
      HF_FIXTURES / name, scan_layers=True, dtype="bfloat16")
  assert config.scan_layers and config.dtype == "bfloat16"
  assert params["decoder"]["layers"]["pre_mlp_layer_norm"]["scale"].shape == (
      config.num_layers, config.emb_dim)
  assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype(np.float32)}
  logits, real = _logits(config, params, expected)
  scale = np.abs(expected["logits"][real]).max()
  assert np.abs(logits[real] - expected["logits"][real]).max() < 0.05 * scale


# ----------------------------------------------------------------------------
# The T5 mapping lands exactly on t5x's tree.

def _hf_t5_names_and_shapes(vocab, d, heads, head_dim, mlp, n_enc, n_dec):
  """HF T5ForConditionalGeneration state-dict names (T5 1.1, untied), as
  listed by transformers' T5 modules: torch Linear weights are [out, in]."""
  inner = heads * head_dim
  out = {"shared.weight": (vocab, d), "lm_head.weight": (vocab, d),
         "encoder.final_layer_norm.weight": (d,),
         "decoder.final_layer_norm.weight": (d,)}
  for stack, n in (("encoder", n_enc), ("decoder", n_dec)):
    out[f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias."
        "weight"] = (32, heads)
    for i in range(n):
      sub = ["SelfAttention"] + (["EncDecAttention"] if stack == "decoder"
                                 else [])
      for j, att in enumerate(sub):
        p = f"{stack}.block.{i}.layer.{j}."
        out.update({p + f"{att}.{x}.weight": (inner, d) for x in "qkv"})
        out[p + f"{att}.o.weight"] = (d, inner)
        out[p + "layer_norm.weight"] = (d,)
      p = f"{stack}.block.{i}.layer.{len(sub)}."
      out[p + "DenseReluDense.wi_0.weight"] = (mlp, d)
      out[p + "DenseReluDense.wi_1.weight"] = (mlp, d)
      out[p + "DenseReluDense.wo.weight"] = (d, mlp)
      out[p + "layer_norm.weight"] = (d,)
  return out


def test_t5_mapping_matches_t5x_parameter_tree(t5x_fixtures):
  t5x = json.loads((t5x_fixtures / "encdec" / "config.json").read_text())
  c = t5x["T5Config"]
  hf_shapes = _hf_t5_names_and_shapes(
      c["vocab_size"], c["emb_dim"], c["num_heads"], c["head_dim"],
      c["mlp_dim"], c["num_encoder_layers"], c["num_decoder_layers"])
  rng = np.random.default_rng(0)
  tensors = {n: rng.normal(size=s).astype(np.float32)
             for n, s in hf_shapes.items()}
  hf_config = {"architectures": ["T5ForConditionalGeneration"],
               "vocab_size": c["vocab_size"], "d_model": c["emb_dim"],
               "num_heads": c["num_heads"], "d_kv": c["head_dim"],
               "d_ff": c["mlp_dim"], "num_layers": c["num_encoder_layers"],
               "num_decoder_layers": c["num_decoder_layers"],
               "feed_forward_proj": "gated-gelu",
               "tie_word_embeddings": False}
  config = hf_io.config_from_hf(hf_config)
  config, params = hf_io.from_hf_tensors(config, tensors)
  ours = {k: list(v.shape) for k, v in family.flat_paths(params).items()}  # pylint: disable=protected-access
  assert ours == {k: v["shape"] for k, v in t5x["params"].items()}
  # Transposes: torch [out, in] -> t5x [in, out]; relpos [buckets, heads] ->
  # [heads, buckets].
  np.testing.assert_array_equal(
      params["encoder"]["layers_1"]["attention"]["query"]["kernel"],
      tensors["encoder.block.1.layer.0.SelfAttention.q.weight"].T)
  np.testing.assert_array_equal(
      params["decoder"]["relpos_bias"]["rel_embedding"],
      tensors["decoder.block.0.layer.0.SelfAttention.relative_attention_bias."
              "weight"].T)
  np.testing.assert_array_equal(
      params["decoder"]["layers_0"]["mlp"]["wo"]["kernel"],
      tensors["decoder.block.0.layer.2.DenseReluDense.wo.weight"].T)


# ----------------------------------------------------------------------------
# Config translation of published config.json files (transformers 4.x keys).

def test_published_configs_translate_to_presets():
  llama32_1b = {
      "architectures": ["LlamaForCausalLM"], "attention_bias": False,
      "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
      "intermediate_size": 8192, "max_position_embeddings": 131072,
      "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
      "num_hidden_layers": 16, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
      "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0,
                       "low_freq_factor": 1.0,
                       "original_max_position_embeddings": 8192,
                       "rope_type": "llama3"},
      "rope_theta": 500000.0, "tie_word_embeddings": True,
      "torch_dtype": "bfloat16", "vocab_size": 128256}
  assert hf_io.config_from_hf(llama32_1b) == llama.LlamaConfig.preset(
      "llama3.2-1b")
  llama2_7b = {  # no head_dim, no num_key_value_heads in old files
      "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
      "hidden_size": 4096, "intermediate_size": 11008,
      "max_position_embeddings": 4096, "num_attention_heads": 32,
      "num_hidden_layers": 32, "rms_norm_eps": 1e-05, "rope_scaling": None,
      "tie_word_embeddings": False, "vocab_size": 32000}
  assert hf_io.config_from_hf(llama2_7b) == llama.LlamaConfig.preset(
      "llama2-7b")
  pythia_1b = {
      "architectures": ["GPTNeoXForCausalLM"], "hidden_act": "gelu",
      "hidden_size": 2048, "intermediate_size": 8192,
      "layer_norm_eps": 1e-05, "max_position_embeddings": 2048,
      "model_type": "gpt_neox", "num_attention_heads": 8,
      "num_hidden_layers": 16, "rotary_emb_base": 10000, "rotary_pct": 0.25,
      "tie_word_embeddings": False, "use_parallel_residual": True,
      "vocab_size": 50304}
  assert hf_io.config_from_hf(pythia_1b) == gpt_neox.GPTNeoXConfig.preset(
      "pythia-1b")
  flan_t5_small = {
      "architectures": ["T5ForConditionalGeneration"], "d_ff": 1024,
      "d_kv": 64, "d_model": 512, "feed_forward_proj": "gated-gelu",
      "layer_norm_epsilon": 1e-06, "num_decoder_layers": 8, "num_heads": 6,
      "num_layers": 8, "relative_attention_max_distance": 128,
      "relative_attention_num_buckets": 32, "tie_word_embeddings": False,
      "vocab_size": 32128}
  assert hf_io.config_from_hf(flan_t5_small) == t5.t5_config(
      "small", mlp_activations=("gelu", "linear"), logits_via_embedding=False)
  t5_small = {  # T5 1.0: ReLU, tie_word_embeddings absent (= tied, scaled)
      "architectures": ["T5ForConditionalGeneration"], "d_ff": 2048,
      "d_kv": 64, "d_model": 512, "num_heads": 8, "num_layers": 6,
      "vocab_size": 32128}
  config = hf_io.config_from_hf(t5_small)
  assert config.mlp_activations == ("relu",) and config.logits_via_embedding
  assert config.num_decoder_layers == 6


# ----------------------------------------------------------------------------
# Export.

@pytest.mark.parametrize("name", DECODER_ONLY + ENCODER_DECODER)
def test_export_reproduces_the_transformers_file(name, tmp_path):
  """import -> export gives back the tensors transformers wrote, bit for bit,
  and importing the export gives the same config and parameters."""
  config, params = hf_io.load_hf_checkpoint(HF_FIXTURES / name)
  hf_io.export_hf_checkpoint(config, params, tmp_path)
  original = hf_io.read_safetensors(HF_FIXTURES / name)
  exported = hf_io.read_safetensors(tmp_path)
  assert sorted(exported) == sorted(original)
  for key, value in original.items():
    assert exported[key].dtype == value.dtype
    np.testing.assert_array_equal(exported[key], value, err_msg=key)
  config2, params2 = hf_io.load_hf_checkpoint(tmp_path)
  assert config2 == config
  _equal_trees(params2, params)


@functools.lru_cache(maxsize=None)
def _random_model(kind):
  """(config, params, inputs) of a randomly initialised model of ours
  (cached: the tests only read them)."""
  rng = np.random.default_rng(7)
  if kind == "t5":
    config = t5.T5Config(vocab_size=64, emb_dim=16, num_heads=2,
                         num_encoder_layers=1, num_decoder_layers=2,
                         head_dim=8, mlp_dim=24, mlp_activations=("relu",),
                         logits_via_embedding=True)
    target = rng.integers(2, 64, size=(2, 5)).astype(np.int32)
    target[1, 3:] = 0
    inputs = {"encoder_input_tokens": rng.integers(1, 64, size=(2, 6)),
              "decoder_input_tokens": np.pad(target[:, :-1], ((0, 0), (1, 0))),
              "decoder_target_tokens": target}
    inputs = {k: np.asarray(v, np.int32) for k, v in inputs.items()}
    init_args = (inputs["encoder_input_tokens"],
                 inputs["decoder_input_tokens"],
                 inputs["decoder_target_tokens"])
  else:
    if kind == "llama":
      config = llama.LlamaConfig.preset(
          "tiny", scan_layers=True, vocab_size=64,
          rope_scaling=rotary.RopeScaling("linear", 2.0))
    else:
      config = gpt_neox.GPTNeoXConfig.preset("tiny", vocab_size=64)
    mask = np.ones((2, 6), np.int32)
    mask[1, :2] = 0
    inputs = {"tokens": rng.integers(2, 64, size=(2, 6)).astype(np.int32),
              "attention_mask": mask,
              "positions": np.asarray(rotary.positions_from_mask(mask))}
    init_args = (inputs["tokens"], inputs["positions"],
                 inputs["attention_mask"])
  variables = jax.jit(registry.module_for_config(config).init)(
      jax.random.PRNGKey(3), *init_args)
  # Noise on every leaf: init's ones and zeros would hide swapped tensors.
  params = jax.tree.map(
      lambda x: x + 0.3 * rng.normal(size=x.shape).astype(np.float32),
      nn.meta.unbox(variables["params"]))
  return config, params, inputs


@pytest.mark.parametrize("kind", ["llama", "gpt_neox", "t5"])
def test_export_round_trips_through_our_reader(kind, tmp_path):
  config, params, _ = _random_model(kind)
  # The Llama model is scanned; the file does not say so, the reader is told.
  overrides = {"scan_layers": True} if kind == "llama" else {}
  hf_io.export_hf_checkpoint(config, params, tmp_path / "single")
  config2, params2 = hf_io.load_hf_checkpoint(tmp_path / "single", **overrides)
  assert config2 == config
  _equal_trees(params2, jax.tree.map(np.asarray, params))

  # Sharded, in bfloat16: the shards and index are what is read back.
  hf_io.export_hf_checkpoint(config, params, tmp_path / "sharded",
                             dtype="bfloat16", max_shard_bytes=4096)
  index = json.loads(
      (tmp_path / "sharded" / hf_io.INDEX_FILE).read_text())
  assert len(set(index["weight_map"].values())) > 2
  assert not (tmp_path / "sharded" / hf_io.SINGLE_FILE).exists()
  assert json.loads((tmp_path / "sharded" / "config.json").read_text())[
      "torch_dtype"] == "bfloat16"
  _, params3 = hf_io.load_hf_checkpoint(tmp_path / "sharded", **overrides)
  rounded = jax.tree.map(
      lambda x: np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32),
      params)
  _equal_trees(params3, rounded)


@pytest.mark.parametrize("kind", ["llama", "gpt_neox", "t5"])
def test_transformers_loads_our_export(kind, tmp_path):
  torch = pytest.importorskip("torch", reason="torch is not installed; "
                              "`pip install torch==2.13.0 transformers`")
  transformers = pytest.importorskip("transformers")
  config, params, inputs = _random_model(kind)
  ours, real = _logits(config, params, inputs)
  hf_io.export_hf_checkpoint(config, params, tmp_path)
  as_torch = {k: torch.from_numpy(np.array(v)).long()
              for k, v in inputs.items()}
  if kind == "t5":
    model = transformers.T5ForConditionalGeneration.from_pretrained(
        tmp_path, attn_implementation="eager")
    with torch.no_grad():
      theirs = model(
          input_ids=as_torch["encoder_input_tokens"],
          attention_mask=(as_torch["encoder_input_tokens"] > 0).long(),
          decoder_input_ids=as_torch["decoder_input_tokens"],
          decoder_attention_mask=(
              as_torch["decoder_target_tokens"] > 0).long()).logits
  else:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager")
    with torch.no_grad():
      theirs = model(input_ids=as_torch["tokens"],
                     attention_mask=as_torch["attention_mask"],
                     position_ids=as_torch["positions"]).logits
  theirs = theirs.float().numpy()
  np.testing.assert_allclose(ours[real], theirs[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", DECODER_ONLY + GEMMA2)
def test_exported_config_says_what_transformers_wrote(name, tmp_path):
  """Every key of the export's config.json that transformers' own file has
  holds the same value in the same JSON type (transformers 5 validates the
  types: a float where it wants an int is refused)."""
  config, params = hf_io.load_hf_checkpoint(HF_FIXTURES / name)
  hf_io.export_hf_checkpoint(config, params, tmp_path)
  written = hf_io.read_hf_config(HF_FIXTURES / name)
  exported = hf_io.read_hf_config(tmp_path)
  shared = sorted(written.keys() & exported.keys())
  assert "vocab_size" in shared
  for key in shared:
    assert (exported[key], type(exported[key])) == (
        written[key], type(written[key])), key


@pytest.mark.parametrize("name", DECODER_ONLY + GEMMA2 + ENCODER_DECODER)
def test_transformers_loads_the_export_of_every_fixture(name, tmp_path):
  """import -> export -> transformers' own from_pretrained computes the
  logits transformers computed from its file."""
  torch = pytest.importorskip("torch", reason="torch is not installed; "
                              "`pip install torch==2.13.0 transformers`")
  transformers = pytest.importorskip("transformers")
  config, params = hf_io.load_hf_checkpoint(HF_FIXTURES / name)
  hf_io.export_hf_checkpoint(config, params, tmp_path)
  e = {k: torch.from_numpy(v).long() if v.dtype.kind == "i" else v
       for k, v in _expected(name).items()}
  with torch.no_grad():
    if name in ENCODER_DECODER:
      model = transformers.T5ForConditionalGeneration.from_pretrained(
          tmp_path, attn_implementation="eager")
      real = e["decoder_target_tokens"].numpy() > 0
      logits = model(
          input_ids=e["encoder_input_tokens"],
          attention_mask=(e["encoder_input_tokens"] > 0).long(),
          decoder_input_ids=e["decoder_input_tokens"],
          decoder_attention_mask=(e["decoder_target_tokens"] > 0).long()
      ).logits
    else:
      model = transformers.AutoModelForCausalLM.from_pretrained(
          tmp_path, attn_implementation="eager")
      assert type(model).__name__ == hf_io.config_to_hf(config)[
          "architectures"][0]
      real = e["attention_mask"].numpy() == 1
      logits = model(input_ids=e["tokens"], attention_mask=e["attention_mask"],
                     position_ids=e["positions"]).logits
  np.testing.assert_allclose(logits.float().numpy()[real],
                             e["logits"][real], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["llama_gqa", "pythia"])
def test_export_keeps_the_generation_ids(name, tmp_path):
  """The tokenizer ids transformers' generate stops and pads with survive
  import -> export -> import, in config.json and generation_config.json."""
  written = hf_io.read_hf_config(HF_FIXTURES / name)
  config, params = hf_io.load_hf_checkpoint(HF_FIXTURES / name)
  assert (config.bos_token_id, config.eos_token_id) == (
      written["bos_token_id"], written["eos_token_id"])
  hf_io.export_hf_checkpoint(config, params, tmp_path)
  exported = json.loads((tmp_path / "config.json").read_text())
  generation = json.loads((tmp_path / "generation_config.json").read_text())
  for key in ("bos_token_id", "eos_token_id"):
    assert exported[key] == generation[key] == written[key], key
  assert hf_io.load_hf_checkpoint(tmp_path)[0] == config


def test_transformers_generate_on_our_export_stops_where_ours_does(tmp_path):
  torch = pytest.importorskip("torch", reason="torch is not installed; "
                              "`pip install torch==2.13.0 transformers`")
  transformers = pytest.importorskip("transformers")
  config, params = hf_io.load_hf_checkpoint(HF_FIXTURES / "llama_gqa")
  g = dict(np.load(HF_FIXTURES / "llama_gqa" / "generate.npz"))
  # The id the fixture's first prompt reaches greedily (its third token).
  config = dataclasses.replace(config, eos_token_id=int(g["eos_id"]),
                               pad_token_id=0)
  hf_io.export_hf_checkpoint(config, params, tmp_path)
  ours = sampling.sample_decoder_only(
      registry.module_for_config(config), params, g["prompt_tokens"],
      g["prompt_attention_mask"], jax.random.PRNGKey(0),
      int(g["max_new_tokens"]), greedy=True, eos_id=config.eos_token_id)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, attn_implementation="eager")
  with torch.no_grad():
    # No eos or pad argument: generate reads them from the export.
    out = model.generate(
        input_ids=torch.from_numpy(g["prompt_tokens"]).long(),
        attention_mask=torch.from_numpy(g["prompt_attention_mask"]).long(),
        max_new_tokens=int(g["max_new_tokens"]), do_sample=False)
  theirs = out[:, g["prompt_tokens"].shape[1]:].numpy()
  ours = np.asarray(ours.tokens)
  assert ours[0].tolist()[:3] == theirs[0].tolist()[:3]
  assert theirs[0, 2] == config.eos_token_id  # it stopped there: pads after
  np.testing.assert_array_equal(theirs[0, 3:], 0)
  np.testing.assert_array_equal(ours, np.pad(
      theirs, ((0, 0), (0, ours.shape[1] - theirs.shape[1]))))


# ----------------------------------------------------------------------------
# Errors name what is wrong.

def _copy_fixture(name, tmp_path):
  dst = tmp_path / name
  shutil.copytree(HF_FIXTURES / name, dst)
  return dst


def _rewrite_tensors(path, edit):
  tensors = edit(dict(safetensors_np.load_file(path / hf_io.SINGLE_FILE)))
  safetensors_np.save_file(tensors, path / hf_io.SINGLE_FILE,
                           metadata={"format": "pt"})


def test_unsupported_architecture(tmp_path):
  path = _copy_fixture("pythia", tmp_path)
  config = json.loads((path / "config.json").read_text())
  config.update(architectures=["BertForMaskedLM"], model_type="bert")
  (path / "config.json").write_text(json.dumps(config))
  with pytest.raises(hf_io.HFCheckpointError,
                     match=r"Unsupported architecture.*BertForMaskedLM.*"
                     r"LlamaForCausalLM"):
    hf_io.load_hf_checkpoint(path)


def test_unsupported_option_is_named(tmp_path):
  path = _copy_fixture("llama_tied", tmp_path)
  config = json.loads((path / "config.json").read_text())
  config["attention_bias"] = True
  (path / "config.json").write_text(json.dumps(config))
  with pytest.raises(hf_io.HFCheckpointError, match="attention_bias"):
    hf_io.load_hf_checkpoint(path)


def test_missing_weights_are_named(tmp_path):
  path = _copy_fixture("llama_gqa", tmp_path)
  gone = ("model.layers.1.mlp.up_proj.weight", "lm_head.weight")
  _rewrite_tensors(path, lambda t: {k: v for k, v in t.items()
                                    if k not in gone})
  with pytest.raises(hf_io.HFCheckpointError) as error:
    hf_io.load_hf_checkpoint(path)
  assert "missing weights (2)" in str(error.value)
  for name in gone:
    assert name in str(error.value)


def test_shape_mismatch_names_tensor_and_shapes(tmp_path):
  path = _copy_fixture("pythia", tmp_path)
  name = "gpt_neox.layers.0.attention.query_key_value.weight"
  _rewrite_tensors(path, lambda t: {**t, name: t[name][:90]})
  with pytest.raises(hf_io.HFCheckpointError,
                     match=rf"{name}: expected \(96, 32\), found \(90, 32\)"):
    hf_io.load_hf_checkpoint(path)


def test_unexpected_weights_are_named(tmp_path):
  path = _copy_fixture("llama_tied", tmp_path)
  name = "model.layers.0.self_attn.q_proj.bias"
  _rewrite_tensors(path, lambda t: {**t, name: np.zeros(64, np.float32)})
  with pytest.raises(hf_io.HFCheckpointError, match=rf"unexpected.*{name}"):
    hf_io.load_hf_checkpoint(path)


def test_missing_files_are_explained(tmp_path):
  with pytest.raises(hf_io.HFCheckpointError, match="No config.json"):
    hf_io.load_hf_checkpoint(tmp_path)
  shutil.copy(HF_FIXTURES / "pythia" / "config.json", tmp_path)
  (tmp_path / "pytorch_model.bin").write_bytes(b"")
  with pytest.raises(hf_io.HFCheckpointError, match="safe_serialization"):
    hf_io.load_hf_checkpoint(tmp_path)


def test_export_checks_params_and_refuses_to_clobber(tmp_path):
  config, params = hf_io.load_hf_checkpoint(HF_FIXTURES / "llama_tied")
  broken = jax.tree.map(lambda x: x, params)
  del broken["decoder"]["layers_0"]["mlp"]["wo"]
  with pytest.raises(hf_io.HFCheckpointError,
                     match="missing parameters: decoder/layers_0/mlp/wo/kernel"):
    hf_io.export_hf_checkpoint(config, broken, tmp_path / "a")
  hf_io.export_hf_checkpoint(config, params, tmp_path / "b")
  with pytest.raises(FileExistsError, match="overwrite=True"):
    hf_io.export_hf_checkpoint(config, params, tmp_path / "b")
  hf_io.export_hf_checkpoint(config, params, tmp_path / "b", overwrite=True)


def test_t5_output_layer_variants():
  """transformers 5 ties T5 1.1's lm_head without scaling (file lacks it):
  it stays tied (one matrix, no logits_dense copy) and computes h @ E^T; a
  tied, scaled config whose file has a different lm_head computes
  (h * d**-0.5) @ lm_head^T, which t5x expresses as a scaled logits_dense."""
  gated_config = hf_io.read_hf_config(HF_FIXTURES / "t5_gated")
  tensors = hf_io.read_safetensors(HF_FIXTURES / "t5_gated")
  del tensors["lm_head.weight"]
  config, params = hf_io.from_hf_tensors(hf_io.config_from_hf(gated_config),
                                         tensors)
  assert config.logits_via_embedding and not config.scale_tied_logits
  assert "logits_dense" not in params["decoder"]
  # The same numbers as an untied model whose output matrix is E^T.
  untied = dataclasses.replace(config, logits_via_embedding=False)
  untied_params = {**params, "decoder": {
      **params["decoder"],
      "logits_dense": {"kernel": tensors["shared.weight"].T}}}
  tokens = np.array([[5, 9, 3, 1]], np.int32)
  np.testing.assert_allclose(
      _jitted_apply(config)({"params": params}, tokens, tokens),
      _jitted_apply(untied)({"params": untied_params}, tokens, tokens),
      rtol=1e-6)

  tied_config = hf_io.read_hf_config(HF_FIXTURES / "t5_relu_tied")
  tensors = hf_io.read_safetensors(HF_FIXTURES / "t5_relu_tied")
  head = np.random.default_rng(0).normal(
      size=tensors["shared.weight"].shape).astype(np.float32)
  config, params = hf_io.from_hf_tensors(
      hf_io.config_from_hf(tied_config), {**tensors, "lm_head.weight": head})
  assert not config.logits_via_embedding
  np.testing.assert_allclose(params["decoder"]["logits_dense"]["kernel"],
                             head.T / np.sqrt(config.emb_dim), rtol=1e-6)
  # An lm_head equal to the embedding stays tied.
  config, params = hf_io.from_hf_tensors(
      hf_io.config_from_hf(tied_config),
      {**tensors, "lm_head.weight": tensors["shared.weight"]})
  assert config.logits_via_embedding and "logits_dense" not in params["decoder"]
