"""Every experiment config constructs, validates and starts training.

The paper configs (T5 1.1 Large/XL on TPU slices) are run with their sizes
overridden to the tiny T5 of tests/fixtures/t5x/encdec, whose T5X
checkpoint stands in for the SFT checkpoint, on a small UltraFeedback file
the test writes; the DRO configs with their evaluation (a sized-down
reward_model.py run judges). The TL;DR configs run as a pipeline (SFT from
a tiny GPT-NeoX written as a Hugging Face folder, with the Pythia-style
tokenizer fixture; reward model; DPO; PPO) on small TL;DR files.
"""

import json
import pathlib

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from conftest import FIXTURES, REPO
from jaxrlhf import defaults
from jaxrlhf.data import synthetic
from jaxrlhf.data import tasks
from jaxrlhf.train import loop

CONFIGS = sorted(p.name for p in (REPO / "configs").glob("*.py"))
NEOX_TOKENIZER = FIXTURES / "tokenizers" / "neox_style" / "tokenizer.json"
PAPER_CONFIGS = ["dpo.py", "dro_t5l.py", "dro_t5xl.py", "ipo.py", "kto.py",
                 "reward_model.py", "slic.py"]


def load(name, arg=None):
  return defaults.load_config_file(REPO / "configs" / name, arg)


@pytest.mark.parametrize("name", CONFIGS)
def test_config_constructs_and_validates(name):
  config = load(name)
  defaults.validate(config)
  # Every field of the experiment exists in the documented base config.
  def paths(c, prefix=""):
    for k, v in c.items():
      if hasattr(v, "items"):
        yield from paths(v, f"{prefix}{k}.")
      else:
        yield f"{prefix}{k}"
  assert set(paths(config)) == set(paths(defaults.base_config()))


def test_dro_configs_evaluate_and_select_as_the_paper():
  """Section 4: checkpoints every 2,000 steps, the best against SFT kept,
  win rates over 5 folds of 1,000 test prompts."""
  for c in (load("dro_t5xl.py"), load("dro_t5l.py")):
    assert c.eval.every_steps == 2000 and c.checkpoint.every_steps == 2000
    assert (c.eval.num_folds, c.eval.num_examples) == (5, 5 * 1000)
    assert (c.eval.split, c.eval.test_split) == ("validation", "test")
    assert (c.data.files.holdout_validation_prompts,
            c.data.files.holdout_test_prompts) == (5000, 5000)
    assert (c.checkpoint.best_metric, c.checkpoint.best_mode) == (
        "eval/win_rate", "max")
    assert c.eval.judge in ("reward_model", "function")


def test_paper_configs_use_the_papers_settings():
  xl, large = load("dro_t5xl.py"), load("dro_t5l.py")
  assert (xl.model.size, xl.mesh.shape, xl.train.num_steps) == (
      "xl", (4, 8), 20_000)
  assert (large.model.size, large.mesh.shape, large.train.num_steps) == (
      "large", (4, 4), 40_000)
  for c in (xl, large):
    assert c.algorithm == "dro_v" and c.dro.tau == 1.0
    assert c.optimizer.name == "adafactor" and c.optimizer.decay_rate == 0.8
    assert c.optimizer.warmup_steps == 150 and c.optimizer.learning_rate == 1e-4
    assert c.train.batch_size == 32 and c.checkpoint.every_steps == 2000
    assert c.data.files.layout == "ultrafeedback"


def test_kto_config_is_the_dro_papers_kto_baseline():
  """Section 4: tau 5 was KTO's best (Figure 4), re-used for XL; T5-L trains
  40,000 steps, XL 20,000; the loss is not weighted."""
  large, xl = load("kto.py"), load("kto.py", "xl")
  assert (large.model.size, large.mesh.shape, large.train.num_steps) == (
      "large", (4, 4), 40_000)
  assert (xl.model.size, xl.mesh.shape, xl.train.num_steps) == (
      "xl", (4, 8), 20_000)
  for c in (large, xl):
    assert c.algorithm == "kto" and c.kto.beta == 5.0
    assert c.kto.desirable_weight == c.kto.undesirable_weight == 1.0
    assert c.optimizer.name == "adafactor" and c.optimizer.decay_rate == 0.8
    assert c.train.batch_size == 32 and c.optimizer.learning_rate == 1e-4
  with pytest.raises(ValueError, match="kto.py:base"):
    load("kto.py", "base")


