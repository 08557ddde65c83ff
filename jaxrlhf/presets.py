"""Shared settings of the paper-reproduction configs under configs/."""

from jaxrlhf import defaults

# T5's public SentencePiece model (what T5 1.1 checkpoints were trained with).
T5_VOCABULARY = "gs://t5-data/vocabs/cc_all.32000/sentencepiece.model"


def ultrafeedback_offline(algorithm: str, size: str, mesh_shape, num_steps: int):
  """An offline run on UltraFeedback from a T5X SFT checkpoint, with the DRO
  paper's settings (section 4): Adafactor with decay rate 0.8, 150 linear
  warm-up steps, learning rate 1e-4, batch 32, tau = 1, checkpoints every
  2,000 steps, rewards (ratings) normalised to mean 0 and variance 1.

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
  return c
