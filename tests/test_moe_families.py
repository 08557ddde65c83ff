"""Qwen3-MoE and Mixtral against transformers, on the fixtures transformers
made (experiments/make_family_fixtures.py; tests/fixtures/hf/qwen3_moe and
mixtral): logits, each MoE layer's router logits and the load-balancing
loss, greedy generation through the KV cache, the export (the same file
back, and transformers' own reading of it), the layers that have experts
by transformers' rule, the published configs and parameter counts, the
errors of impossible configs, and SFT through `python -m jaxrlhf.main`.
"""

import dataclasses
import functools
import json
import math
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import REPO, TINY_OVERRIDES, quiet_env
from jaxrlhf.models import hf_io
from jaxrlhf.models import mixtral
from jaxrlhf.models import moe_decoder
from jaxrlhf.models import qwen3_moe
from jaxrlhf.models import registry
from jaxrlhf.models import sampling
from jaxrlhf.models.layers import attentions

HF_FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "hf"
FIXTURES = ("qwen3_moe", "mixtral")
SLIDING, FULL = attentions.SLIDING_ATTENTION, attentions.FULL_ATTENTION


@functools.lru_cache(maxsize=None)
def _loaded(name, **overrides):
  return hf_io.load_hf_checkpoint(HF_FIXTURES / name, **overrides)


def _npz(name, file):
  return dict(np.load(HF_FIXTURES / name / file))


def _forward(name, config, params):
  """(logits, sown router logits [moe layers, batch, length, experts],
  load-balancing loss) of expected.npz's inputs."""
  e = _npz(name, "expected.npz")
  module = registry.module_for_config(config)
  logits, state = jax.jit(functools.partial(
      module.apply, mutable=[moe_decoder.INTERMEDIATES]))(
          {"params": params}, e["tokens"], e["positions"],
          e["attention_mask"])
  inter = state[moe_decoder.INTERMEDIATES]
  return (np.asarray(logits), np.asarray(moe_decoder.router_logits(inter)),
          float(moe_decoder.load_balancing_loss(config, inter,
                                                e["attention_mask"])))


def _logit_error(name, config, params):
  e = _npz(name, "expected.npz")
  real = e["attention_mask"] == 1
  logits, _, _ = _forward(name, config, params)
  return np.abs(logits[real] - e["logits"][real]).max()


def test_configs_read_the_fixtures():
  config, params = _loaded("qwen3_moe")
  assert isinstance(config, qwen3_moe.Qwen3MoeConfig)
  assert (config.num_experts, config.num_experts_per_tok,
          config.expert_mlp_dim, config.mlp_dim) == (4, 2, 16, 48)
  assert not config.norm_topk_prob and config.mlp_only_layers == (1,)
  assert config.sparse_layers == (True, False, True)
  layers = params["decoder"]
  assert layers["layers_0"]["mlp"]["wi_0"].shape == (4, 32, 16)
  assert layers["layers_0"]["mlp"]["router"]["kernel"].shape == (32, 4)
  assert layers["layers_1"]["mlp"]["wi_0"]["kernel"].shape == (32, 48)
  assert layers["layers_2"]["self_attention"]["key_norm"]["scale"].shape == (
      16,)
  config, params = _loaded("mixtral")
  assert isinstance(config, mixtral.MixtralConfig)
  assert config.sliding_window == 3 and config.attention_types == (SLIDING,) * 2
  assert config.sparse_layers == (True, True) and config.norm_topk_prob
  assert params["decoder"]["layers_1"]["mlp"]["wo"].shape == (4, 24, 32)


@pytest.mark.parametrize("name", FIXTURES)
def test_logits_router_logits_and_aux_loss_match_transformers(name):
  e, r = _npz(name, "expected.npz"), _npz(name, "router.npz")
  real = e["attention_mask"] == 1
  logits, router, aux = _forward(name, *_loaded(name))
  np.testing.assert_allclose(logits[real], e["logits"][real], atol=2e-5)
  assert router.shape == r["router_logits"].shape
  np.testing.assert_allclose(router[:, real], r["router_logits"][:, real],
                             atol=1e-5)
  # transformers' aux_loss over the real tokens, unscaled.
  assert aux == pytest.approx(float(r["aux_loss"]), rel=1e-5)


