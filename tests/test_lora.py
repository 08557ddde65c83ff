"""LoRA: adapters on a frozen base, for every algorithm (jaxrlhf/models/lora.py,
jaxrlhf/algorithms/lora_state.py).

One tiny Llama base, written as a Hugging Face folder, is what the runs
here adapt: an SFT run trains adapters on it (two steps, then a resume to
four, against four straight), a DPO run starts from that SFT run's
workdir (its policy merged), and the exports go to transformers and peft.
"""

import dataclasses
import functools
import json
import math
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import from_scratch, tiny_config, trainer_of
from jaxrlhf import algorithms
from jaxrlhf import checkpoint_files
from jaxrlhf import defaults
from jaxrlhf import sharding
from jaxrlhf.models import llama
from jaxrlhf.models import lora
from jaxrlhf.models import registry
from jaxrlhf.models import t5
from jaxrlhf.models.layers import rotary
from jaxrlhf.models.loading import export_hf
from jaxrlhf.models.loading import from_pretrained
from jaxrlhf.train import loop

RANK, ALPHA = 4, 8.0


def _tokens():
  tokens = jnp.array([[5, 9, 17, 33, 6, 2, 0, 0], [7, 3, 3, 8, 11, 12, 4, 2]],
                     jnp.int32)
  mask = (tokens > 0).astype(jnp.int32)
  return tokens, rotary.positions_from_mask(mask), mask


# --- the module math -------------------------------------------------------------


@pytest.mark.parametrize("scan", [False, True])
def test_zero_initialised_adapters_give_the_base_logits_exactly(scan):
  spec = lora.LoraSpec(rank=RANK, alpha=ALPHA)
  model = llama.Llama(dataclasses.replace(llama.LlamaConfig.preset("tiny"),
                                          scan_layers=scan))
  tokens, positions, mask = _tokens()
  boxed = model.init(jax.random.PRNGKey(0), tokens, positions, mask)["params"]
  adapters = lora.init_adapters(jax.random.PRNGKey(1), boxed,
                                lora.adapter_sites(model, spec), spec)
  base, adapters = nn.unbox(boxed), nn.unbox(adapters)
  apply = jax.jit(model.apply)
  ours = apply({"params": lora.view(base, adapters, spec)}, tokens, positions,
               mask)
  alone = apply({"params": base}, tokens, positions, mask)
  assert np.array_equal(ours, alone)  # bit for bit: B is zero
  # Non-zero B: the view computes W + A B alpha / r, which `merged` folds in.
  moved = jax.tree.map(lambda x: x + 0.05, adapters)
  adapted = apply({"params": lora.view(base, moved, spec)}, tokens,
                  positions, mask)
  folded = apply({"params": lora.merged(base, moved, spec)}, tokens,
                 positions, mask)
  assert np.abs(adapted - alone).max() > 0.1
  np.testing.assert_allclose(adapted, folded, atol=2e-5, rtol=2e-5)
  # Dropout on the adapters' path (training): it moves only what they add.
  dropped = dataclasses.replace(spec, dropout=0.5)
  key = jax.random.PRNGKey(2)
  assert np.array_equal(apply({"params": lora.view(base, adapters, dropped,
                                                    key)},
                              tokens, positions, mask), alone)
  noisy = apply({"params": lora.view(base, moved, dropped, key)}, tokens,
                positions, mask)
  assert np.abs(noisy - adapted).max() > 1e-3


