"""Optax optimizers and learning-rate schedules from the config."""

import copy
from typing import Mapping, Optional

import jax
import jax.numpy as jnp
import ml_collections
import optax

NAMES = ("adafactor", "adamw", "sgd")
SCHEDULES = ("constant", "cosine", "linear")


def learning_rate_schedule(opt: ml_collections.ConfigDict, num_steps: int):
  """Linear warm-up from 0, then constant, cosine or linear decay to 0."""
  peak, warmup = opt.learning_rate, opt.warmup_steps
  decay_steps = max(num_steps - warmup, 1)
  if opt.schedule == "constant":
    after = optax.constant_schedule(peak)
  elif opt.schedule == "cosine":
    after = optax.cosine_decay_schedule(peak, decay_steps)
  elif opt.schedule == "linear":
    after = optax.linear_schedule(peak, 0.0, decay_steps)
  else:
    raise ValueError(f"config.optimizer.schedule: unknown {opt.schedule!r}.")
  if warmup <= 0:
    return after
  return optax.join_schedules(
      [optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def make_optimizer(opt: ml_collections.ConfigDict, num_steps: int):
  """The optax GradientTransformation the config describes."""
  schedule = learning_rate_schedule(opt, num_steps)
  if opt.name == "adafactor":
    # Adafactor's own update clipping (threshold 1.0) stays on, as in T5.
    core = optax.adafactor(
        learning_rate=schedule, decay_rate=opt.decay_rate,
        multiply_by_parameter_scale=opt.multiply_by_parameter_scale,
        clipping_threshold=1.0)
  elif opt.name == "adamw":
    core = optax.adamw(learning_rate=schedule, b1=opt.b1, b2=opt.b2,
                       eps=opt.eps, weight_decay=opt.weight_decay)
  elif opt.name == "sgd":
    # Plain gradient descent: an update is -learning_rate * gradient, the
    # one optimizer that is not invariant to the gradient's scale.
    core = optax.sgd(learning_rate=schedule)
  else:
    raise ValueError(f"config.optimizer.name: unknown {opt.name!r}.")
  # The clipping stage is in the chain whether it clips or not: its state
  # is empty either way, so the optimizer state has one structure for every
  # value of grad_clip_norm, which a resumed run may change (0 turns it
  # off, and then the gradient passes untouched).
  clip = (optax.clip_by_global_norm(opt.grad_clip_norm)
          if opt.grad_clip_norm > 0 else optax.identity())
  return optax.chain(clip, core)


def per_update_config(opt: ml_collections.ConfigDict, updates_per_step: int
                      ) -> ml_collections.ConfigDict:
  """`opt` with warm-up counted in optimizer updates instead of train steps,
  for steps that make several updates (online RL's epochs x minibatches):
  the schedule over train steps is then unchanged."""
  opt = copy.deepcopy(opt)
  with opt.unlocked():
    opt.warmup_steps = opt.warmup_steps * updates_per_step
  return opt


def scale_updates(tx, factor: float):
  """`tx` whose every update is multiplied by `factor` after the optimizer.

  Unlike a scaled loss, this changes how far Adafactor and Adam move (both
  normalise the gradient's scale away); for SGD the two are the same. The
  state is `tx`'s own, so checkpoints do not depend on the factor, and a
  factor of 1 returns `tx` itself.
  """
  if factor == 1:
    return tx

  def update(updates, state, params=None):
    updates, state = tx.update(updates, state, params)
    return jax.tree.map(lambda u: u * jnp.asarray(factor, u.dtype),
                        updates), state

  return optax.GradientTransformation(tx.init, update)


def make_network_optimizers(
    configs: Mapping[str, ml_collections.ConfigDict], num_updates: int,
    update_scales: Optional[Mapping[str, float]] = None):
  """One optimizer per top-level network ({"policy": cfg, "value": cfg}),
  each on its own subtree of the params dict; `update_scales` ({network:
  factor}) multiplies a network's updates after its optimizer
  (`scale_updates`)."""
  update_scales = dict(update_scales or {})
  unknown = sorted(set(update_scales) - set(configs))
  if unknown:
    raise ValueError(f"update scales for {unknown}, which have no optimizer "
                     f"(the networks are {sorted(configs)}).")
  transforms = {name: scale_updates(make_optimizer(cfg, num_updates),
                                    update_scales.get(name, 1.0))
                for name, cfg in configs.items()}
  return optax.multi_transform(transforms, {k: k for k in transforms})
