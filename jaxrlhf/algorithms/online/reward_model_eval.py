"""How online algorithms are judged: against the reference, as every policy
algorithm is (`policy_eval`), plus, for a run with a reward model, its mean
score of the same samples (the proxy reward, to set against the gold reward
when looking for over-optimisation)."""

from typing import Dict

from jaxrlhf.algorithms import base
from jaxrlhf.algorithms.online import reward_sources
from jaxrlhf.algorithms import policy_eval
from jaxrlhf.eval import evaluation


def evaluate(trainer, state) -> Dict[str, float]:
  metrics = policy_eval.against_reference(trainer, state)
  prompts = policy_eval.eval_prompts(trainer)
  if prompts is None or not reward_sources.uses_reward_model(trainer.config):
    return metrics
  tokens = prompts[0]
  cfg = trainer.config
  # The same seed as the first draw of compare_with_reference: the same
  # samples the gold reward judged.
  samples = evaluation.sample(trainer, state.params["policy"], tokens,
                              greedy=False, temperature=cfg.eval.temperature,
                              seed=cfg.seed)
  scores = reward_sources.reward_scores(trainer, state.frozen["reward"],
                                        tokens, samples)
  metrics["eval/reward_model_score"] = evaluation.global_mean(
      float(scores.sum()), len(scores))
  return metrics


EVALUATION = base.Evaluation(
    evaluate=evaluate, describe=policy_eval.describe_against_reference,
    check=policy_eval.check_eval_task)