def test_scanned_mixtral_computes_the_same_and_sows_per_layer():
  """One scanned layer body: the logits, and the router logits stacked
  [layers, ...] by the scan."""
  name = "mixtral"
  config, params = _loaded(name, scan_layers=True)
  assert "layers" in params["decoder"]
  e, r = _npz(name, "expected.npz"), _npz(name, "router.npz")
  real = e["attention_mask"] == 1
  logits, router, aux = _forward(name, config, params)
  np.testing.assert_allclose(logits[real], e["logits"][real], atol=2e-5)
  np.testing.assert_allclose(router[:, real], r["router_logits"][:, real],
                             atol=1e-5)
  assert aux == pytest.approx(float(r["aux_loss"]), rel=1e-5)


def test_the_aux_loss_trains_the_routers_through_remat():
  """The load-balancing loss of a rematerialised model, differentiated: it
  reaches every router, and not the last MoE layer's experts (no router
  reads their output)."""
  name = "qwen3_moe"
  config, params = _loaded(name, remat_policy="full")
  e = _npz(name, "expected.npz")
  module = registry.module_for_config(config)

  def aux(p):
    _, state = module.apply({"params": p}, e["tokens"], e["positions"],
                            e["attention_mask"],
                            mutable=[moe_decoder.INTERMEDIATES])
    return moe_decoder.load_balancing_loss(
        config, state[moe_decoder.INTERMEDIATES], e["attention_mask"])
  grads = jax.grad(aux)(params)["decoder"]
  for i in (0, 2):
    assert np.abs(grads[f"layers_{i}"]["mlp"]["router"]["kernel"]).sum() > 0
  assert np.abs(grads["layers_0"]["mlp"]["wi_0"]).sum() > 0
  for w in ("wi_0", "wi_1", "wo"):
    assert not np.any(grads["layers_2"]["mlp"][w])


@pytest.mark.parametrize("name", FIXTURES)
def test_greedy_generation_matches_transformers(name):
  # 6 prompt positions and 8 new tokens through the KV cache, every token
  # routed again at each step; past Mixtral's window of 3.
  config, params = _loaded(name)
  g = _npz(name, "generate.npz")
  samples = sampling.sample_decoder_only(
      registry.module_for_config(config), params, g["prompt_tokens"],
      g["prompt_attention_mask"], jax.random.PRNGKey(0),
      int(g["max_new_tokens"]), greedy=True, eos_id=int(g["eos_id"]))
  np.testing.assert_array_equal(np.asarray(samples.tokens), g["generated"])


@pytest.mark.parametrize("name, change", [
    ("qwen3_moe", dict(norm_topk_prob=True)),
    ("qwen3_moe", dict(num_experts_per_tok=1)),
    ("mixtral", dict(num_experts_per_tok=1)),
    ("mixtral", dict(sliding_window=None)),
])
def test_the_fixtures_exercise_each_detail(name, change):
  """Without any one of them the logits are not transformers'."""
  config, params = _loaded(name)
  assert _logit_error(name, dataclasses.replace(config, **change),
                      params) > 1e-2


# ----------------------------------------------------------------------------
# Export.

@pytest.mark.parametrize("name", FIXTURES)
def test_export_reproduces_the_transformers_file(name):
  """import -> export gives back the tensors transformers wrote (the
  per-expert layout of published checkpoints), bit for bit."""
  config, params = _loaded(name)
  original = hf_io.read_safetensors(HF_FIXTURES / name)
  exported = hf_io.to_hf_tensors(config, params)
  assert sorted(exported) == sorted(original)
  for key, value in original.items():
    np.testing.assert_array_equal(exported[key], value, err_msg=key)


