"""The router's load-balancing loss in training (issue 43, item 2).

Every algorithm's gradient update adds router_aux_loss_coef x the
load-balancing loss of its trained mixture-of-experts forward passes, and
logs it with the experts' load (`update.with_router_loss`,
`moe_decoder.recording`). Checked here on a tiny Qwen3-MoE (2 MoE layers, 4
experts, top 2): the loss and its gradient against the cross-entropy plus
coef x the aux loss computed in numpy from the sown router logits; frozen
networks adding nothing; a dense model's step traced unchanged; SFT,
DPO and GRPO training through the trainer; and LoRA on the experts
(lora.targets 'experts'): the grouped low-rank products against merged
weights, and a step that trains the adapters and leaves the base.
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import from_scratch, one_device_mesh, synthetic_feedback_file
from conftest import tiny_config, trainer_of
from jaxrlhf import algorithms
from jaxrlhf import sharding
from jaxrlhf.algorithms import update
from jaxrlhf.algorithms.offline import sft
from jaxrlhf.models import moe_decoder
from jaxrlhf.models import scoring

MOE = dict(model__arch="qwen3_moe", model__size="tiny",
           model__num_encoder_layers=None, model__num_decoder_layers=None,
           optimizer__warmup_steps=0, train__batch_size=4)


@pytest.fixture(scope="module")
def sft_run():
  """A tiny Qwen3-MoE SFT trainer (random weights), its initial state and
  a training batch."""
  config = tiny_config(**MOE)
  mesh, rules = one_device_mesh(config)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    trainer = trainer_of(from_scratch(algorithms.get("sft")), config, mesh)
    state = trainer.init_state()
    batch = jax.device_get(next(trainer.train_batches(0)))
  return trainer, state, batch, mesh, rules


def _numpy_aux(router, mask, top_k):
  """transformers' load_balancing_loss_func, in numpy: router logits
  [layers, batch, length, experts] concatenated over the layers, the
  tokens of mask [batch, length] counted in each layer."""
  e = router.shape[-1]
  logits = router.reshape(-1, e).astype(np.float64)
  m = np.broadcast_to(mask, router.shape[:-1]).reshape(-1).astype(np.float64)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  top = np.argsort(-probs, axis=-1)[:, :top_k]
  chosen = np.zeros_like(probs)
  np.put_along_axis(chosen, top, 1.0, axis=-1)
  f = (chosen * m[:, None]).sum(0) / m.sum()
  p = (probs * m[:, None]).sum(0) / m.sum()
  return e * np.sum(f * p), chosen, m


def _reference(module, params, batch):
  """(token cross-entropy of the SFT targets, aux loss, relative expert
  loads [layers, experts]) of a plain forward pass, in numpy."""
  logits, state = module.apply(
      {"params": params}, batch["tokens"], batch["positions"],
      batch["attention_mask"], mutable=[moe_decoder.INTERMEDIATES])
  logits = np.asarray(logits, np.float64)[:, :-1]
  targets = np.asarray(batch["tokens"])[:, 1:]
  weights = np.asarray(batch["loss_weights"], np.float64)[:, 1:]
  log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + (
      logits.max(-1))
  nll = log_z - np.take_along_axis(logits, targets[..., None], -1)[..., 0]
  ce = np.sum(nll * weights) / np.sum(weights)
  router = np.asarray(moe_decoder.router_logits(
      state[moe_decoder.INTERMEDIATES]))
  k = module.config.num_experts_per_tok
  aux, chosen, m = _numpy_aux(router, np.asarray(batch["attention_mask"]), k)
  per_layer = (chosen * m[:, None]).reshape(router.shape[0], -1,
                                            router.shape[-1]).sum(1)
  load = per_layer / per_layer.sum(-1, keepdims=True) * router.shape[-1]
  return ce, aux, load


def _sft_loss(lm):
  def loss(params, batch, rng):
    del rng
    return sft.token_cross_entropy(lm, params, batch)
  return loss


@pytest.mark.parametrize("coef", [0.0, 0.05])
def test_sft_loss_is_cross_entropy_plus_coef_times_the_aux_loss(sft_run,
                                                                coef):
  trainer, state, batch, _, _ = sft_run
  module = type(trainer.model)(dataclasses.replace(
      trainer.model.config, router_aux_loss_coef=coef))
  params = nn.unbox(state.params["policy"])
  ce, aux, load = _reference(module, params, batch)
  assert 1.0 < load.max() and load.min() < 1.0  # not balanced at random
  loss, metrics, grads = jax.jit(functools.partial(
      update.accumulate_gradients, _sft_loss(scoring.adapter_for(module)),
      num_microbatches=1))(params, batch, jax.random.PRNGKey(0))
  np.testing.assert_allclose(float(loss), ce + coef * aux, rtol=1e-5)
  np.testing.assert_allclose(float(metrics["moe/aux_loss"]), aux, rtol=1e-5)
  np.testing.assert_allclose(float(metrics["moe/expert_load/max"]),
                             load.max(), rtol=1e-5)
  np.testing.assert_allclose(float(metrics["moe/expert_load/min"]),
                             load.min(), rtol=1e-5)
  np.testing.assert_allclose(float(metrics["moe/expert_load/cv"]),
                             np.mean(np.std(load, axis=-1)), rtol=1e-5)
  # The gradient is the cross-entropy's plus coef x the aux loss's (which
  # reaches the routers: compared on one).
  def aux_of(p):
    _, s = module.apply({"params": p}, batch["tokens"], batch["positions"],
                        batch["attention_mask"],
                        mutable=[moe_decoder.INTERMEDIATES])
    return moe_decoder.load_balancing_loss(
        module.config, s[moe_decoder.INTERMEDIATES], batch["attention_mask"])
  plain = jax.grad(lambda p: _sft_loss(scoring.adapter_for(module))(
      p, batch, None)[0])(params)
  want = jax.tree.map(lambda a, b: a + coef * b, plain,
                      jax.grad(aux_of)(params))
  router = ("decoder", "layers_0", "mlp", "router", "kernel")
  get = lambda tree: functools.reduce(lambda t, k: t[k], router, tree)
  np.testing.assert_allclose(get(grads), get(want), rtol=2e-4, atol=1e-7)


def test_microbatches_add_the_mean_of_their_aux_losses(sft_run):
  """Two micro-batches: each adds coef x its own aux loss / 2."""
  trainer, state, batch, _, _ = sft_run
  coef = trainer.model.config.router_aux_loss_coef
  params = nn.unbox(state.params["policy"])
  half = [jax.tree.map(lambda x, i=i: x[i::2], batch) for i in range(2)]
  refs = [_reference(trainer.model, params, b) for b in half]
  loss, metrics, _ = jax.jit(functools.partial(
      update.accumulate_gradients,
      update.mean_over_examples(_sft_loss(trainer.lm), 2),
      num_microbatches=2))(params, batch, jax.random.PRNGKey(0))
  ce_halves = np.mean([r[0] for r in refs])
  aux = np.mean([r[1] for r in refs])
  np.testing.assert_allclose(float(loss), ce_halves + coef * aux, rtol=1e-5)
  np.testing.assert_allclose(float(metrics["moe/aux_loss"]), aux, rtol=1e-5)


def test_frozen_networks_record_nothing(sft_run):
  """A loss that also scores with a frozen copy (a reference): the aux loss
  is the trained pass's alone; scoring with the frozen copy only adds
  nothing and logs nothing."""
  trainer, state, batch, _, _ = sft_run
  params = nn.unbox(state.params["policy"])
  # A frozen network that routes differently from the trained one.
  frozen = jax.tree.map(lambda x: x * 1.5, params)
  lm = trainer.lm
  _, aux, _ = _reference(trainer.model, params, batch)

  def both(p, b, rng):
    loss, metrics = _sft_loss(lm)(p, b, rng)
    ref, _ = _sft_loss(lm)(frozen, b, rng)
    return loss + 0.0 * jax.lax.stop_gradient(ref), metrics

  def frozen_only(p, b, rng):
    ref, metrics = _sft_loss(lm)(frozen, b, rng)
    return ref + 0.0 * jnp.sum(p["decoder"]["layers_0"]["mlp"]["wo"]), metrics

  step = lambda fn: jax.jit(functools.partial(
      update.accumulate_gradients, fn, num_microbatches=1))(
          params, batch, jax.random.PRNGKey(0))
  _, metrics, _ = step(both)
  np.testing.assert_allclose(float(metrics["moe/aux_loss"]), aux, rtol=1e-5)
  loss, metrics, _ = step(frozen_only)
  assert not any(k.startswith("moe/") for k in metrics)
  np.testing.assert_allclose(float(loss), _reference(
      trainer.model, frozen, batch)[0], rtol=1e-5)


def test_a_dense_models_update_traces_to_the_same_computation():
  """A tiny Llama's SFT loss: the update's computation is the plain
  value_and_grad's, equation for equation."""
  from jaxrlhf.models import registry  # pylint: disable=g-import-not-at-top
  config = registry.get_family("llama").preset("tiny")
  module = registry.get_family("llama").module(config)
  tokens = jnp.ones((2, 8), jnp.int32)
  batch = {"tokens": tokens, "positions": jnp.tile(jnp.arange(8), (2, 1)),
           "attention_mask": tokens, "loss_weights": tokens}
  params = jax.eval_shape(lambda: nn.unbox(module.init(
      jax.random.PRNGKey(0), tokens, batch["positions"], tokens)["params"]))
  loss = _sft_loss(scoring.adapter_for(module))
  ours = jax.make_jaxpr(lambda p: update.accumulate_gradients(
      loss, p, batch, jax.random.PRNGKey(0), 1))(params)

  def plain(p):
    (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(
        p, batch, jax.random.PRNGKey(0))
    return value, metrics, grads
  assert str(ours) == str(jax.make_jaxpr(plain)(params))


def _train(config, steps, same_batch=False):
  """Metrics of `steps` train steps of a from-scratch tiny run."""
  mesh, rules = one_device_mesh(config)
  out = []
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    trainer = trainer_of(from_scratch(algorithms.get(config.algorithm)),
                         config, mesh)
    state = trainer.init_state()
    batches = trainer.train_batches(0)
    batch = next(batches)
    for _ in range(steps):
      state, metrics = trainer.train_step(
          state, sharding.global_batch(batch, mesh, rules))
      out.append(jax.device_get(metrics))
      if not same_batch:
        batch = next(batches)
  return out


def _check_moe_metrics(rows, experts=4):
  """Finite losses, and the router's metrics logged in their ranges: the
  aux loss experts x sum_e f_e P_e in (0, experts] (sum_e P_e = 1, f_e <=
  1), the relative loads about 1 (their mean)."""
  for row in rows:
    assert np.isfinite(row["loss"])
    assert 0 < row["moe/aux_loss"] <= experts
    assert 0 <= row["moe/expert_load/min"] <= 1 <= row[
        "moe/expert_load/max"] <= experts
    assert row["moe/expert_load/cv"] >= 0


def test_sft_trains_a_tiny_qwen3_moe(sft_run):
  trainer, state, batch, mesh, rules = sft_run
  state = jax.tree.map(jnp.copy, state)  # the step donates its state
  rows = []
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    for _ in range(4):
      state, metrics = trainer.train_step(
          state, sharding.global_batch(batch, mesh, rules))
      rows.append(jax.device_get(metrics))
  _check_moe_metrics(rows)
  assert rows[-1]["loss"] < rows[0]["loss"] - 0.3


def test_dpo_trains_a_tiny_qwen3_moe(tmp_path):
  config = tiny_config(**MOE, algorithm="dpo", data__task="moe_dpo_data")
  config.data.files.train = synthetic_feedback_file(tmp_path, "pairs",
                                                    count=8, beta=10.0)
  rows = _train(config, 3, same_batch=True)
  _check_moe_metrics(rows)
  assert rows[-1]["loss"] < rows[0]["loss"]


def test_grpo_trains_a_tiny_qwen3_moe():
  config = tiny_config(**MOE, algorithm="grpo",
                       rewards__reward_model__weight=0.0,
                       rewards__gold_reward__weight=1.0,
                       online__reward_model_checkpoint="",
                       online__samples_per_prompt=2)
  _check_moe_metrics(_train(config, 2))


# --- LoRA on the experts ----------------------------------------------------


def test_lora_on_the_experts_equals_the_merged_weights_and_trains_them():
  """lora.targets 'experts': each expert gets its own A and B; the adapted
  model's logits are those of the merged weights W_e + A_e B_e alpha / r
  (the grouped low-rank path against plain merged experts); the default
  targets leave the experts alone; a LoRA SFT step moves the experts'
  adapters and nothing of the frozen base."""
  from jaxrlhf.models import lora  # pylint: disable=g-import-not-at-top
  config = tiny_config(**MOE, lora__rank=2, lora__alpha=4.0,
                       lora__targets="experts,query",
                       optimizer__name="adamw")
  mesh, rules = one_device_mesh(config)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    trainer = trainer_of(from_scratch(algorithms.get("sft")), config, mesh)
    model = trainer.model
    spec = trainer.lora.spec
    assert not any(s.experts for s in lora.adapter_sites(
        model, dataclasses.replace(spec, targets=lora.DEFAULT_TARGETS)
    ).values())
    sites = lora.adapter_sites(model, spec)
    experts = sorted(p for p, s in sites.items() if s.experts)
    assert experts == [("decoder", f"layers_{i}", "mlp", w)
                       for i in range(2) for w in ("wi_0", "wi_1", "wo")]
    state = trainer.init_state()
    base = jax.device_get(nn.unbox(state.frozen["base"]))
    adapters = jax.device_get(nn.unbox(state.params["policy"]))
    wi_0 = adapters["decoder"]["layers_0"]["mlp"]["wi_0"]
    assert wi_0["lora_a"].shape == (4, 32, 2)   # [experts, embed, r]
    assert wi_0["lora_b"].shape == (4, 2, 32)   # [experts, r, mlp]
    # Nonzero B (it starts at 0): the adapted logits against the merged
    # weights, each expert's own product folded in by hand.
    rng = np.random.default_rng(0)
    adapters = jax.tree.map(
        lambda x: x + 0.1 * rng.standard_normal(x.shape).astype(x.dtype),
        adapters)
    batch = jax.device_get(next(trainer.train_batches(0)))
    tokens = np.asarray(batch["tokens"])[:2]
    positions = np.tile(np.arange(tokens.shape[1]), (2, 1))
    mask = np.ones_like(tokens)
    merged = jax.tree.map(np.copy, base)
    for i in range(2):
      mlp = merged["decoder"][f"layers_{i}"]["mlp"]
      for w in ("wi_0", "wi_1", "wo"):
        pair = adapters["decoder"][f"layers_{i}"]["mlp"][w]
        mlp[w] = mlp[w] + np.einsum("eir,ero->eio", pair["lora_a"],
                                    pair["lora_b"]) * spec.scale
      attn = merged["decoder"][f"layers_{i}"]["self_attention"]["query"]
      pair = adapters["decoder"][f"layers_{i}"]["self_attention"]["query"]
      attn["kernel"] = attn["kernel"] + np.einsum(
          "ir,rhk->ihk", pair["lora_a"], pair["lora_b"]) * spec.scale
    want = model.apply({"params": merged}, tokens, positions, mask)
    got = model.apply({"params": lora.view(base, adapters, spec)}, tokens,
                      positions, mask)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(lora.merged(base, adapters, spec)["decoder"][
        "layers_1"]["mlp"]["wo"], merged["decoder"]["layers_1"]["mlp"]["wo"],
                               rtol=1e-5, atol=1e-6)
    # One SFT step: the experts' adapters move, the base does not.
    before = jax.device_get(nn.unbox(state.params["policy"]))
    state, metrics = trainer.train_step(
        state, sharding.global_batch(batch, mesh, rules))
  after = jax.device_get(nn.unbox(state.params["policy"]))
  moved = after["decoder"]["layers_1"]["mlp"]["wo"]["lora_b"]
  assert np.abs(moved - before["decoder"]["layers_1"]["mlp"]["wo"][
      "lora_b"]).max() > 0
  for x, y in zip(jax.tree.leaves(base),
                  jax.tree.leaves(jax.device_get(nn.unbox(
                      state.frozen["base"])))):
    np.testing.assert_array_equal(x, y)
  assert np.isfinite(metrics["loss"]) and "moe/aux_loss" in metrics