def test_adapted_projections_of_each_family_and_layer_choices():
  spec = lora.LoraSpec(rank=2, alpha=2.0)
  llama_model = llama.Llama(llama.LlamaConfig.preset("tiny"))
  sites = lora.adapter_sites(llama_model, spec)
  assert sorted({p[-1] for p in sites}) == ["key", "out", "query", "value",
                                            "wi_0", "wi_1", "wo"]
  assert {p[1] for p in sites} == {"layers_0", "layers_1"}
  # out: [heads, kv] -> embed, two input axes.
  assert sites[("decoder", "layers_0", "self_attention", "out")] == lora.Site(
      2, 1)
  one = lora.adapter_sites(llama_model, dataclasses.replace(
      spec, targets=("query", "value"), layers=(1,)))
  assert sorted(one) == [("decoder", "layers_1", "self_attention", "query"),
                         ("decoder", "layers_1", "self_attention", "value")]
  t5_model = t5.T5(dataclasses.replace(t5.T5Config(), num_encoder_layers=1,
                                       num_decoder_layers=1, scan_layers=True))
  t5_sites = lora.adapter_sites(t5_model, spec)
  assert ("decoder", "layers", "encoder_decoder_attention", "query") in t5_sites
  assert ("encoder", "layers", "mlp", "wi_0") in t5_sites
  with pytest.raises(ValueError, match="config.lora.targets: 'q_proj' names "
                     "no projection of this model; its projections are"):
    lora.adapter_sites(llama_model, dataclasses.replace(spec,
                                                        targets=("q_proj",)))
  with pytest.raises(ValueError, match="config.lora.layers: a scanned layer"):
    lora.adapter_sites(t5_model, dataclasses.replace(spec, layers=(0,)))
  with pytest.raises(ValueError, match=r"no layer\(s\) \[5\]"):
    lora.adapter_sites(llama_model, dataclasses.replace(spec, layers=(5,)))


@pytest.mark.parametrize("overrides, message", [
    ({"algorithm": "grpo", "lora.dropout": 0.1},
     "config.lora.dropout: 0.1: online RL needs deterministic log-probs"),
    ({"algorithm": "tr_dpo"},
     "config.lora.rank: tr_dpo moves its frozen reference"),
    ({"algorithm": "dro_v", "dro.value_from_policy": False},
     "config.lora.rank: with dro.value_from_policy=False"),
    ({"lora.layers": "0,x"}, "config.lora.layers: '0,x' is not"),
    ({"optimizer.name": "adafactor"},
     "config.optimizer.multiply_by_parameter_scale: LoRA's B starts at 0"),
])
def test_combinations_lora_cannot_serve_are_one_line_errors(overrides,
                                                            message):
  config = tiny_config(lora__rank=RANK, optimizer__name="adamw")
  defaults.apply_overrides(config, overrides)
  with pytest.raises(ValueError, match=message):
    defaults.validate(config)


# --- runs ----------------------------------------------------------------------------


def _config(**overrides):
  return tiny_config(**{
      "model__arch": "llama", "model__size": "tiny",
      "model__num_encoder_layers": None, "model__num_decoder_layers": 2,
      "optimizer__warmup_steps": 0, "optimizer__name": "adamw",
      "lora__rank": RANK, "lora__alpha": ALPHA, "eval__num_examples": 8,
      "eval__batch_size": 8, "train__batch_size": 8, **overrides})


