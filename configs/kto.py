"""The DRO paper's KTO baseline (section 4, "KTO baseline"; Figure 4): KTO on
UltraFeedback single trajectories.

A completion is desirable when its rating is above the batch mean, the KL
baseline is KTO's batch estimate, and the loss is not weighted (lambda_D =
lambda_U = 1). tau (KTO's beta) is 5.0, the best of the paper's search over
{0.1, 1, 5} on T5-L, held constant through training and re-used for T5-XL.
The training budget is the paper's: T5-L 40,000 steps on a v5e 4x4 slice
(the default), `--config=configs/kto.py:xl` T5-XL 20,000 steps on a 4x8
slice. The other settings are the DRO-V runs' (presets.ultrafeedback_offline).
"""

from jaxrlhf import presets
from jaxrlhf import sharding_rules

# T5 size -> (mesh, train steps), section 4 "Compute and hyperparameters".
PAPER_RUNS = {"large": ((4, 4), 40_000), "xl": ((4, 8), 20_000)}


def get_config(size: str = "large"):
  if size not in PAPER_RUNS:
    raise ValueError(f"configs/kto.py:{size}: the paper ran KTO on "
                     f"{sorted(PAPER_RUNS)}; pick one.")
  mesh_shape, num_steps = PAPER_RUNS[size]
  c = presets.ultrafeedback_offline("kto", size, mesh_shape=mesh_shape,
                                    num_steps=num_steps)
  c.kto.beta = 5.0
  c.kto.desirable_weight = 1.0
  c.kto.undesirable_weight = 1.0
  # KTO's KL baseline and desirability are statistics of the whole batch:
  # no micro-batches. Split over the data axis too, T5-L's parameters leave
  # room on a 4x4 slice to keep every matmul's output; T5-XL's layers are
  # recomputed in the backward pass instead (about a fifth more FLOPs).
  # experiments/results/plans/ has both plans and the options compared.
  c.train.num_microbatches = 1
  c.sharding.logical_axis_rules = sharding_rules.FULLY_SHARDED_RULES
  c.model.remat_policy = "dots_saveable" if size == "large" else "full"
  return c