@pytest.mark.parametrize("name", FIXTURES)
def test_fused_expert_tensors_read_as_the_per_expert_ones(name):
  """transformers 5's in-memory layout (its checkpoint conversion: each
  projection's experts stacked, gate and up concatenated on the output
  axis, the router under mlp.gate) reads to the same parameters."""
  config, params = _loaded(name)
  names = {"qwen3_moe": qwen3_moe.NAMES, "mixtral": mixtral.NAMES}[name]
  tensors = dict(hf_io.read_safetensors(HF_FIXTURES / name))
  for i, sparse in enumerate(config.sparse_layers):
    if not sparse:
      continue
    block = f"model.layers.{i}.{names.block}."
    per = {proj: np.stack([tensors.pop(f"{block}experts.{e}.{proj}.weight")
                           for e in range(config.num_experts)])
           for proj in (names.gate, names.up, names.down)}
    router = tensors.pop(block + "gate.weight")
    fused = f"model.layers.{i}.mlp."
    tensors[fused + "gate.weight"] = router
    tensors[fused + "experts.gate_up_proj"] = np.concatenate(
        [per[names.gate], per[names.up]], axis=1)
    tensors[fused + "experts.down_proj"] = per[names.down]
  _, fused_params = hf_io.from_hf_tensors(config, tensors)
  jax.tree.map(np.testing.assert_array_equal, fused_params, params)


@pytest.mark.parametrize("name", FIXTURES)
def test_exported_config_says_what_transformers_wrote(name, tmp_path):
  config, params = _loaded(name)
  hf_io.export_hf_checkpoint(config, params, tmp_path)
  written = hf_io.read_hf_config(HF_FIXTURES / name)
  exported = hf_io.read_hf_config(tmp_path)
  shared = sorted(written.keys() & exported.keys())
  assert {"num_experts_per_tok", "router_aux_loss_coef"} <= set(shared)
  if written["head_dim"] is None:  # Mixtral's default: hidden / heads
    assert exported.pop("head_dim") == config.emb_dim // config.num_heads
    shared.remove("head_dim")
  for key in shared:
    assert (exported[key], type(exported[key])) == (
        written[key], type(written[key])), key


@pytest.mark.parametrize("name", FIXTURES)
def test_transformers_loads_our_export(name, tmp_path):
  """import -> export -> transformers' from_pretrained computes the logits
  transformers computed from its own file."""
  torch = pytest.importorskip("torch", reason="torch is not installed; "
                              "`pip install torch==2.13.0 transformers`")
  transformers = pytest.importorskip("transformers")
  config, params = _loaded(name)
  hf_io.export_hf_checkpoint(config, params, tmp_path)
  e = _npz(name, "expected.npz")
  model = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, attn_implementation="eager")
  assert type(model).__name__ == registry.get_family(name).hf.architecture
  with torch.no_grad():
    theirs = model(
        input_ids=torch.from_numpy(e["tokens"]).long(),
        attention_mask=torch.from_numpy(e["attention_mask"]).long(),
        position_ids=torch.from_numpy(e["positions"]).long()).logits
  real = e["attention_mask"] == 1
  np.testing.assert_allclose(theirs.float().numpy()[real], e["logits"][real],
                             atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layers, step, mlp_only", [
    (4, 1, []), (4, 2, []), (5, 3, [2]), (4, 1, [0, 3]), (6, 2, [1, 3])])
def test_the_layers_with_experts_are_transformers(layers, step, mlp_only):
  torch = pytest.importorskip("torch", reason="torch is not installed")
  transformers = pytest.importorskip("transformers")
  del torch
  hf = dict(vocab_size=16, hidden_size=8, intermediate_size=8,
            moe_intermediate_size=4, num_experts=2, num_experts_per_tok=1,
            num_hidden_layers=layers, num_attention_heads=2,
            num_key_value_heads=1, head_dim=4, decoder_sparse_step=step,
            mlp_only_layers=mlp_only)
  model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**hf))
  theirs = tuple(type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock"
                 for layer in model.model.layers)
  ours = hf_io.config_from_hf({"architectures": ["Qwen3MoeForCausalLM"],
                               **hf}).sparse_layers
  assert ours == theirs


