"""LoRA in the train state: only the adapters train, one frozen base.

With `config.lora.rank` > 0 every trained language model of a run is a
frozen base plus adapters (`jaxrlhf.models.lora`):

  params["policy"]             the policy's adapters (all the optimizer
                               sees and keeps state for)
  params[<net>]["backbone"]    the adapters of a value or reward network's
                               backbone, its head trained in full
  frozen["base"]               the base: the policy's starting network
                               (init.policy_checkpoint), held once, in
                               the model's dtype (`lora.base_dtype`)

A backbone adapts the frozen network it starts from: the policy's base
(DRO-V's value network, which starts from the policy's checkpoint; PPO's
value without a reward model; the reward_model algorithm's network), or
PPO's frozen reward model (its value starts from it, detail 22: the value
is the reward model's frozen backbone plus adapters and a head of its own,
so the two share one copy). DRO-V's value with dro.value_from_policy=False
would start from a fresh initialisation, which nothing frozen holds: it is
refused.

There is no `frozen["reference"]`: the reference of DPO, KTO, DRO-V, PPO,
GRPO, ... is the base with the adapters off. The algorithms never see
this: the trainer gives them views (`view`, `view_parts`) in which
`params["policy"]` is the base with the adapters beside its kernels (a
dictionary union, so gradients reach only the adapters) and
`frozen["reference"]` is the base, at the few places they read the state:
the offline loss, the online rollout and update, evaluation.

Checkpoints hold the adapters (`checkpointed`): the base is named instead,
in `<workdir>/lora_base.json` (its checkpoint path and a checksum of its
weights, `jaxrlhf.models.lora.checksum`), written when the run starts; a
resumed run loads the base from there and refuses a changed or missing one
in one line. A LoRA workdir loads elsewhere (init.policy_checkpoint of the
next run, `from_pretrained`) as merged weights
(`jaxrlhf.models.pretrained`).
"""

from typing import Any, Dict, Optional, Tuple

import jax
import jax.numpy as jnp

from jaxrlhf import config_schema
from jaxrlhf.models import lora
from jaxrlhf.models import pretrained

F = config_schema.Field

BASE = "base"
# lora.base_dtype's choices: the model's compute dtype, or float32.
BASE_DTYPES = ("model", "float32")


def check_lora(c, algorithm) -> None:
  """Combinations LoRA cannot serve of `algorithm` (a `base.Algorithm`),
  from the config alone (one of `Algorithm.all_checks`)."""
  if not c.lora.rank:
    return
  config_schema.require(
      not (algorithm.online and c.lora.dropout > 0), "lora.dropout",
      f"{c.lora.dropout}: online RL needs deterministic log-probs (PPO "
      "details, detail 7: with dropout the ratios are not 1 before the "
      "first update); set it to 0.")
  moved = algorithm.carried.changes_frozen
  config_schema.require(
      not moved, "lora.rank",
      f"{c.algorithm} moves its frozen {', '.join(moved)} during training, "
      "while a LoRA run's reference is the frozen base with the adapters "
      "off; train it without LoRA (lora.rank=0).")
  # Every other backbone adapts the policy's base, which it must start from.
  fresh = algorithm.networks.fresh_backbone(c)
  config_schema.require(
      not fresh, "lora.rank",
      f"{fresh}; a freshly initialised backbone has no frozen network for "
      "its adapters, so train it without LoRA otherwise.")
  config_schema.require(
      not (c.optimizer.name == "adafactor"
           and c.optimizer.multiply_by_parameter_scale),
      "optimizer.multiply_by_parameter_scale",
      "LoRA's B starts at 0, and Adafactor scales each update by its "
      "parameter's RMS (at least 1e-3), so B would barely move; set it to "
      "False (the learning rate is then the adapters' step size).")
  lora.LoraSpec.from_config(c.lora)  # the lists parse


