"""Shared settings of the paper-reproduction configs under configs/.

It imports nothing that needs JAX or the data stack (only `defaults` for
`base_config()` and `PLACEHOLDER`, and the constant-only `sharding_rules`
and `data.names`): the command line runs a config file against the index of
fields before it imports the library (`jaxrlhf.cli.early_unknown_field`).
"""

import ml_collections

from jaxrlhf import defaults
from jaxrlhf import sharding_rules
from jaxrlhf.data import names

# T5's public SentencePiece model (what T5 1.1 checkpoints were trained with).
T5_VOCABULARY = "gs://t5-data/vocabs/cc_all.32000/sentencepiece.model"


def ultrafeedback_offline(algorithm: str, size: str, mesh_shape, num_steps: int):
  """An offline run on UltraFeedback from a T5X SFT checkpoint, with the DRO
  paper's settings (section 4): Adafactor with decay rate 0.8, 150 linear
  warm-up steps, learning rate 1e-4, batch 32, tau = 1, checkpoints every
  2,000 steps, rewards (ratings) normalised to mean 0 and variance 1. How
  the step fits the slice (scanned layers, micro-batches, sharding) is set
  from its plan (`python -m jaxrlhf.plan`) and changes no number.

  The paths are fields to point at your copies:
    init.policy_checkpoint   the T5X SFT checkpoint (policy and reference);
    data.files.train         UltraFeedback JSONL/Parquet files;
    data.files.vocabulary    the SentencePiece model of the checkpoint.
  """
  c = defaults.base_config()
  c.algorithm = algorithm
  c.model.size = size
  c.model.dtype = "bfloat16"
  c.model.vocab_size = 32128
  bucket = f"gs://{defaults.PLACEHOLDER}"
  c.init.policy_checkpoint = f"{bucket}/t5x/sft_t5_1_1_{size}/checkpoint_1000000"
  c.data.task = f"ultrafeedback_{algorithm}"
  c.data.files.train = f"{bucket}/ultrafeedback/train-*.parquet"
  c.data.files.layout = "ultrafeedback"
  c.data.files.vocabulary = T5_VOCABULARY
  c.data.files.on_bad_row = "skip_and_report"
  c.data.inputs_length = 1024
  c.data.targets_length = 512
  c.train.num_steps = num_steps
  c.train.batch_size = 32
  c.train.log_every = 100
  c.optimizer.name = "adafactor"
  c.optimizer.decay_rate = 0.8
  c.optimizer.learning_rate = 1e-4
  c.optimizer.warmup_steps = 150
  c.optimizer.grad_clip_norm = 0.0
  c.dro.tau = 1.0
  c.dro.value_learning_rate = 1e-4
  c.checkpoint.every_steps = 2000
  c.checkpoint.keep = 3
  c.eval.every_steps = 0
  c.mesh.shape = tuple(mesh_shape)
  c.mesh.axis_names = ("data", "model")
  # Fitted to 16 GiB v5e chips with 2 GiB to spare at the fewest FLOPs
  # (experiments/results/plans/): scanned layers that keep their matmul
  # outputs, each batch's gradient accumulated over 2 micro-batches, and for
  # T5-XL the parameters split over the data axis as well.
  scanned_layers(c)
  c.train.num_microbatches = 2
  if size == "xl":
    c.sharding.logical_axis_rules = sharding_rules.FULLY_SHARDED_RULES
  return c


def scanned_layers(c) -> None:
  """Each layer stack compiled once (`model.scan_layers`: a T5-XL step
  compiles in minutes instead of about 20 on a host CPU), saving only the
  matmul outputs of each layer for the backward pass: a scanned stack saves
  every intermediate of its layers unless told what to keep, and
  `dots_saveable` keeps what the FLOPs are spent on (the backward pass
  recomputes only element-wise work). T5X checkpoints, unrolled, are
  restacked when loaded. experiments/results/plans/ compares the options."""
  c.model.scan_layers = True
  c.model.remat_policy = "dots_saveable"


# --- the DRO paper's evaluation -----------------------------------------------------


