"""A Plackett-Luce reward model learns K-wise rankings from files."""

import jax
import jax.numpy as jnp
import numpy as np

from conftest import from_scratch, tiny_config, trainer_of
from jaxrlhf import sharding
from jaxrlhf.data import synthetic
from jaxrlhf.data import synthetic_feedback
from jaxrlhf.models import heads
from jaxrlhf.algorithms.offline import reward_model

RANKING = from_scratch(reward_model.RANKING)


def test_plackett_luce_reward_model_learns_gold_rankings(tmp_path):
  examples = synthetic.make_examples("train", 96)
  path = str(tmp_path / "rankings.jsonl")
  # Three completions per prompt with distinct gold rewards: the ideal
  # summary (1), the ideal plus a foreign word (< 1) and the foreign word
  # alone (0), ranked without annotator noise.
  def completions(e):
    foreign = next(w for w in synthetic.WORDS if w not in e["ideal"].split())
    return [e["ideal"], f"{e['ideal']} {foreign}", foreign]
  synthetic_feedback.write_synthetic_feedback(
      path, "ranking", [e["inputs"] for e in examples],
      [completions(e) for e in examples], synthetic.gold_reward,
      beta=float("inf"))
  config = tiny_config(algorithm="reward_model_ranking",
                       data__task="pl_rankings",
                       optimizer__warmup_steps=0)
  with config.unlocked():
    config.reward_model.num_completions = 3
  config.data.files.train = path
  with sharding.activate(config, jax.devices()[:1]) as mesh:
    trainer = trainer_of(RANKING, config, mesh)
    rules = trainer.rules
    state = trainer.init_state()
    batches = trainer.train_batches(0)
    first = None
    for _ in range(60):
      batch = sharding.global_batch(next(batches), mesh, rules)
      state, metrics = trainer.train_step(state, batch)
      first = first or jax.device_get(metrics)
    last = jax.device_get(metrics)
    rewards = np.asarray(reward_model.ranked_rewards(trainer.lm, state.params["reward"], batch))
  assert last["loss"] < first["loss"]
  assert last["pairwise_accuracy"] > 0.8 > first["pairwise_accuracy"]
  # Rewards follow the labelled order on most rows of the last batch.
  ordered = (rewards[:, 0] > rewards[:, 1]) & (rewards[:, 1] > rewards[:, 2])
  assert ordered.mean() > 0.6


def test_all_pairs_ranking_loss_option_is_instructgpt_loss(tmp_path):
  examples = synthetic.make_examples("train", 16)
  path = str(tmp_path / "rankings.jsonl")
  synthetic_feedback.write_synthetic_feedback(
      path, "ranking", [e["inputs"] for e in examples],
      [[e["ideal"], f"{e['ideal']} {e['ideal']}", "red"] for e in examples],
      synthetic.gold_reward, beta=1.0, seed=1)
  config = tiny_config(algorithm="reward_model_ranking",
                       data__task="all_pairs_rankings",
                       reward_model__ranking_loss="all_pairs",
                       reward_model__num_completions=3)
  config.data.files.train = path
  with sharding.activate(config, jax.devices()[:1]) as mesh:
    trainer = trainer_of(RANKING, config, mesh)
    rules = trainer.rules
    state = trainer.init_state()
    batch = sharding.global_batch(next(trainer.train_batches(0)), mesh, rules)
    # One compilation for both: the algorithm's loss and the rewards it saw.
    (loss, metrics), rewards = jax.jit(lambda params, frozen, b: (
        reward_model.rankings_loss(trainer, params, frozen, b, None),
        reward_model.ranked_rewards(trainer.lm, params["reward"], b)))(
            state.params, state.frozen, batch)
    rewards = np.asarray(rewards, np.float64)
  # Plain Python: -log sigmoid over the 3 ordered pairs of each ranking,
  # averaged per ranking (weight 1 / C(3, 2)), then over rankings.
  per_ranking = [np.mean([np.log1p(np.exp(-(r[a] - r[b])))
                          for a, b in ((0, 1), (0, 2), (1, 2))])
                 for r in rewards]
  np.testing.assert_allclose(loss, np.mean(per_ranking), rtol=1e-5)
  assert "pairwise_accuracy" in metrics


def test_decoder_only_ranking_reward_model_evaluates_on_its_rankings(
    tmp_path):
  """A Llama ranking RM: evaluation's loss and accuracies equal plain-Python
  ones over rewards read by hand at each completion's EOS."""
  examples = synthetic.make_examples("train", 8)
  rankings = [[e["ideal"], f"{e['ideal']} red", "red blue"] for e in examples]
  rankings[1] = rankings[1][:2]  # a ranking of 2 in a K = 3 batch
  paths = {}
  for split in ("train", "validation"):
    paths[split] = str(tmp_path / f"{split}.jsonl")
    synthetic_feedback.write_jsonl(
        [{"prompt": e["inputs"], "completions": c}
         for e, c in zip(examples, rankings)], paths[split])
  config = tiny_config(algorithm="reward_model_ranking",
                       data__task="llama_rankings", model__arch="llama",
                       model__size="tiny", model__num_encoder_layers=None,
                       reward_model__num_completions=3, eval__num_examples=8,
                       eval__batch_size=4)
  config.data.files.train = paths["train"]
  config.data.files.validation = paths["validation"]
  with sharding.activate(config, jax.devices()[:1]) as mesh:
    trainer = trainer_of(RANKING, config, mesh)
    state = trainer.init_state()
    metrics = trainer.evaluate(state)
  params = jax.device_get(state.params["reward"])
  vocabulary = trainer.vocabulary
  hidden_states = jax.jit(lambda p, t: trainer.model.apply(
      {"params": p}, t, jnp.arange(t.shape[1])[None], jnp.ones_like(t),
      method=trainer.model.hidden_states))

  def reward(prompt, completion):
    # Decoder-only layout by hand: prompt (its EOS dropped), completion,
    # EOS; the head reads the state at that EOS.
    tokens = (list(vocabulary.encode(prompt))
              + list(vocabulary.encode(completion)) + [vocabulary.eos_id])
    tokens = np.asarray(tokens, np.int32)[None]
    hidden = hidden_states(params["backbone"], tokens)
    return float(heads.apply_scalar_head(params["head"], hidden[0, -1]))

  losses, top1, pairwise = [], [], []
  for e, ranked in zip(examples, rankings):
    r = [reward(e["inputs"], c) for c in ranked]
    losses.append(-sum(r[k] - np.log(np.sum(np.exp(r[k:])))
                       for k in range(len(r))))
    top1.append(float(r[0] > max(r[1:])))
    pairs = [(a, b) for a in range(len(r)) for b in range(a + 1, len(r))]
    pairwise.append(np.mean([r[a] > r[b] for a, b in pairs]))
  np.testing.assert_allclose(metrics["eval/loss"], np.mean(losses),
                             rtol=1e-4)
  np.testing.assert_allclose(metrics["eval/top1_accuracy"], np.mean(top1))
  np.testing.assert_allclose(metrics["eval/pairwise_accuracy"],
                             np.mean(pairwise))