GROUP = config_schema.Group(
    "lora", "LoRA: every trained language model is a frozen base plus "
    "low-rank adapters, which alone train (jaxrlhf/algorithms/lora_state.py, "
    "jaxrlhf/models/lora.py).", [
        F("rank", 0, "r, the adapters' rank; 0 = off (every network "
          "trains in full).", bounds=">=0"),
        F("alpha", 16.0, "The adapters' update is multiplied by alpha / "
          "rank (PEFT's lora_alpha).", bounds=">0"),
        F("dropout", 0.0, "Dropout of the adapters' input in training "
          "(offline algorithms; online RL needs 0).", bounds="[0, 1)"),
        F("targets", ",".join(lora.DEFAULT_TARGETS),
          "The adapted projections, by module name: the attention's "
          "query, key, value, out (T5's cross-attention too) and the MLP's "
          "wi, wi_0, wi_1, wo (the names every family's layers use); "
          "'experts': every expert's projections of a mixture-of-experts "
          "layer (an adapter per expert)."),
        F("layers", "", "Comma-separated indices of the adapted layers "
          "(every layer stack's, unrolled: model.scan_layers=False); '' = "
          "every layer."),
        F("base_dtype", BASE_DTYPES[0],
          "How the frozen base is held: 'model' = in config.model.dtype, "
          "the precision its forward pass reads (bfloat16 halves the "
          "base's memory; the projections cast their kernels to it "
          "anyway, so only parameters read in float32, such as norm "
          "scales, round), or 'float32'. The policy and its reference "
          "read the same base either way.", choices=BASE_DTYPES),
    ])


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def _set(tree, path, value):
  out = dict(tree)
  out[path[0]] = value if len(path) == 1 else _set(tree[path[0]], path[1:],
                                                   value)
  return out