def _ultrafeedback_file(path: pathlib.Path, n=24):
  rows = []
  for i, ex in enumerate(synthetic.make_examples("train", n)):
    rows.append({"instruction": ex["inputs"], "completions": [
        {"response": ex["ideal"], "overall_score": 8.0 + i % 2},
        {"response": ex["targets"] + " owl", "overall_score": 3.0},
        {"response": ex["targets"], "overall_score": 5.0},
    ]})
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def sized_down(name, tmp_path, t5x_fixtures):
  """A paper config on the tiny T5 of tests/fixtures/t5x/encdec (its T5X
  checkpoint standing in for the SFT one) and a small UltraFeedback file."""
  config = load(name)
  fixture = json.load(open(t5x_fixtures / "encdec" / "config.json"))["T5Config"]
  vocab_file = tasks.synthetic_vocabulary().sentencepiece_model_file
  with config.unlocked():
    config.model.update(
        size="tiny", vocab_size=fixture["vocab_size"], dtype="float32",
        emb_dim=fixture["emb_dim"], num_heads=fixture["num_heads"],
        head_dim=fixture["head_dim"], mlp_dim=fixture["mlp_dim"],
        num_encoder_layers=fixture["num_encoder_layers"],
        num_decoder_layers=fixture["num_decoder_layers"])
    config.init.policy_checkpoint = str(t5x_fixtures / "encdec" / "checkpoint_3")
    config.data.files.train = str(_ultrafeedback_file(tmp_path / "uf.jsonl"))
    config.data.files.vocabulary = vocab_file
    config.data.inputs_length = config.data.targets_length = 16
    config.mesh.shape = (-1, 1)
    config.train.update(num_steps=2, batch_size=4, log_every=1)
    config.eval.num_examples = 4
  return config


@pytest.fixture(scope="module")
def ultrafeedback_reward_model(tmp_path_factory, t5x_fixtures):
  """configs/reward_model.py sized down: the judge of the DRO configs."""
  tmp_path = tmp_path_factory.mktemp("uf_rm")
  loop.train(sized_down("reward_model.py", tmp_path, t5x_fixtures),
             str(tmp_path / "run"))
  return tmp_path / "run"


@pytest.mark.parametrize("name", PAPER_CONFIGS)
def test_paper_config_starts_when_sized_down(name, tmp_path, t5x_fixtures,
                                             ultrafeedback_reward_model):
  config = sized_down(name, tmp_path, t5x_fixtures)
  dro = name.startswith("dro_")
  if dro:  # the paper's evaluation, on 4 + 4 held-out prompts in 2 folds
    with config.unlocked():
      config.data.files.holdout_validation_prompts = 4
      config.data.files.holdout_test_prompts = 4
      config.eval.update(num_folds=2, every_steps=1, judge_checkpoint=str(
          ultrafeedback_reward_model))
  summary = loop.train(config, str(tmp_path / "run"))
  rows = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl")]
  losses = [r["loss"] for r in rows if "loss" in r]
  assert len(losses) == 2 and all(abs(l) < 1e6 for l in losses)
  assert isinstance(summary, dict)
  if dro:
    for prefix in ("eval", "test"):
      assert 0 <= summary[f"{prefix}/win_rate"] <= 1
      assert f"{prefix}/win_rate_fold_stderr" in summary
    best = json.load(open(tmp_path / "run" / "best" / "best.json"))
    assert best["metric"] == "eval/win_rate" and best["step"] in (1, 2)
    assert summary["test/step"] == best["step"]


def test_ppo_t5xl_starts_when_sized_down(tmp_path, t5x_fixtures,
                                        ultrafeedback_reward_model):
  """configs/ppo_t5xl.py as it fits a v5e 4x8 slice (fully sharded rules,
  scanned layers started from t5x's unrolled checkpoint, remat, gradients
  accumulated over micro-batches) on the tiny T5 and small TL;DR files."""
  config = sized_down("ppo_t5xl.py", tmp_path, t5x_fixtures)
  assert config.model.scan_layers and config.train.num_microbatches > 1
  files = _tldr_files(tmp_path)
  with config.unlocked():
    config.data.files.train = files["sft_train"]
    config.data.files.validation = files["sft_validation"]
    config.data.inputs_length = 64
    config.online.max_new_tokens = 8
    config.online.reward_model_checkpoint = str(ultrafeedback_reward_model)
    config.eval.judge_checkpoint = str(ultrafeedback_reward_model)
    config.train.num_microbatches = 2
  summary = loop.train(config, str(tmp_path / "run"))
  rows = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl")]
  losses = [r["loss"] for r in rows if "loss" in r]
  assert len(losses) == 2 and all(np.isfinite(losses))
  assert 0 <= summary["eval/win_rate"] <= 1


# --- TL;DR on Pythia, sized down ------------------------------------------------

TLDR_WORDS = "the cat sat on mat dog log a and met model learns".split()