def _demonstrations(directory) -> str:
  """SFT rows of the synthetic task as a file without a validation split
  (so the runs here spend no time evaluating)."""
  from jaxrlhf.data import synthetic  # pylint: disable=g-import-not-at-top
  path = os.path.join(str(directory), "sft.jsonl")
  with open(path, "w") as f:
    for e in synthetic.make_examples("train", 32):
      f.write(json.dumps({"prompt": e["inputs"], "completion": e["targets"]})
              + "\n")
  return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The base (a Hugging Face folder of a random tiny Llama), and an SFT
  LoRA run on it: 4 steps straight, and 2 steps resumed to 4."""
  root = tmp_path_factory.mktemp("lora")
  config = _config(lora__rank=0)
  mesh = sharding.create_mesh((1, 1), ("data", "model"), jax.devices()[:1])
  rules = sharding.as_rules(config.sharding.logical_axis_rules)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    trainer = trainer_of(from_scratch(algorithms.get("sft")), config, mesh)
    params = trainer.init_state().params["policy"]
  base_dir = root / "base_hf"
  export_hf(trainer.model, params, base_dir)
  straight, resumed = root / "sft_straight", root / "sft_resumed"
  sft = _sft_config(root, init__policy_checkpoint=str(base_dir),
                    train__num_steps=4, checkpoint__every_steps=2)
  loop.train(sft, str(straight))
  sft.train.num_steps = 2
  loop.train(sft, str(resumed))
  sft.train.num_steps = 4
  loop.train(sft, str(resumed))
  return {"base": base_dir, "straight": straight, "resumed": resumed,
          "base_params": jax.device_get(params), "model": trainer.model,
          "sft_config": sft}


def _sft_config(directory, **overrides):
  config = _config(data__task="lora_sft", **overrides)
  config.data.files.train = _demonstrations(directory)
  config.data.files.layout = "columns"
  return config


def _losses(workdir):
  rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  return [r["loss"] for r in rows if "loss" in r]


def _saved_state(workdir, step):
  return checkpoint_files.restore_state_as_numpy(
      os.path.join(workdir, "checkpoints", str(step), "state"))


def test_a_resumed_run_gives_the_same_numbers_and_saves_only_adapters(runs):
  straight, resumed = runs["straight"], runs["resumed"]
  assert _losses(straight) == _losses(resumed) and len(_losses(straight)) == 4
  a, b = _saved_state(straight, 4), _saved_state(resumed, 4)
  jax.tree.map(np.testing.assert_array_equal, a, b)
  # The checkpoint holds the adapters and their optimizer state, no base.
  assert not a["frozen"]
  leaves = jax.tree_util.tree_flatten_with_path(a["params"])[0]
  assert {str(path[-1].key) for path, _ in leaves} == {"lora_a", "lora_b"}
  assert any(np.abs(v).max() > 0 for p, v in leaves if p[-1].key == "lora_b")
  # The workdir names its base: the folder and a checksum of its weights.
  record = json.loads((straight / lora.BASE_RECORD).read_text())
  assert record["checkpoint"] == str(runs["base"])
  assert record["checksum"] == lora.checksum(runs["base_params"])


def test_a_changed_or_missing_base_is_refused_on_resume(runs, tmp_path):
  import shutil  # pylint: disable=g-import-not-at-top
  workdir = tmp_path / "run"
  base = tmp_path / "base"
  shutil.copytree(runs["base"], base)
  config = _sft_config(tmp_path, init__policy_checkpoint=str(base),
                       train__num_steps=1)
  loop.train(config, str(workdir))
  config.train.num_steps = 2
  changed = jax.tree.map(lambda x: x * 1.01, runs["base_params"])
  export_hf(runs["model"], changed, base, overwrite=True)
  with pytest.raises(ValueError, match=(
      r"^config.init.policy_checkpoint: the base this LoRA run's adapters "
      r"were trained on \(.*base, weights checksum \w+\) has changed")):
    loop.train(config, str(workdir))
  shutil.rmtree(base)
  with pytest.raises(ValueError, match=(
      "^config.init.policy_checkpoint: nothing matches")):
    loop.train(config, str(workdir))
  base.mkdir()  # there, but no checkpoint
  with pytest.raises(ValueError, match=(
      "^config.init.policy_checkpoint: the base of this LoRA run's adapters "
      "cannot be loaded: .* is neither a T5X checkpoint")):
    loop.train(config, str(workdir))


def _adapted_logits(runs):
  """Logits of the SFT run's policy as it computes them (base plus
  adapters), and the merged policy `from_pretrained` gives for its
  workdir."""
  tokens, positions, mask = _tokens()
  module, _, merged = from_pretrained(runs["straight"])
  adapters = _saved_state(runs["straight"], 4)["params"]["policy"]
  spec = lora.LoraSpec(rank=RANK, alpha=ALPHA)
  view = lora.view(runs["base_params"], adapters, spec)
  ours = np.asarray(jax.jit(module.apply)({"params": view}, tokens,
                                          positions, mask))
  folded = np.asarray(jax.jit(module.apply)({"params": merged}, tokens,
                                            positions, mask))
  base = np.asarray(jax.jit(module.apply)({"params": runs["base_params"]},
                                          tokens, positions, mask))
  assert np.abs(ours - base).max() > 1e-3  # the adapters moved it
  np.testing.assert_allclose(folded, ours, atol=2e-5, rtol=2e-5)
  return module, adapters, view, ours, (tokens, positions, mask)


def _transformers_logits(model, inputs):
  import torch  # pylint: disable=g-import-not-at-top
  tokens, positions, mask = (torch.from_numpy(np.asarray(x)).long()
                             for x in inputs)
  with torch.no_grad():
    return model(input_ids=tokens, attention_mask=mask,
                 position_ids=positions).logits.float().numpy()


def test_merged_export_gives_our_logits_in_transformers(runs, tmp_path):
  pytest.importorskip("torch", reason="torch is not installed; "
                      "`pip install torch==2.13.0 transformers`")
  transformers = pytest.importorskip("transformers")
  module, _, view, ours, inputs = _adapted_logits(runs)
  # The policy as the run computes it (base with adapters): written merged.
  export_hf(module, view, tmp_path)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, attn_implementation="eager")
  real = np.asarray(inputs[2]) == 1
  np.testing.assert_allclose(ours[real],
                             _transformers_logits(model, inputs)[real],
                             atol=1e-4, rtol=1e-4)


def test_peft_loads_the_adapter_folder_and_gives_our_logits(runs, tmp_path):
  pytest.importorskip("torch", reason="torch is not installed")
  transformers = pytest.importorskip("transformers")
  peft = pytest.importorskip("peft", reason="peft is not installed; "
                             "`pip install peft`")
  module, adapters, _, ours, inputs = _adapted_logits(runs)
  spec = lora.LoraSpec(rank=RANK, alpha=ALPHA)
  folder = lora.export_peft(module, adapters, spec, tmp_path / "adapter",
                            base_model_name_or_path=str(runs["base"]))
  written = json.loads((folder / lora.ADAPTER_CONFIG).read_text())
  assert written["r"] == RANK and written["lora_alpha"] == ALPHA
  assert written["target_modules"] == sorted(
      ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
       "down_proj"])
  base = transformers.AutoModelForCausalLM.from_pretrained(
      runs["base"], attn_implementation="eager")
  model = peft.PeftModel.from_pretrained(base, folder)
  real = np.asarray(inputs[2]) == 1
  np.testing.assert_allclose(ours[real],
                             _transformers_logits(model, inputs)[real],
                             atol=1e-4, rtol=1e-4)


def _moved_b(before, after) -> bool:
  """Every projection's B moved (A gets no gradient while B is 0: only
  weight decay moves it in the first step)."""
  pairs = zip(lora.adapter_matrices(jax.device_get(before)).values(),
              lora.adapter_matrices(jax.device_get(after)).values())
  return all(np.any(b0 != b1) for (_, b0), (_, b1) in pairs)


def _bytes(tree) -> int:
  return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(tree))


def test_dpo_from_the_sft_lora_run_trains_only_adapters_on_one_base(
    runs, tmp_path):
  """DPO starts from the SFT LoRA run's workdir: its base is that run's
  merged policy, held once (no reference copy: the reference is the base
  with the adapters off); a step changes only the adapters."""
  from conftest import synthetic_feedback_file  # pylint: disable=g-import-not-at-top
  config = _config(algorithm="dpo", data__task="lora_dpo",
                   init__policy_checkpoint=str(runs["straight"]),
                   eval__task="synthetic_summarize")
  config.data.files.train = synthetic_feedback_file(tmp_path, "pairs",
                                                    count=16, beta=10.0)
  _, _, merged = from_pretrained(runs["straight"])
  mesh = sharding.create_mesh((1, 1), ("data", "model"), jax.devices()[:1])
  rules = sharding.as_rules(config.sharding.logical_axis_rules)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    trainer = algorithms.build(config, mesh)
    state = trainer.init_state()
    assert set(state.frozen) == {"base"}
    # The trainer folds the adapters in on the devices (jit), from_pretrained
    # on the host (numpy): W + A . B summed in another order may differ in
    # float32's last bit (seen on some CPUs), not more.
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-6,
                                   atol=1e-7),
                 jax.device_get(state.frozen["base"]), merged)
    view = trainer.view(state)
    assert view.frozen["reference"] is state.frozen["base"]
    assert _bytes(state.frozen) == _bytes(runs["base_params"])
    batch = sharding.global_batch(next(trainer.train_batches(0)), mesh, rules)
    before = jax.device_get(state)  # the step donates the state's buffers
    after, metrics = trainer.train_step(state, batch)
  # Policy = reference (B = 0): DPO's loss is log 2.
  assert float(metrics["loss"]) == pytest.approx(math.log(2), abs=1e-6)
  jax.tree.map(np.testing.assert_array_equal, before.frozen,
               jax.device_get(after.frozen))
  assert _moved_b(before.params, after.params)


@pytest.mark.parametrize("rank,dtype,base_dtype", [
    (2, "float32", "model"), (8, "float32", "model"),
    (8, "bfloat16", "model"), (8, "bfloat16", "float32")])
def test_the_state_takes_the_memory_the_rank_predicts(rank, dtype,
                                                      base_dtype):
  """params + optimizer state + frozen of an SFT LoRA run with AdamW:
  r * (d_in + d_out) float32 values per adapted matrix, twice more for
  Adam's moments, and one copy of the base, in the model's dtype
  (lora.base_dtype='model': 2 bytes a parameter in bfloat16) or float32;
  nothing else but Adam's counts."""
  config = _config(lora__rank=rank, model__dtype=dtype,
                   lora__base_dtype=base_dtype)
  mesh = sharding.create_mesh((1, 1), ("data", "model"), jax.devices()[:1])
  with jax.set_mesh(mesh):
    trainer = trainer_of(from_scratch(algorithms.get("sft")), config, mesh)
  m = trainer.model_config
  d, q, kv = m.emb_dim, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
  matrices = [(d, q), (d, kv), (d, kv), (q, d),  # query, key, value, out
              (d, m.mlp_dim), (d, m.mlp_dim), (m.mlp_dim, d)]  # wi_0, wi_1, wo
  adapters = m.num_layers * sum(rank * (i + o) for i, o in matrices) * 4
  # The model's parameters are float32 (its dtype is what it computes in).
  base = _bytes(nn.unbox(registry.abstract_params(trainer.model)))
  if dtype == "bfloat16" and base_dtype == "model":
    base //= 2
  state = trainer.abstract_state
  assert _bytes(state.params) == adapters
  assert 2 * adapters <= _bytes(state.opt_state) <= 2 * adapters + 16
  assert _bytes(state.frozen) == base


