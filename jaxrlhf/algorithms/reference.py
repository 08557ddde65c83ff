"""A policy trained against a frozen reference.

The policy and the reference both start from `config.init.policy_checkpoint`
(normally the SFT run); the reference stays fixed (unless the algorithm
moves it: TR-DPO) and is checkpointed with the run. `POLICY_AND_REFERENCE`
and `POLICY_ONLY` are the networks of the DPO family, KTO, BCO and DRO-V;
`reference_logprobs` is where their losses get log pi_ref: from the frozen
reference in the step, or precomputed once over the data
(`config.reference_logprobs.mode`, `precomputed_reference`).
"""

from typing import Dict, Sequence

import jax

from jaxrlhf import config_schema
from jaxrlhf.algorithms import base
from jaxrlhf.models import scoring

MODES = ("in_step", "precomputed")


REFERENCE_LOGPROBS = config_schema.Group(
    "reference_logprobs",
    "Where the reference log-probs of offline losses come from (for the "
    "algorithms whose loss reads them only per example: docs/config.md's "
    "algorithm table marks them).", [
        config_schema.Field(
            "mode", "in_step",
            "'in_step' runs the frozen reference on every batch; "
            "'precomputed' scores the training split with the reference once "
            "before training (TRL's precompute_ref_log_probs), stores the "
            "results in cache_dir and feeds them to the loss with each batch, "
            "so that training neither holds nor runs the reference "
            "(evaluation loads it from init.policy_checkpoint while it "
            "runs).", choices=MODES),
        config_schema.Field(
            "cache_dir", "",
            "Where the precomputed values live; '' = <workdir>/"
            "reference_logprobs. A resumed run reuses them; a cache made with "
            "another reference checkpoint, task, split, lengths or model is "
            "recomputed by a fresh run and is an error for a resumed one."),
        config_schema.Field(
            "batch_size", None,
            "Examples per forward pass of the precomputation; unset = the "
            "train step's micro-batch (train.batch_size / "
            "train.num_microbatches).", type=int, bounds=">0"),
    ])


# --- networks ------------------------------------------------------------------


def starting_checkpoint(config) -> str:
  """config.init.policy_checkpoint, which a policy algorithm needs."""
  path = config.init.policy_checkpoint
  if not path:
    raise ValueError(
        f"config.init.policy_checkpoint: {config.algorithm} starts "
        "from a trained policy (usually the SFT run's workdir) and uses it "
        "as the reference; set the path. (Random weights, '', are for the "
        "algorithms that train from scratch: the field's entry in "
        "docs/config.md names them.)")
  return path


def policy(trainer, rng):
  return {"policy": trainer.init_lm(rng)}


def reference(trainer, rng):
  if trainer.precomputed_reference:
    return {}
  return {"reference": trainer.init_lm(rng)}


def policy_and_reference_checkpoints(trainer) -> Dict[str, str]:
  path = starting_checkpoint(trainer.config)
  if trainer.precomputed_reference:
    return {"params/policy": path}
  return {"params/policy": path, "frozen/reference": path}


def policy_checkpoint(trainer) -> Dict[str, str]:
  return {"params/policy": starting_checkpoint(trainer.config)}


# The policy and its frozen reference (DPO's family, KTO, DRO-V).
POLICY_AND_REFERENCE = base.Networks(
    trainable=policy, frozen=reference,
    checkpoints=policy_and_reference_checkpoints, reference=True)
# A reference-free policy loss; evaluation still compares with the starting
# policy, loaded while it runs.
POLICY_ONLY = base.Networks(trainable=policy,
                            checkpoints=policy_checkpoint, reference=True)


# --- log-probs -------------------------------------------------------------------


def reference_logprobs(lm, precomputed, state, batch, names: Sequence[str]):
  """{name: [batch] log pi_ref(completion | prompt)}: from the frozen
  reference in `state`, or, when `precomputed` (the run's
  `PrecomputedReference`, or None), from the batch's `reference_logp_*`
  features."""
  if precomputed:
    return precomputed.logprobs(batch, names)
  return jax.lax.stop_gradient(scoring.sequence_logprobs(
      lm, state.frozen["reference"], batch, names))