def dro_paper_evaluation(c) -> None:
  """The DRO paper's evaluation and checkpoint selection (section 4), set in
  place on an UltraFeedback policy run.

  "For each model, we record a checkpoint every 2,000 training steps, before
  selecting the best checkpoint across the training curve as determined by
  side-by-side comparison against the SFT policy", and the win rates are
  reported "over 5 evaluation folds of 1,000 test prompts each". Here:
  every 2,000 steps the policy is judged side by side against the SFT
  reference on 5,000 held-out validation prompts (5 folds of 1,000), the
  checkpoint with the highest win rate is kept in <workdir>/best, and after
  training it is judged on 5,000 other held-out test prompts, in 5 folds
  (`test/win_rate`, `test/win_rate_fold_std`). UltraFeedback has only a
  train split, so both held-out sets are distinct prompts taken out of the
  training files (data.files.holdout_*_prompts; every rating of such a
  prompt leaves training with it).

  The judge: the paper asks PaLM 2 which response is more helpful. Here a
  reward model trained on UltraFeedback judges (configs/reward_model.py's
  run: eval.judge_checkpoint); for an LLM judge, write judge(prompts,
  first, second) -> P(first better) and pass
  --config.eval.judge=function --config.eval.judge_function=pkg.module:fn.
  The paper gives no sampling temperature for its comparisons; 1.0 is used.
  """
  c.data.files.holdout_validation_prompts = 5000
  c.data.files.holdout_test_prompts = 5000
  c.eval.every_steps = 2000
  c.eval.split = "validation"
  c.eval.test_split = "test"
  c.eval.num_examples = 5000
  c.eval.num_folds = 5
  c.eval.num_samples = 1
  c.eval.temperature = 1.0
  c.eval.batch_size = 64
  c.eval.judge = "reward_model"
  c.eval.judge_checkpoint = (f"gs://{defaults.PLACEHOLDER}/"
                             "ultrafeedback_reward_model_t5_1_1_large")
  c.checkpoint.best_metric = "eval/win_rate"
  c.checkpoint.best_mode = "max"


# --- TL;DR with Pythia ("N+ implementation details of RLHF with PPO") ---------------

# Prompt length: the query's 512 tokens (detail 2); a T5 encoder also reads
# the EOS the task appends to every prompt (`models.prompt_feature_length`).
TLDR_QUERY_TOKENS = 512
# The SFT summaries and the PPO responses: 53 tokens with the leading space
# and the EOS (detail 4; Table 7's sampled length); the preference data's
# completions: up to 169 (detail 4).
TLDR_SFT_RESPONSE_TOKENS = 53
TLDR_PREFERENCE_RESPONSE_TOKENS = 169


def tldr_pythia(algorithm: str, size: str, *, learning_rate: float,
                schedule: str, batch_size: int, episodes: int):
  """A stage of the TL;DR pipeline on Pythia, as the N+ implementation
  details paper ran it: AdamW with eps 1e-5 (Tables 3, 4, 6, 7), bf16
  compute (detail 8), no dropout (detail 7; GPT-NeoX has none), the Pythia
  tokenizer, whose EOS `<|endoftext|>` is id 0 and padding `<|padding|>`
  id 1: the vocabulary exchanges the two (padding 0, EOS 1) and the Pythia
  checkpoint's token rows are exchanged with them when it is loaded, so
  padding is never the EOS (detail 3). Steps: `episodes` // `batch_size`.

  The paths are fields to point at your copies:
    data.files.vocabulary   Pythia's tokenizer.json (EleutherAI/pythia-*;
                            its tokenizer_config.json beside it is read), a
                            local file;
    data.files.train / validation   the stage's data (see each config).
  Tables 3, 4 and 7 give no weight decay, warm-up or gradient clipping:
  weight decay 0, no warm-up, and this framework's default clipping (1.0).
  """
  c = defaults.base_config()
  c.algorithm = algorithm
  c.model.arch = "gpt_neox"
  c.model.size = size
  c.model.dtype = "bfloat16"
  c.model.dropout_rate = 0.0
  # Read from the local disk (the data files may be anywhere tf.io.gfile
  # reads, gs:// included).
  c.data.files.vocabulary = f"/{defaults.PLACEHOLDER}/{size}/tokenizer.json"
  c.data.files.on_bad_row = "skip_and_report"
  c.data.inputs_length = TLDR_QUERY_TOKENS
  tldr_optimizer(c, learning_rate=learning_rate, schedule=schedule,
                 batch_size=batch_size, episodes=episodes)
  c.train.log_every = 10
  c.checkpoint.every_steps = 200
  # Every chip data-parallel (the paper: 8 GPUs), each network's parameters,
  # gradients and optimizer state split over them (on 16 GiB TPU chips a
  # replicated Pythia-1B with AdamW would not fit).
  c.mesh.shape = (-1, 1)
  c.sharding.logical_axis_rules = sharding_rules.FULLY_SHARDED_RULES
  # On 8 v5e chips with 2 GiB to spare (experiments/results/plans/).
  scanned_layers(c)
  c.train.num_microbatches = 2
  return c


def tldr_t5(algorithm: str, size: str, mesh_shape) -> ml_collections.ConfigDict:
  """A stage of the TL;DR pipeline with a T5 1.1 model (bf16 compute, T5's
  SentencePiece vocabulary, no dropout) on a TPU mesh; the stage's data and
  settings are set by `tldr_data` / `tldr_ppo`."""
  c = defaults.base_config()
  c.algorithm = algorithm
  c.model.size = size
  c.model.dtype = "bfloat16"
  c.model.vocab_size = 32128
  c.model.dropout_rate = 0.0
  c.data.files.vocabulary = T5_VOCABULARY
  c.data.files.on_bad_row = "skip_and_report"
  c.data.inputs_length = TLDR_QUERY_TOKENS + 1
  c.train.log_every = 10
  c.checkpoint.every_steps = 200
  c.mesh.shape = tuple(mesh_shape)
  return c


