"""A Bradley-Terry reward model on UltraFeedback pairs, initialised from a
T5X SFT checkpoint (T5 1.1 Large, v5e 4x4)."""

from jaxrlhf import presets


def get_config():
  c = presets.ultrafeedback_offline("reward_model", "large", mesh_shape=(4, 4),
                                    num_steps=10_000)
  c.optimizer.learning_rate = 1e-5
  return c
