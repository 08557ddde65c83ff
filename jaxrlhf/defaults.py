"""The shared config every experiment starts from, and its validation.

An experiment file under `configs/` calls `base_config()` and changes what it
needs. Every field is documented here, where its default is set. Fields that
default to "unset" are typed placeholders: they may be set from the command
line with a value of their type, and resolve to something derived (documented
beside them) when left unset.
"""

import os
from typing import Optional

import ml_collections
from ml_collections import config_dict

from jaxrlhf import sharding

# Must equal jaxrlhf.recipes.registry.RECIPES's keys (a test checks).
ALGORITHMS = ("sft", "reward_model", "reward_model_ranking", "dpo", "kto",
              "kto_thumbs", "dro_v", "ppo", "rloo", "grpo", "reinforce", "rejection_sampling")
# The online algorithms: they sample from the policy inside the train step.
ONLINE_ALGORITHMS = ("ppo", "rloo", "grpo", "reinforce", "rejection_sampling")
OPTIMIZERS = ("adafactor", "adamw")
SCHEDULES = ("constant", "cosine", "linear")


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  # Which recipe trains: "sft" (supervised fine-tuning), "reward_model"
  # (Bradley-Terry on pairs), "reward_model_ranking" (Plackett-Luce on
  # K-wise rankings), "dpo" (the direct preference family on pairs,
  # see dpo.loss_type), "kto" (on trajectories: desirable = reward above the
  # batch mean), "kto_thumbs" (on thumbs up/down), "dro_v" (on trajectories);
  # online, on the prompts of data.task scored by a reward model (see
  # `online`): "ppo", "rloo", "grpo", "reinforce", "rejection_sampling".
  c.algorithm = "sft"
  # Seeds parameter initialisation, dropout and data shuffling.
  c.seed = 0

  c.model = ml_collections.ConfigDict()
  # Architecture: "t5" (encoder-decoder), or the decoder-only "llama",
  # "gpt_neox", "t5x_decoder_only"; every algorithm runs on both kinds.
  c.model.arch = "t5"
  # Size preset: for t5 tiny, small, base, large, xl, xxl (T5 1.1
  # dimensions); for the others their presets (e.g. llama3.2-1b, pythia-1b).
  c.model.size = "tiny"
  # Output vocabulary size; unset = the task vocabulary's size rounded up to a
  # multiple of 128 (t5x pads 32100 to 32128 the same way).
  c.model.vocab_size = config_dict.placeholder(int)
  # Optional overrides of the preset's dimensions; unset = the preset's.
  c.model.emb_dim = config_dict.placeholder(int)
  c.model.num_heads = config_dict.placeholder(int)
  c.model.num_encoder_layers = config_dict.placeholder(int)
  c.model.num_decoder_layers = config_dict.placeholder(int)
  c.model.head_dim = config_dict.placeholder(int)
  c.model.mlp_dim = config_dict.placeholder(int)
  # "gated-gelu" (T5 1.1) or "relu" (T5 1.0).
  c.model.mlp = "gated-gelu"
  # Tie the output layer to the token embedding (T5 1.0 style).
  c.model.logits_via_embedding = False
  # Compute dtype ("float32" or "bfloat16"); parameters are always float32.
  c.model.dtype = "float32"
  c.model.dropout_rate = 0.0
  # Per-layer rematerialisation: "none", "full", "dots_saveable".
  c.model.remat_policy = "none"

  c.init = ml_collections.ConfigDict()
  # Where the policy starts: "" = random initialisation; a T5X checkpoint
  # (checkpoint_N or its model directory), or a jaxrlhf workdir whose latest
  # checkpoint's policy is used (e.g. an SFT run's).
  c.init.policy_checkpoint = ""

  c.data = ml_collections.ConfigDict()
  # A seqio task or mixture name; the built-in ones are registered by
  # jaxrlhf.data.tasks, and any task registered before training works.
  c.data.task = "synthetic_summarize"
  c.data.train_split = "train"
  c.data.eval_split = "validation"
  # Sequence lengths (tokens, EOS included) for the feature converter.
  c.data.inputs_length = 16
  c.data.targets_length = 16
  # Extra modules to import before looking up the task (they register tasks).
  c.data.task_modules = ()
  # Alignment data from files on disk: when data.files.train is set, a seqio
  # task named data.task is registered from these files at start-up.
  c.data.files = ml_collections.ConfigDict()
  # Path or glob of training / held-out files (JSONL or Parquet; local or
  # any tf.io.gfile path such as gs://). Held-out files are the "validation"
  # split: the reward models evaluate on it (data.eval_split); the policy
  # recipes are judged on config.eval.task's prompts instead and do not
  # read it. config.data.task names the task these files become; it must
  # not be an already registered task such as the default.
  c.data.files.train = ""
  c.data.files.validation = ""
  # "columns" (with column_mapping), "ultrafeedback", "hh_rlhf", "tldr".
  c.data.files.layout = "columns"
  # Layout "columns": kind field -> file column, as "prompt=question,
  # completion=answer,reward=score" ("" = the fields' own names).
  c.data.files.column_mapping = ""
  # SentencePiece model of the policy's vocabulary ("" = the built-in
  # synthetic task's vocabulary).
  c.data.files.vocabulary = ""
  # Normalise trajectory rewards to mean 0, variance 1 over the training
  # files (the DRO paper does this for UltraFeedback).
  c.data.files.normalize_rewards = True
  # "raise": a malformed row stops the run naming file and row;
  # "skip_and_report": it is counted, reported, and skipped.
  c.data.files.on_bad_row = "raise"
  # Longest completion (EOS included) a row may have; longer ones are bad
  # rows. Unset = data.targets_length.
  c.data.files.max_completion_tokens = config_dict.placeholder(int)

  c.train = ml_collections.ConfigDict()
  c.train.num_steps = 600
  # Global batch size (examples per optimizer step, over all processes).
  c.train.batch_size = 32
  # Gradient accumulation: the batch is split into this many micro-batches
  # (online algorithms: each online.num_minibatches minibatch is).
  c.train.num_microbatches = 1
  # Weight of the z-loss (log Z)^2 that keeps the softmax normaliser near 0.
  c.train.z_loss = 0.0
  # Console and metrics.jsonl every N steps.
  c.train.log_every = 50

  c.optimizer = ml_collections.ConfigDict()
  # "adafactor" (the DRO paper's) or "adamw" (the PPO paper's).
  c.optimizer.name = "adafactor"
  c.optimizer.learning_rate = 1e-3
  # Linear warm-up steps from 0 to learning_rate.
  c.optimizer.warmup_steps = 0
  # After warm-up: "constant", "cosine" (to 0 at train.num_steps), "linear".
  c.optimizer.schedule = "constant"
  # Adafactor's second-moment decay exponent (DRO paper: 0.8).
  c.optimizer.decay_rate = 0.8
  # Adafactor: scale updates by parameter RMS (T5 practice).
  c.optimizer.multiply_by_parameter_scale = True
  # AdamW's betas, eps (PPO paper: 1e-5) and decoupled weight decay.
  c.optimizer.b1 = 0.9
  c.optimizer.b2 = 0.999
  c.optimizer.eps = 1e-5
  c.optimizer.weight_decay = 0.0
  # Clip gradients to this global norm; 0 disables.
  c.optimizer.grad_clip_norm = 1.0

  c.reward_model = ml_collections.ConfigDict()
  # Use the pairs' "margin" feature in the Bradley-Terry loss (Llama 2).
  # The training loss then includes it; eval/loss is the plain
  # Bradley-Terry loss, so the two are not comparable.
  c.reward_model.use_margin = False
  # Weight of the reward-centring term (r_chosen + r_rejected)^2.
  c.reward_model.centering_coef = 0.0
  # reward_model_ranking: K, the completions per ranking (best first).
  c.reward_model.num_completions = 4
  # Weigh each pair by its "prompt_weight" feature (file sources set it so
  # every prompt counts once however many pairs it has; InstructGPT, RLHF
  # book eq. 6). Data with one pair per prompt, or the same number for every
  # prompt, train exactly as unweighted.
  c.reward_model.weight_prompts_equally = True
  # reward_model_ranking's loss: "plackett_luce" (the K-wise likelihood) or
  # "all_pairs" (Bradley-Terry on all C(K, 2) pairs of a ranking, each
  # weighted 1 / C(K, 2): InstructGPT's scheme).
  c.reward_model.ranking_loss = "plackett_luce"
  # Reward normalisation (PPO details, detail 15; Stiennon et al. 2020): at
  # the end of training, shift the head's bias so the reference completions
  # (the `targets`) of this seqio task's prompts score mean 0; the final
  # checkpoint holds the shifted head, so runs reading this reward model get
  # normalised scores. "" = off. E.g. the SFT task, "synthetic_summarize".
  c.reward_model.normalize_on_task = ""
  # The split of normalize_on_task to score, and how many of its first
  # examples (0 = all of them).
  c.reward_model.normalize_split = "train"
  c.reward_model.normalize_num_examples = 0

  c.dpo = ml_collections.ConfigDict()
  # "dpo" (logistic), "cdpo" (label smoothing), "robust_dpo", "ipo", "slic".
  c.dpo.loss_type = "dpo"
  # beta of f(beta * delta log-ratio); IPO's tau plays this role.
  c.dpo.beta = 0.1
  # cdpo / robust_dpo: assumed label flip rate.
  c.dpo.label_smoothing = 0.0
  # slic: hinge margin delta in max(0, delta - beta * delta log-ratio).
  c.dpo.slic_delta = 1.0
  # Divide sequence log-probs by completion length (length-normalised DPO).
  c.dpo.length_normalize = False
  # Weight of the chosen completions' mean token NLL (DPO+NLL).
  c.dpo.nll_coef = 0.0

  c.kto = ml_collections.ConfigDict()
  c.kto.beta = 0.1
  # lambda_D and lambda_U of the KTO paper.
  c.kto.desirable_weight = 1.0
  c.kto.undesirable_weight = 1.0

  c.dro = ml_collections.ConfigDict()
  # KL regularisation strength tau (DRO paper default 1.0).
  c.dro.tau = 1.0
  # Learning rate of the value network's optimizer (same kind and schedule
  # as config.optimizer, which drives the policy).
  c.dro.value_learning_rate = 1e-4
  # One shared network: the value head reads the policy's own encoder.
  c.dro.shared_network = False
  # One value per batch instead of per prompt (the paper's Figure 5 ablation).
  c.dro.single_value_per_batch = False
  # Start the separate value network's backbone from init.policy_checkpoint.
  c.dro.value_from_policy = True

  # Reference log-probs of dpo and dro_v: "in_step" runs the frozen
  # reference on every batch; "precomputed" scores the training split with
  # the reference once before training (TRL's precompute_ref_log_probs),
  # stores the results in cache_dir, and feeds them to the loss with each
  # batch, so that training neither holds nor runs the reference (evaluation
  # loads it from init.policy_checkpoint while it runs). Not for kto: its KL
  # baseline scores mismatched pairs that depend on the batch.
  c.reference_logprobs = ml_collections.ConfigDict()
  c.reference_logprobs.mode = "in_step"
  # Where the precomputed values live; "" = <workdir>/reference_logprobs. A
  # resumed run reuses them; a cache made with another reference checkpoint,
  # task, split, lengths or model is recomputed by a fresh run and is an
  # error for a resumed one.
  c.reference_logprobs.cache_dir = ""
  # Examples per forward pass of the precomputation; unset = the train
  # step's micro-batch (train.batch_size / train.num_microbatches).
  c.reference_logprobs.batch_size = config_dict.placeholder(int)

  # Online RL (ppo, rloo, grpo, reinforce, rejection_sampling): every train
  # step samples responses to train.batch_size prompts of data.task from the
  # policy, scores them with a frozen reward model and updates the policy;
  # init.policy_checkpoint is the policy's start and the frozen reference.
  # "Table 7" is the PPO hyper-parameter table of "The N+ implementation
  # details of RLHF with PPO".
  c.online = ml_collections.ConfigDict()
  # A jaxrlhf reward_model workdir: its latest params/reward scores rollouts
  # (and initialises PPO's value network, detail 22). Its vocabulary must be
  # the policy's. Required.
  c.online.reward_model_checkpoint = ""
  # Sampling temperature of rollouts (Table 7: 0.7); the log-probs of PPO
  # ratios and of the KL penalty are computed at the same temperature.
  c.online.temperature = 0.7
  # Tokens sampled per response, a fixed number as in detail 23 (then cut
  # after the first EOS); unset = data.targets_length.
  c.online.max_new_tokens = config_dict.placeholder(int)
  # The EOS trick (detail 23): a response with no EOS scores
  # missing_eos_penalty instead of the reward model's output (which is only
  # valid at an EOS, detail 13). False keeps the score at the last token.
  c.online.eos_trick = True
  c.online.missing_eos_penalty = -1.0
  # beta of the KL(pi || reference) penalty folded into the reward (PPO per
  # token; RLOO and REINFORCE per sequence); Table 7: 0.05. GRPO puts its KL
  # in the loss instead, with grpo.kl_coef.
  c.online.kl_coef = 0.05
  # Per-token KL estimator of the penalty: "k1" (log ratio), "k2", "k3"
  # (jaxrlhf/rl/kl.py). It shapes the reward of ppo, rloo and reinforce;
  # GRPO's loss always uses k3, so for grpo and rejection_sampling it only
  # changes the logged rlhf_reward.
  c.online.kl_estimator = "k1"
  # Adaptive KL coefficient (Ziegler et al. 2019): beta moves towards
  # keeping the mean per-response KL at kl_target, by at most 20% of
  # (responses per step / kl_horizon) per step. The coefficient is part of
  # the checkpointed train state. With grpo it adapts grpo.kl_coef (the
  # loss's KL weight); rejection_sampling has no KL term and ignores it.
  c.online.adaptive_kl = False
  c.online.kl_target = 6.0
  c.online.kl_horizon = 10000
  # Responses per prompt (the group size k of RLOO/GRPO, N of rejection
  # sampling); unset = 1 for ppo and reinforce, 4 for rloo and grpo, 8 for
  # rejection_sampling. A step trains on batch_size * k responses.
  c.online.samples_per_prompt = config_dict.placeholder(int)
  # Passes over each rollout batch and minibatches (optimizer updates) per
  # pass; each pass reshuffles the rollouts. Unset epochs = 4 for ppo
  # (Table 7: K = 4, N_mb = 1) and rloo (as TRL's RLOO), 1 for the others.
  c.online.num_epochs = config_dict.placeholder(int)
  c.online.num_minibatches = 1
  # Policy ratio clipping epsilon (Table 7: 0.2); GRPO's lower epsilon.
  c.online.clip_eps = 0.2
  # RLOO and REINFORCE: how per-token losses become one scalar
  # (jaxrlhf/rl/reductions.py); "sequence_sum" treats the response as one
  # action (RLHF book 11.1.3).
  c.online.pg_reduction = "sequence_sum"
  # Prompts longer than data.inputs_length: "cut_paragraph" drops trailing
  # paragraphs (from the last newline) until the prompt fits (detail 2; a
  # prompt with no newline left is an error naming it); "raise" stops at
  # start-up naming the first one.
  c.online.long_prompts = "cut_paragraph"
  # A prompt ending that cutting keeps (e.g. "\n\nTL;DR:"); "" = none.
  c.online.prompt_suffix = ""

  c.ppo = ml_collections.ConfigDict()
  # GAE discount and lambda (Table 7: 1.0 and 0.95).
  c.ppo.gamma = 1.0
  c.ppo.lam = 0.95
  # Value loss clipping and its epsilon (Table 7: on, 0.2).
  c.ppo.value_clipping = True
  c.ppo.value_clip_eps = 0.2
  # Value loss weight c1 (Table 7: 0.1).
  c.ppo.vf_coef = 0.1
  # Whiten the per-token rewards of each batch without shifting their mean
  # (detail 24; optional, off in Table 7) and the advantages (detail 25).
  c.ppo.whiten_rewards = False
  c.ppo.whiten_advantages = True
  # Learning rate of the value network (same optimizer kind and schedule);
  # unset = optimizer.learning_rate, as in Table 7.
  c.ppo.value_learning_rate = config_dict.placeholder(float)
  # Weight of an entropy bonus (0 in the paper; entropy is logged anyway).
  c.ppo.entropy_coef = 0.0

  c.grpo = ml_collections.ConfigDict()
  # beta of the k3 KL(pi || reference) term in the loss (DeepSeekMath: 0.04).
  c.grpo.kl_coef = 0.04
  # Upper clip epsilon (DAPO's clip-higher); unset = online.clip_eps.
  c.grpo.clip_eps_high = config_dict.placeholder(float)
  # "sequence_mean" (GRPO), "token_mean" (DAPO), "constant_length" (Dr.
  # GRPO: divide by batch * online.max_new_tokens), "sequence_sum".
  c.grpo.reduction = "sequence_mean"
  # Divide the group-centred rewards by the group std (GRPO); False is Dr.
  # GRPO's unscaled advantage.
  c.grpo.scale_by_std = True

  c.reinforce = ml_collections.ConfigDict()
  # Baseline subtracted from the KL-penalised sequence reward:
  # "running_mean" (exponential moving average of past batches, part of the
  # checkpointed state), "batch_mean" or "none".
  c.reinforce.baseline = "running_mean"
  c.reinforce.baseline_decay = 0.9

  c.rejection_sampling = ml_collections.ConfigDict()
  # Which samples are fine-tuned on: "top_per_prompt" (the best of each
  # prompt's N) or "top_k_overall" (the best top_k of the whole batch).
  c.rejection_sampling.selection = "top_per_prompt"
  # top_k_overall's K; unset = train.batch_size.
  c.rejection_sampling.top_k = config_dict.placeholder(int)
  # Sample from the frozen "reference" (one round: fine-tune on the best of
  # the SFT model's samples) or from the current "policy" (a new round every
  # step; without a KL term it drifts far, as iterated selection compounds).
  c.rejection_sampling.sample_from = "reference"

  c.pipeline = ml_collections.ConfigDict()
  # Comma-separated stages of jaxrlhf.offline_pipeline ("" = run
  # config.algorithm alone): sft, data, reward_model, dpo, kto, dro_v. The
  # SFT stage trains for train.num_steps with config.optimizer. Online
  # stages, after reward_model and using it: ppo, rloo, grpo, reinforce,
  # rejection_sampling, and best_of_n (an evaluation of the SFT policy).
  c.pipeline.stages = ""
  # Offline data: SFT samples for this many training prompts (and held-out
  # prompts for the reward model's evaluation pairs).
  c.pipeline.num_prompts = 2000
  c.pipeline.num_eval_prompts = 200
  c.pipeline.samples_per_prompt = 4
  c.pipeline.sampling_temperature = 1.0
  # Bradley-Terry annotator: P(a preferred) = sigmoid(beta * (r_a - r_b)).
  c.pipeline.annotator_beta = 10.0
  c.pipeline.reward_model_steps = 300
  c.pipeline.reward_model_learning_rate = 1e-3
  # Steps and learning rate of each offline policy method.
  c.pipeline.policy_steps = 300
  c.pipeline.policy_learning_rate = 1e-3
  c.pipeline.eval_samples_per_prompt = 2
  # Steps and learning rate of each online stage.
  c.pipeline.online_steps = 100
  c.pipeline.online_learning_rate = 1e-3
  # N of the best-of-N row (its KL is log N - (N - 1) / N).
  c.pipeline.best_of_n = 8

  c.checkpoint = ml_collections.ConfigDict()
  # Save every N steps (and always at the end); 0 = only at the end.
  c.checkpoint.every_steps = 200
  # How many recent checkpoints to keep.
  c.checkpoint.keep = 2

  c.eval = ml_collections.ConfigDict()
  # Evaluate every N steps (and before and after training); 0 = only then.
  c.eval.every_steps = 0
  # Held-out examples for loss, token accuracy and greedy-decode gold reward.
  c.eval.num_examples = 128
  c.eval.batch_size = 64
  # Policy recipes: the task whose `eval.split` prompts and gold reward judge
  # the policy against its reference ("" = data.task), how many samples per
  # prompt, and the sampling temperature (eval/kl is then the KL between
  # policy and reference both sampled at that temperature; 0 if they agree).
  c.eval.task = ""
  c.eval.split = "validation"
  c.eval.num_samples = 1
  c.eval.temperature = 1.0

  c.mesh = ml_collections.ConfigDict()
  # Mesh axis sizes, one of them may be -1 for "all remaining devices".
  c.mesh.shape = (-1, 1)
  c.mesh.axis_names = ("data", "model")

  c.sharding = ml_collections.ConfigDict()
  # Logical axis name -> mesh axis (or tuple of axes, or None = replicate).
  c.sharding.logical_axis_rules = sharding.STANDARD_RULES
  return c