def tldr_optimizer(c, *, learning_rate: float, schedule: str,
                   batch_size: int, episodes: int) -> None:
  """The paper's optimizer and budget (Tables 3, 4, 6, 7): AdamW with eps
  1e-5, no weight decay or warm-up, `episodes` // `batch_size` steps."""
  c.optimizer.name = "adamw"
  c.optimizer.eps = 1e-5
  c.optimizer.b1 = 0.9
  c.optimizer.b2 = 0.999
  c.optimizer.weight_decay = 0.0
  c.optimizer.learning_rate = learning_rate
  c.optimizer.schedule = schedule
  c.optimizer.warmup_steps = 0
  c.train.batch_size = batch_size
  c.train.num_steps = episodes // batch_size


def tldr_ppo(c) -> None:
  """PPO as the paper ran it on TL;DR (Table 7, details 20-25), on the SFT
  data's prompts: 1M episodes of 512 prompts per iteration (reshuffled
  every pass: detail 21), AdamW (eps 1e-5, lr 3e-6) with a linear
  schedule, beta 0.05, gamma 1, lambda 0.95, 1 minibatch, 4 PPO epochs,
  policy and value clipping 0.2, value loss weight 0.1, 53 sampled tokens
  at temperature 0.7 with the EOS trick (-1 without an EOS), advantage
  whitening, no reward whitening; the value network starts from the reward
  model (detail 22). The prompts are fitted to data.inputs_length by
  dropping the post's last paragraphs (detail 2); "\\n\\nTL;DR:" is never
  cut (online.prompt_suffix). Evaluation: against the SFT policy side by
  side on the SFT validation prompts, judged by the reward model."""
  tldr_optimizer(c, learning_rate=3e-6, schedule="linear", batch_size=512,
                 episodes=1_000_000)
  c.init.policy_checkpoint = f"{TLDR_BUCKET}/tldr_sft"
  c.online.reward_model_checkpoint = f"{TLDR_BUCKET}/tldr_rm"
  tldr_data(c, "sft", task="tldr_sft_prompts")
  c.online.max_new_tokens = TLDR_SFT_RESPONSE_TOKENS
  c.online.prompt_suffix = names.TLDR_QUERY_SUFFIX
  c.online.long_prompts = "cut_paragraph"
  c.online.temperature = 0.7
  c.online.kl_coef = 0.05
  c.online.adaptive_kl = False
  c.online.eos_trick = True
  c.online.missing_eos_penalty = -1.0
  c.online.samples_per_prompt = 1
  c.online.num_epochs = 4
  c.online.num_minibatches = 1
  c.online.clip_eps = 0.2
  c.ppo.gamma = 1.0
  c.ppo.lam = 0.95
  c.ppo.value_clipping = True
  c.ppo.value_clip_eps = 0.2
  c.ppo.vf_coef = 0.1
  c.ppo.whiten_rewards = False
  c.ppo.whiten_advantages = True
  tldr_judged_by_reward_model(c)


# The TL;DR data of each stage: (task name, files.layout, the folder under
# the placeholder bucket, file pattern, response tokens).
TLDR_DATA = {
    "sft": ("tldr_sft", "tldr_sft", "tldr_sft", "{split}.jsonl",
            TLDR_SFT_RESPONSE_TOKENS),
    "comparisons": ("tldr_comparisons", "tldr", "tldr_comparisons",
                    "{split}/*.json", TLDR_PREFERENCE_RESPONSE_TOKENS),
}
TLDR_BUCKET = f"gs://{defaults.PLACEHOLDER}"


def tldr_data(c, kind: str, task: str = "") -> None:
  """Points the config at the TL;DR files of `kind` ('sft': the
  demonstrations, or 'comparisons': the preference pairs), train and
  validation splits, under `TLDR_BUCKET` (point data.files.train /
  validation at your copies), with the stage's response length; `task`
  names the registered task ('' = the kind's own name)."""
  name, layout, folder, pattern, response_tokens = TLDR_DATA[kind]
  c.data.task = task or name
  c.data.files.layout = layout
  c.data.files.train = f"{TLDR_BUCKET}/{folder}/" + pattern.format(
      split="train")
  c.data.files.validation = f"{TLDR_BUCKET}/{folder}/" + pattern.format(
      split="validation")
  c.data.targets_length = response_tokens


def tldr_judged_by_reward_model(c) -> None:
  """How the TL;DR policy configs judge: side by side against the SFT
  policy on the held-out prompts, by the TL;DR reward model. (The paper
  judges its policies against the human reference summaries with GPT-3.5,
  in random order; plug such a judge in with
  --config.eval.judge=function --config.eval.judge_function=pkg.module:fn.)
  """
  c.eval.judge = "reward_model"
  c.eval.judge_checkpoint = f"{TLDR_BUCKET}/tldr_rm"
  c.eval.num_examples = 1000
  c.eval.num_samples = 1
  c.eval.temperature = 0.7
  c.eval.batch_size = 64