# ----------------------------------------------------------------------------
# Published configs (their config.json) and sizes.

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4,
    "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0,
    "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768,
    "model_type": "mixtral", "num_attention_heads": 32,
    "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8,
    "output_router_logits": False, "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
    "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32000}


@pytest.mark.parametrize("published, preset, ids", [
    (QWEN3_30B_A3B, qwen3_moe.Qwen3MoeConfig.preset("qwen3-30b-a3b"),
     (151643, 151645)),
    (MIXTRAL_8X7B, mixtral.MixtralConfig.preset("mixtral-8x7b"), (1, 2)),
], ids=["qwen3-30b-a3b", "mixtral-8x7b"])
def test_published_configs_translate_to_presets(published, preset, ids):
  config = hf_io.config_from_hf(published)
  bos, eos = ids
  assert config == dataclasses.replace(preset, bos_token_id=bos,
                                       eos_token_id=eos)


@pytest.mark.parametrize("preset, published", [
    # The totals of the released checkpoints (their safetensors metadata).
    (qwen3_moe.Qwen3MoeConfig.preset("qwen3-30b-a3b"), 30_532_122_624),
    (mixtral.MixtralConfig.preset("mixtral-8x7b"), 46_702_792_704),
], ids=["qwen3-30b-a3b", "mixtral-8x7b"])
def test_presets_have_published_parameter_counts(preset, published):
  shapes = registry.param_shapes(dataclasses.replace(preset, scan_layers=True))
  assert sum(math.prod(s) for s in shapes.values()) == published


def test_impossible_configs_name_the_field_and_the_fix():
  with pytest.raises(ValueError, match="scan_layers needs one layer body.*"
                     r"layers \[1\] have a dense MLP"):
    qwen3_moe.Qwen3MoeConfig.preset("tiny", mlp_only_layers=(1,),
                                    scan_layers=True)
  with pytest.raises(ValueError, match="num_experts_per_tok=5 must be at "
                     "most num_experts=4"):
    qwen3_moe.Qwen3MoeConfig.preset("tiny", num_experts_per_tok=5)
  with pytest.raises(ValueError, match=r"mlp_only_layers: \[2\] are not "
                     "layer indices"):
    qwen3_moe.Qwen3MoeConfig.preset("tiny", mlp_only_layers=(2,))
  with pytest.raises(ValueError, match="MixtralConfig.norm_topk_prob must "
                     "be True"):
    mixtral.MixtralConfig.preset("tiny", norm_topk_prob=False)
  with pytest.raises(hf_io.HFCheckpointError, match="router_jitter_noise"):
    hf_io.config_from_hf({**MIXTRAL_8X7B, "router_jitter_noise": 0.1})
  with pytest.raises(ValueError, match="mutable=\\['intermediates'\\]"):
    moe_decoder.router_logits({})


# ----------------------------------------------------------------------------
# Training from the run config.

def test_sft_of_a_tiny_qwen3_moe_from_main(tmp_path):
  """`python -m jaxrlhf.main` trains a one-layer Qwen3-MoE (4 experts, top
  2) from scratch with SFT on the synthetic task: the loss falls."""
  overrides = {k: v for k, v in TINY_OVERRIDES.items()
               if k != "model.num_encoder_layers"}
  overrides.update({"model.arch": "qwen3_moe", "model.size": "tiny",
                    "train.num_steps": 8, "train.batch_size": 8,
                    "optimizer.warmup_steps": 0, "eval.num_examples": 8,
                    "eval.batch_size": 8})
  args = [sys.executable, "-m", "jaxrlhf.main",
          "--config=configs/quickstart.py", f"--workdir={tmp_path}",
          *[f"--config.{k}={v}" for k, v in overrides.items()]]
  result = subprocess.run(args, cwd=REPO, env=quiet_env(),
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  losses = [r["loss"] for r in rows if "loss" in r]
  assert len(losses) == 8 and all(np.isfinite(losses))
  assert np.mean(losses[-2:]) < losses[0] - 0.3