def apply_overrides(c: ml_collections.ConfigDict, overrides) -> None:
  """Sets fields by dotted path, {"train.num_steps": 10, ...}, in place."""
  for path, value in overrides.items():
    node = c
    *parents, leaf = path.split(".")
    for name in parents:
      node = node[name]
    node[leaf] = value


def _require(condition, field, message):
  if not condition:
    raise ValueError(f"config.{field}: {message}")


def validate(c: ml_collections.ConfigDict) -> None:
  """Checks values and combinations; the error names the offending field."""
  _require(c.algorithm in ALGORITHMS, "algorithm",
           f"{c.algorithm!r} is not one of {ALGORITHMS}.")
  dpo_losses = ("dpo", "cdpo", "robust_dpo", "ipo", "slic")
  _require(c.dpo.loss_type in dpo_losses, "dpo.loss_type",
           f"{c.dpo.loss_type!r} is not one of {dpo_losses}.")
  _require(c.reward_model.ranking_loss in ("plackett_luce", "all_pairs"),
           "reward_model.ranking_loss", f"{c.reward_model.ranking_loss!r}: "
           "use 'plackett_luce' or 'all_pairs'.")
  _require(c.reward_model.normalize_num_examples >= 0,
           "reward_model.normalize_num_examples", "must be >= 0 (0 = the "
           "whole split).")
  _require(c.dro.tau > 0, "dro.tau", "must be positive.")
  _require(c.reference_logprobs.mode in ("in_step", "precomputed"),
           "reference_logprobs.mode", f"{c.reference_logprobs.mode!r}: use "
           "'in_step' or 'precomputed'.")
  _require(c.reference_logprobs.mode == "in_step"
           or c.algorithm in ("dpo", "dro_v"), "reference_logprobs.mode",
           f"'precomputed' applies to dpo and dro_v, not {c.algorithm!r} "
           "(kto's KL baseline pairs each prompt with another example's "
           "completion, so its reference log-probs depend on the batch; "
           "online algorithms score fresh samples); use 'in_step'.")
  _require(c.reference_logprobs.batch_size is None
           or c.reference_logprobs.batch_size > 0,
           "reference_logprobs.batch_size", "must be positive.")
  _require(c.eval.num_samples > 0, "eval.num_samples", "must be positive.")
  _require(c.model.arch in ("t5", "llama", "gpt_neox", "t5x_decoder_only"),
           "model.arch", f"{c.model.arch!r} is not supported; use 't5', "
           "'llama', 'gpt_neox' or 't5x_decoder_only'.")
  _require(c.model.mlp in ("gated-gelu", "relu"), "model.mlp",
           f"{c.model.mlp!r}: use 'gated-gelu' or 'relu'.")
  _require(c.model.dtype in ("float32", "bfloat16"), "model.dtype",
           f"{c.model.dtype!r}: use 'float32' or 'bfloat16'.")
  _require(c.optimizer.name in OPTIMIZERS, "optimizer.name",
           f"{c.optimizer.name!r} is not one of {OPTIMIZERS}.")
  _require(c.optimizer.schedule in SCHEDULES, "optimizer.schedule",
           f"{c.optimizer.schedule!r} is not one of {SCHEDULES}.")
  _require(c.optimizer.learning_rate > 0, "optimizer.learning_rate",
           "must be positive.")
  _require(c.train.num_steps > 0, "train.num_steps", "must be positive.")
  _require(c.train.batch_size > 0, "train.batch_size", "must be positive.")
  _require(c.train.num_microbatches > 0, "train.num_microbatches",
           "must be positive.")
  _require(c.train.batch_size % c.train.num_microbatches == 0,
           "train.num_microbatches",
           f"{c.train.num_microbatches} does not divide train.batch_size "
           f"{c.train.batch_size}.")
  _require(c.train.log_every > 0, "train.log_every", "must be positive.")
  _require(c.checkpoint.keep > 0, "checkpoint.keep", "must be positive.")
  _require(c.data.inputs_length > 0 and c.data.targets_length > 0,
           "data.inputs_length", "sequence lengths must be positive.")
  _require(c.data.files.max_completion_tokens is None
           or 0 < c.data.files.max_completion_tokens <= c.data.targets_length,
           "data.files.max_completion_tokens",
           f"{c.data.files.max_completion_tokens} must be between 1 and "
           f"data.targets_length ({c.data.targets_length}).")
  _require(c.data.files.on_bad_row in ("raise", "skip_and_report"),
           "data.files.on_bad_row", f"{c.data.files.on_bad_row!r}: use "
           "'raise' or 'skip_and_report'.")
  _validate_online(c)
  sharding.as_rules(c.sharding.logical_axis_rules)