def _tldr_files(tmp_path):
  rng = np.random.default_rng(0)
  words = lambda n: " ".join(rng.choice(TLDR_WORDS, n))
  post = lambda i: "\n".join(words(5) for _ in range(1 + i % 3))
  demonstrations = lambda n: [
      {"subreddit": "cats", "title": words(2), "post": post(i),
       "summary": words(3)} for i in range(n)]
  comparisons = lambda n: [
      {"info": {"subreddit": "cats", "title": words(2), "post": post(i)},
       "summaries": [{"text": words(3)}, {"text": words(4)}],
       "choice": i % 2, "batch": f"batch{6 + i % 2}",
       "extra": {"confidence": 1 + i % 9}} for i in range(n)]
  def write(name, rows):
    (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(tmp_path / name)
  return {"sft_train": write("sft_train.jsonl", demonstrations(16)),
          "sft_validation": write("sft_val.jsonl", demonstrations(8)),
          "train": write("cmp_train.json", comparisons(16)),
          "validation": write("cmp_val.json", comparisons(8))}


def _tiny_pythia_folder(path):
  """A random tiny GPT-NeoX written as a Hugging Face folder: the SFT
  stage's pretrained checkpoint."""
  # pylint: disable=g-import-not-at-top
  from jaxrlhf.models import gpt_neox
  from jaxrlhf.models.loading import export_hf
  module = gpt_neox.GPTNeoX(gpt_neox.GPTNeoXConfig(
      vocab_size=384, emb_dim=32, num_heads=2, num_layers=1, mlp_dim=64))
  params = module.init(jax.random.PRNGKey(0), jnp.ones((1, 4), jnp.int32),
                       jnp.arange(4)[None], jnp.ones((1, 4), jnp.int32))
  export_hf(module, params["params"], str(path))
  return str(path)


def tldr_sized_down(name, files):
  config = load(name)
  with config.unlocked():
    config.model.update(size="tiny", vocab_size=384, dtype="float32",
                        emb_dim=32, num_heads=2, mlp_dim=64,
                        num_decoder_layers=1)
    config.data.files.vocabulary = str(NEOX_TOKENIZER)
    config.data.inputs_length = 80
    config.data.targets_length = 12
    config.mesh.shape = (-1, 1)
    config.train.update(num_steps=2, batch_size=4, log_every=1,
                        num_microbatches=1)
    config.eval.update(num_examples=4, batch_size=4)
    if config.online.reward_model_checkpoint:
      config.online.max_new_tokens = 12
  return config


@pytest.fixture(scope="module")
def tldr_pipeline(tmp_path_factory):
  """The four TL;DR configs, each 2 steps, each stage reading the last."""
  tmp_path = tmp_path_factory.mktemp("tldr")
  files = _tldr_files(tmp_path)
  runs, summaries = {}, {}
  for stage, init in (("sft", _tiny_pythia_folder(tmp_path / "pythia")),
                      ("rm", None), ("dpo", None), ("ppo", None)):
    config = tldr_sized_down(f"tldr_pythia_{stage}.py", files)
    sft_data = stage in ("sft", "ppo")
    with config.unlocked():
      config.init.policy_checkpoint = init or runs["sft"]
      config.data.files.train = files["sft_train" if sft_data else "train"]
      config.data.files.validation = files[
          "sft_validation" if sft_data else "validation"]
      if stage == "rm":
        config.reward_model.normalize_files = files["sft_train"]
      if stage in ("dpo", "ppo"):
        config.eval.judge_checkpoint = runs["rm"]
      if stage == "ppo":
        config.online.reward_model_checkpoint = runs["rm"]
    runs[stage] = str(tmp_path / stage)
    summaries[stage] = loop.train(config, runs[stage])
  return runs, summaries


@pytest.mark.parametrize("stage", ["sft", "rm", "dpo", "ppo"])
def test_tldr_config_starts_when_sized_down(tldr_pipeline, stage):
  runs, summaries = tldr_pipeline
  rows = [json.loads(l) for l in open(f"{runs[stage]}/metrics.jsonl")]
  losses = [r["loss"] for r in rows if "loss" in r]
  assert len(losses) == 2 and all(np.isfinite(losses))
  summary = summaries[stage]
  if stage == "sft":
    assert np.isfinite(summary["eval/loss"])
  if stage == "rm":
    # Detail 15: normalised on the SFT summaries; detail 16: by batch and
    # confidence.
    [after] = [r["reward_normalization/mean_after"] for r in rows
               if "reward_normalization/mean_after" in r]
    assert abs(after) < 1e-5
    assert {"eval/accuracy_batch6", "eval/accuracy_batch7",
            "eval/accuracy_confidence1"} <= set(summary)
  if stage == "dpo":
    assert summary["eval_before/implicit_reward_accuracy"] == 0.5
    assert "eval/implicit_reward_accuracy_batch6" in summary
  if stage in ("dpo", "ppo"):
    assert 0 <= summary["eval/win_rate"] <= 1  # judged by the TL;DR RM


def test_reference_docs_are_current():
  """docs/config.md is rendered from the registry and the declarations."""
  from jaxrlhf import docs
  assert docs.PATH.read_text() == docs.render(), (
      "docs/config.md is out of date: run python -m jaxrlhf.docs")


def test_field_index_is_current_and_rebuilds_the_base_config():
  """jaxrlhf/config_index.py is rendered from the declarations, and the
  config the command line builds from it (before it imports the library)
  has base_config()'s fields, with their types and defaults."""
  from jaxrlhf import cli, config_index, docs

  def leaves(c, prefix=""):
    out = {}
    for name, value in c.items():
      if isinstance(value, ml_collections.ConfigDict):
        out.update(leaves(value, f"{prefix}{name}."))
      else:
        out[prefix + name] = (c.get_type(name), value)
    return out

  assert docs.INDEX_PATH.read_text() == docs.render_index(), (
      "jaxrlhf/config_index.py is out of date: run python -m jaxrlhf.docs")
  base = leaves(defaults.base_config())
  assert base["train.num_steps"][0] is int and len(base) > 100
  assert leaves(cli.config_from_fields(config_index.FIELDS)) == base


@pytest.mark.parametrize("field,value,message", [
    ("kto.beta", -0.1, "config.kto.beta: -0.1 must be > 0"),
    ("checkpoint.every_steps", -1,
     "config.checkpoint.every_steps: -1 must be >= 0"),
    ("dpo.beta", -0.1, "config.dpo.beta: -0.1 must be > 0"),
    ("ppo.lam", 1.5, "config.ppo.lam: 1.5 must be in [0, 1]"),
    ("model.dropout_rate", 1.0, "config.model.dropout_rate: 1.0 must be in "
     "[0, 1)"),
    ("optimizer.learning_rate", float("nan"),
     "config.optimizer.learning_rate: nan is not a finite number"),
    ("optimizer.name", "adam", "config.optimizer.name: 'adam' is not one of"),
    ("online.samples_per_prompt", 0,
     "config.online.samples_per_prompt: 0 must be > 0"),
    ("eval.judge", "gpt", "config.eval.judge: 'gpt' is not one of"),
    ("eval.num_folds", 3, "config.eval.num_folds: 3 folds do not split "
     "eval.num_examples (256) evenly"),
    ("checkpoint.best_metric", "win_rate", "config.checkpoint.best_metric: "
     "'win_rate' is not an evaluation metric"),
    ("checkpoint.best_metric", "eval/win_rate", "config.checkpoint.best_metric:"
     " 'eval/win_rate' picks among periodic evaluations, but "
     "eval.every_steps is 0"),
    ("algorithm", "grpo", "config.algorithm: 'grpo' would not run: "
     "config.pipeline.stages ('sft,data,"),
    ("data.files.holdout_test_prompts", 5,
     "config.data.files.holdout_test_prompts: 5 prompts of data.files.train "
     "are to be held out as the 'test' split, but data.files.train is not "
     "set"),
])
def test_every_field_is_range_checked_naming_it(field, value, message):
  config = load("quickstart.py")
  defaults.apply_overrides(config, {field: value})
  with pytest.raises(ValueError) as error:
    defaults.validate(config)
  assert str(error.value).startswith(message)


def test_every_declared_field_has_a_doc_and_a_default_of_its_range():
  from jaxrlhf import config_schema
  fresh = defaults.base_config()
  for path, field in config_schema.walk(defaults.groups()):
    assert field.doc.strip(), path
    # Every default is itself allowed (a declaration that contradicts its
    # own default would refuse the base config).
    assert field.value_error(config_schema.get(fresh, path)) is None, path


def test_overlap_settings_that_cannot_work_are_refused_naming_the_field():
  import jax  # pylint: disable=g-import-not-at-top
  from jaxrlhf import algorithms  # pylint: disable=g-import-not-at-top
  from jaxrlhf import sharding  # pylint: disable=g-import-not-at-top

  def refusal(check, **overrides):
    config = load("quickstart.py")
    defaults.apply_overrides(config, {"pipeline.stages": "",
                                      "rewards.reward_model.weight": 0.0,
                                      "rewards.gold_reward.weight": 1.0,
                                      **overrides})
    with pytest.raises(ValueError) as error:
      check(config)
    return str(error.value)

  assert refusal(lambda c: algorithms.check_rows(c, 1), **{
      "algorithm": "rejection_sampling", "online.off_policy_steps": 1,
      "online.off_policy_correction": "decoupled"}).startswith(
          "config.online.off_policy_correction: rejection_sampling trains on "
          "the responses it selects")
  assert refusal(lambda c: sharding.training_mesh(c, jax.devices()[:1]),
                 **{"algorithm": "grpo", "online.sampler_devices": 1}
                 ).startswith("config.online.sampler_devices: 1 sampler "
                              "devices out of 1")
