"""KTO on UltraFeedback single trajectories, the DRO paper's baseline setup:
a completion is desirable when its rating is above the batch mean."""

from jaxrlhf import presets


def get_config():
  c = presets.ultrafeedback_offline("kto", "large", mesh_shape=(4, 4),
                                    num_steps=20_000)
  c.kto.beta = 0.1
  return c