def _validate_online(c: ml_collections.ConfigDict) -> None:
  o = c.online
  _require(o.temperature > 0, "online.temperature", "must be positive.")
  _require(o.max_new_tokens is None or o.max_new_tokens > 0,
           "online.max_new_tokens", "must be positive.")
  _require(o.kl_estimator in ("k1", "k2", "k3"), "online.kl_estimator",
           f"{o.kl_estimator!r}: use 'k1', 'k2' or 'k3'.")
  _require(o.kl_coef >= 0, "online.kl_coef", "must be >= 0.")
  _require(o.kl_target > 0 and o.kl_horizon > 0, "online.kl_target",
           "kl_target and kl_horizon must be positive.")
  _require(o.samples_per_prompt is None or o.samples_per_prompt > 0,
           "online.samples_per_prompt", "must be positive.")
  _require(o.num_epochs is None or o.num_epochs > 0, "online.num_epochs",
           "must be positive.")
  _require(o.num_minibatches > 0, "online.num_minibatches",
           "must be positive.")
  _require(o.clip_eps > 0, "online.clip_eps", "must be positive.")
  _require(o.pg_reduction in ("sequence_mean", "token_mean",
                              "constant_length", "sequence_sum"),
           "online.pg_reduction", f"{o.pg_reduction!r} is not a reduction.")
  _require(o.long_prompts in ("cut_paragraph", "raise"), "online.long_prompts",
           f"{o.long_prompts!r}: use 'cut_paragraph' or 'raise'.")
  _require(0 <= c.ppo.gamma <= 1 and 0 <= c.ppo.lam <= 1, "ppo.gamma",
           "gamma and lam must be in [0, 1].")
  _require(c.ppo.value_clip_eps > 0, "ppo.value_clip_eps", "must be positive.")
  _require(c.grpo.reduction in ("sequence_mean", "token_mean",
                                "constant_length", "sequence_sum"),
           "grpo.reduction", f"{c.grpo.reduction!r} is not a reduction.")
  _require(c.grpo.clip_eps_high is None or c.grpo.clip_eps_high > 0,
           "grpo.clip_eps_high", "must be positive.")
  _require(c.reinforce.baseline in ("running_mean", "batch_mean", "none"),
           "reinforce.baseline", f"{c.reinforce.baseline!r}: use "
           "'running_mean', 'batch_mean' or 'none'.")
  _require(c.rejection_sampling.selection in ("top_per_prompt",
                                              "top_k_overall"),
           "rejection_sampling.selection",
           f"{c.rejection_sampling.selection!r}: use 'top_per_prompt' or "
           "'top_k_overall'.")
  _require(c.rejection_sampling.sample_from in ("policy", "reference"),
           "rejection_sampling.sample_from",
           f"{c.rejection_sampling.sample_from!r}: use 'policy' or "
           "'reference'.")
  if c.algorithm not in ONLINE_ALGORITHMS:
    return
  _require(c.model.dropout_rate == 0, "model.dropout_rate",
           f"{c.model.dropout_rate}: online RL needs deterministic log-probs "
           "(PPO details, detail 7: with dropout the ratios are not 1 before "
           "the first update); set it to 0.")
  # train.num_microbatches > 1 splits each online minibatch update into
  # micro-batches (gradient accumulation); the recipe checks that they
  # divide the minibatch (jaxrlhf/recipes/online.py).
  if c.algorithm in ("rloo", "grpo"):
    _require(c.online.samples_per_prompt is None
             or c.online.samples_per_prompt >= 2, "online.samples_per_prompt",
             f"{c.algorithm} compares the responses to one prompt; it needs "
             "at least 2.")