def test_dro_v_value_network_adapts_the_policy_base():
  """DRO-V on T5: the value network's backbone is the policy's frozen base
  with adapters of its own; its head trains in full; no reference."""
  config = tiny_config(algorithm="dro_v", lora__rank=RANK,
                       optimizer__name="adamw")
  mesh = sharding.create_mesh((1, 1), ("data", "model"), jax.devices()[:1])
  with jax.set_mesh(mesh):
    trainer = trainer_of(from_scratch(algorithms.get("dro_v")), config, mesh)
  state = trainer.abstract_state
  assert set(state.frozen) == {"base"}
  assert set(state.params["value"]) == {"backbone", "head"}
  for tree in (state.params["policy"], state.params["value"]["backbone"]):
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    assert {p[-1].key for p, _ in leaves} == {"lora_a", "lora_b"}
    assert {p[0].key for p, _ in leaves} == {"encoder", "decoder"}
  assert _bytes(state.frozen) == _bytes(nn.unbox(registry.abstract_params(
      trainer.model)))


def test_ppo_value_shares_the_base_and_a_step_moves_only_adapters_and_heads(
    tmp_path):
  """PPO without a reward model: the value network's backbone adapts the
  policy's base (one frozen copy, no reference), its head trains in full."""
  config = _config(algorithm="ppo", data__task="synthetic_summarize",
                   rewards__reward_model__weight=0.0,
                   rewards__gold_reward__weight=1.0, train__batch_size=4,
                   online__max_new_tokens=4, online__num_epochs=1,
                   data__targets_length=4)
  mesh = sharding.create_mesh((1, 1), ("data", "model"), jax.devices()[:1])
  rules = sharding.as_rules(config.sharding.logical_axis_rules)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    trainer = trainer_of(from_scratch(algorithms.get("ppo")), config, mesh)
    state = trainer.init_state()
    assert set(state.frozen) == {"base"}
    assert set(state.params["value"]) == {"backbone", "head"}
    backbone = jax.tree_util.tree_flatten_with_path(
        state.params["value"]["backbone"])[0]
    assert {p[-1].key for p, _ in backbone} == {"lora_a", "lora_b"}
    state = jax.device_get(state)  # the step donates the state's buffers
    after, metrics = trainer.train_step(
        state, sharding.global_batch(next(trainer.train_batches(0)), mesh,
                                     rules))
  assert np.isfinite(float(metrics["loss"]))
  jax.tree.map(np.testing.assert_array_equal, state.frozen,
               jax.device_get(after.frozen))
  assert _moved_b(state.params["policy"], after.params["policy"])
  assert _moved_b(state.params["value"]["backbone"],
                  after.params["value"]["backbone"])
  assert all(jax.tree.leaves(jax.tree.map(
      lambda a, b: bool(np.any(a != b)),
      jax.device_get(state.params["value"]["head"]),
      jax.device_get(after.params["value"]["head"]))))