class LoraRun:
  """A run's LoRA: which networks are adapted, on which base; the views,
  the checkpointed state and the base's record (module docstring)."""

  def __init__(self, trainer, spec: lora.LoraSpec):
    self.spec = spec
    self._trainer = trainer
    training = trainer.algorithm.training
    # Trained networks initialised from the reward model (PPO's value).
    self._from_reward_model = tuple(
        getattr(training, "value_from_reward_model", ()))
    # Raises here, naming the field, for targets the model lacks.
    lora.adapter_sites(trainer.model, spec)

  # --- what is adapted --------------------------------------------------------

  def _module_and_base(self, name: str):
    """(module, base path in frozen) of the backbone of trained network
    `name`."""
    online = self._trainer.online
    reward_model = online.rewards.reward_model if online else None
    if name in self._from_reward_model and reward_model is not None:
      return reward_model.adapter.module, ("reward", "backbone")
    return self._trainer.model, (BASE,)

  def adapted(self, params) -> Dict[Tuple[str, ...], Tuple[Any, Tuple]]:
    """{path of an adapted language model in `params`: (its module, the
    path of its base in frozen)}: the policy, and every trained network
    with a backbone."""
    out = {}
    for name, tree in params.items():
      if name == "policy":
        out[("policy",)] = (self._trainer.model, (BASE,))
      elif isinstance(tree, dict) and "backbone" in tree:
        out[(name, "backbone")] = self._module_and_base(name)
    return out

  # --- initialisation ----------------------------------------------------------

  def adapt(self, trainable, frozen, rng):
    """The algorithm's (boxed) trainable and frozen networks with every
    language model replaced by fresh adapters, the policy's own network
    (or, without a policy, the first adapted backbone's) kept as
    frozen["base"], and no reference (the base is it)."""
    trainable, frozen = dict(trainable), dict(frozen)
    frozen.pop("reference", None)
    for i, (path, (module, base)) in enumerate(sorted(
        self.adapted(trainable).items(), key=lambda kv: kv[0] != ("policy",))):
      network = _get(trainable, path)
      if base == (BASE,) and BASE not in frozen:
        frozen[BASE] = jax.tree.map(self._as_base, network)
      sites = lora.adapter_sites(module, self.spec)
      trainable = _set(trainable, path, lora.init_adapters(
          jax.random.fold_in(rng, i), network, sites, self.spec))
    return trainable, frozen

  def _as_base(self, x):
    """A parameter of the base as it is held (`lora.base_dtype`)."""
    config = self._trainer.config
    dtype = jnp.dtype(config.model.dtype if config.lora.base_dtype == "model"
                      else config.lora.base_dtype)
    return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

  def checkpoint_targets(self, checkpoints: Dict[str, str]) -> Dict[str, str]:
    """`Networks.checkpoints`' targets in a LoRA state: a network whose
    adapters sit on the base loads into frozen/base (once), the reference
    is the base."""
    out = {}
    for target, path in checkpoints.items():
      keys = tuple(target.split("/"))
      if keys == ("frozen", "reference"):
        continue
      lm = keys[1:] == ("policy",) or (len(keys) == 3
                                        and keys[2] == "backbone")
      if keys[0] == "params" and lm:
        out.setdefault(f"frozen/{BASE}", path)
      else:
        out[target] = path
    return out

  @property
  def base_path(self) -> str:
    """The checkpoint the base is loaded from ('' = a fresh
    initialisation)."""
    return self.checkpoint_targets(
        self._trainer.algorithm.networks.checkpoints(self._trainer)).get(
            f"frozen/{BASE}", "") or ""

  # --- views ---------------------------------------------------------------------

  def view_parts(self, params, frozen, dropout_rng=None):
    """(params, frozen) as the algorithms read them: each adapted network
    the base with its adapters (`lora.view`; in training with
    `dropout_rng`, the adapters' dropout), frozen["reference"] the base.
    Views of views are themselves."""
    if BASE not in frozen:
      return params, frozen
    if self.spec.dropout == 0:
      dropout_rng = None
    out = params
    for i, (path, (_, base)) in enumerate(sorted(self.adapted(params).items())):
      rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, i)
      out = _set(out, path, lora.view(_get(frozen, base), _get(params, path),
                                      self.spec, rng))
    frozen = dict(frozen)
    frozen["reference"] = frozen.pop(BASE)
    return out, frozen

  def view(self, state):
    params, frozen = self.view_parts(state.params, state.frozen)
    return state.replace(params=params, frozen=frozen)

  # --- checkpoints -------------------------------------------------------------

  def checkpointed(self, state):
    """The state a checkpoint holds: without the base."""
    return state.replace(frozen={k: v for k, v in state.frozen.items()
                                 if k != BASE})

  def record(self, state) -> Dict[str, Any]:
    """What names the base: its checkpoint (or the seed of a fresh one) and
    the checksum of its weights."""
    path = self.base_path
    swap = self._trainer.hf_options()["token_swap"]
    out = {"checkpoint": lora.absolute(path) if path else "",
           "checksum": lora.checksum(state.frozen[BASE]),
           # The ids its token rows were exchanged by (`token_rows`).
           "token_swap": list(swap) if swap else None}
    if path:
      out["resolved"] = lora.absolute(pretrained.resolve_checkpoint(path))
    else:
      out["random_init_seed"] = self._trainer.config.seed
    return out

  def load_base(self):
    """The base as the run starts it (loaded, or initialised afresh),
    sharded as the state's."""
    trainer = self._trainer
    path = self.base_path
    if not path:
      return trainer._init(jax.random.PRNGKey(trainer.config.seed)).frozen[BASE]  # pylint: disable=protected-access
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        trainer.abstract_state.frozen[BASE],
        trainer.state_shardings.frozen[BASE])
    return pretrained.load_lm_params(path, target, **trainer.hf_options())

  def with_base(self, state, record: Optional[Dict[str, Any]]):
    """A restored (checkpointed) state with its base loaded again, checked
    against the record the run started with.

    Raises:
      ValueError: no record, a base that cannot be loaded, or one whose
        weights are not those the adapters were trained on.
    """
    field = "config.init.policy_checkpoint"
    if record is None:
      raise ValueError(
          f"{field}: this LoRA run's checkpoints hold only adapters, and "
          f"the workdir has no {lora.BASE_RECORD} naming their base; "
          "restore that file, or start a fresh --workdir.")
    try:
      base = self.load_base()
    except ValueError as e:
      raise ValueError(f"{field}: the base of this LoRA run's adapters "
                       f"cannot be loaded: {e}") from None
    lora.check_base(base, record, field, fix="Put the original base back, "
                    "or start a fresh --workdir.")
    return state.replace(frozen=dict(state.frozen, **{BASE: base}))


def setup(trainer) -> Optional[LoraRun]:
  """The run's `LoraRun`, or None when config.lora.rank is 0."""
  spec = lora.LoraSpec.from_config(trainer.config.lora)
  return None if spec is None else LoraRun(trainer, spec)