# Fields that name files or checkpoints a run reads (globs for data files);
# each set one must exist when a run starts (`check_paths`).
PATH_FIELDS = ("init.policy_checkpoint", "online.reward_model_checkpoint",
               "data.files.train", "data.files.validation",
               "data.files.vocabulary")
# What the paper configs put where a user's own path goes.
PLACEHOLDER = "YOUR_BUCKET"


def _field(c, path):
  node = c
  for name in path.split("."):
    node = node[name]
  return node


def check_paths(c: ml_collections.ConfigDict) -> None:
  """Every set path field matches something readable; the error names the
  field (a placeholder, a missing file, or a remote path that cannot be
  reached, e.g. gs:// without network or credentials)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  for field in PATH_FIELDS:
    pattern = _field(c, field)
    if not pattern:
      continue
    if PLACEHOLDER in pattern:
      raise ValueError(
          f"config.{field}: {pattern!r} is a placeholder of the config file; "
          f"point it at your copy, e.g. --config.{field}=/path/to/yours.")
    try:
      found = tf.io.gfile.glob(pattern)
    except Exception as e:  # pylint: disable=broad-except
      reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
      raise ValueError(
          f"config.{field}: cannot read {pattern!r} "
          f"({type(e).__name__}: {reason}). Check the path, and for a remote "
          "path the network and credentials.") from None
    if not found:
      raise ValueError(f"config.{field}: nothing matches {pattern!r}.")


def load_config_file(path, arg: Optional[str] = None
                     ) -> ml_collections.ConfigDict:
  """`get_config(arg)` of a config file such as configs/quickstart.py, as
  `--config=path[:arg]` would give it, for scripts and notebooks."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  path = os.fspath(path)
  spec = importlib.util.spec_from_file_location(
      os.path.splitext(os.path.basename(path))[0], path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config() if arg is None else module.get_config(arg)
