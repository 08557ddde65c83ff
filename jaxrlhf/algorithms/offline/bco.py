"""BCO (Jung et al. 2024) on thumbs up / down: the policy as a binary
classifier of its implicit reward against a running reward shift
(`jaxrlhf.losses.bco_losses`).

The shift is the running mean of the implicit rewards of every example seen
so far, this batch's included (as TRL's BCOTrainer keeps it); it is carried
between steps in the train state (`algorithm_state["reward_mean"]`, with
the count of rewards it averages), checkpointed, and resumed exactly. It is
estimated from the whole batch, so micro-batches are refused.
"""

from jaxrlhf import config_schema
from jaxrlhf.algorithms import base
from jaxrlhf.algorithms.offline import training
from jaxrlhf.algorithms import policy_eval
from jaxrlhf.algorithms import reference
from jaxrlhf.losses import bco_losses as bco_losses
from jaxrlhf.models import scoring

F = config_schema.Field

GROUP = config_schema.Group(
    "bco", "BCO on thumbs up/down (algorithm bco).", [
        F("beta", 0.1, "beta of the implicit reward beta * log(pi / pi_ref) "
          "(TRL's default 0.1).", bounds=">0"),
    ])

MEAN, COUNT = "reward_mean", "reward_count"
COMPLETION = ("completion",)


def loss(trainer, params, state, batch, rng):
  del rng
  pi = scoring.sequence_logprobs(trainer.lm, params["policy"], batch,
                                 COMPLETION)
  ref = reference.reference_logprobs(
      trainer.lm, trainer.precomputed_reference, state, batch, COMPLETION)
  return bco_losses.bco_loss(
      pi["completion"], ref["completion"], batch["label"] > 0.5,
      beta=trainer.config.bco.beta,
      running_mean=state.algorithm_state[MEAN],
      running_count=state.algorithm_state[COUNT])


def carry(trainer, before, after, metrics):
  """The reward shift after this batch, as the loss computed it."""
  del trainer, before
  return after.replace(algorithm_state={MEAN: metrics["delta"],
                                        COUNT: metrics["delta_count"]})


ALGORITHM = base.Algorithm(
    name="bco",
    summary="Binary Classifier Optimization on thumbs up/down: the implicit "
    "reward against a running reward shift.",
    data="thumbs",
    networks=reference.POLICY_AND_REFERENCE,
    training=training.Offline(
        loss=loss, precomputable_reference=True, carry=carry,
        batch_statistics=lambda c: "its reward shift (the running mean of "
        "the implicit rewards, this batch's included)"),
    carried=base.Carried(init=lambda config: {MEAN: 0.0, COUNT: 0.0}),
    evaluation=policy_eval.AGAINST_REFERENCE,
    config_groups=(GROUP, reference.REFERENCE_LOGPROBS),
)
