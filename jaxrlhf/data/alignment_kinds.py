"""The data kinds of offline alignment and their feature names.

Every offline alignment method reads one of four kinds of example. Each kind
is a prompt, one or more completions, and scalar labels:

| kind       | text features                | scalar features (float32)    |
| ---------- | ---------------------------- | ---------------------------- |
| pairs      | prompt, chosen, rejected     | margin (0), confidence (1),  |
|            |                              | prompt_weight (1),           |
|            |                              | annotation_batch (-1)        |
| ranking    | prompt, completions (K, best | -                            |
|            | first)                       |                              |
| trajectory | prompt, completion           | reward (required)            |
| thumbs     | prompt, completion           | label (required: 1 up/0 down)|

The numbers in brackets are the defaults a source fills in when a file has no
such column. `margin` is how much better the chosen completion is rated
(e.g. an UltraFeedback score difference), `confidence` the rater's confidence
scaled so that 1 means certain; losses may use them or not.
`annotation_batch` numbers the batch of annotation a comparison came from
(TL;DR's "batch6" is 6; -1 = unknown): reward-model evaluation reports
accuracy per batch, as the PPO implementation-details paper does (detail 16).
`prompt_weight` is the pair's share in a loss that counts every prompt once
however many pairs it has (InstructGPT; RLHF book eq. 6): the file sources
set it to (#pairs / #prompts) / (#pairs of this prompt) over the split, so
that it averages 1 (`file_sources.equal_prompt_weights`).

A scalar with a default is optional in a task's examples: the feature
converters fill the default when a source does not give it.

Files of demonstrations (a prompt and its reference completion: the TL;DR
SFT data, and the prompts online RL samples from) are read through the same
file sources as kind `demonstrations` and become seqio `inputs`/`targets`
tasks (`jaxrlhf.data.file_tasks`); no alignment loss reads that kind, so it
is not in `KINDS`.

In a seqio task of a kind, text features are tokenized with the task's
vocabulary; every completion ends with EOS. `ranking` stores its completions
as one rank-2 feature `completions` of shape [num_completions, length]
(ragged), whose row count may differ between examples: the feature
converters pad it to K rows and mark real rows in `completions_mask`.
"""

import dataclasses
from typing import Dict, Mapping, Optional, Tuple

PROMPT = "prompt"


@dataclasses.dataclass(frozen=True)
class DataKind:
  """What one example of a kind holds.

  Attributes:
    name: the kind's name, as given to task builders and converters.
    completion_fields: text features holding completions (EOS appended).
    scalar_defaults: scalar float32 features and the value used when a file
      has none; None means the scalar is required.
    ranked: the single completion field holds a list of completions, best
      first, instead of one completion.
  """
  name: str
  completion_fields: Tuple[str, ...]
  scalar_defaults: Mapping[str, Optional[float]]
  ranked: bool = False

  @property
  def text_fields(self) -> Tuple[str, ...]:
    return (PROMPT,) + self.completion_fields

  @property
  def scalar_fields(self) -> Tuple[str, ...]:
    return tuple(self.scalar_defaults)

  @property
  def fields(self) -> Tuple[str, ...]:
    return self.text_fields + self.scalar_fields


PAIRS = DataKind("pairs", ("chosen", "rejected"),
                 {"margin": 0.0, "confidence": 1.0, "prompt_weight": 1.0,
                  "annotation_batch": -1.0})
RANKING = DataKind("ranking", ("completions",), {}, ranked=True)
TRAJECTORY = DataKind("trajectory", ("completion",), {"reward": None})
THUMBS = DataKind("thumbs", ("completion",), {"label": None})

KINDS: Dict[str, DataKind] = {k.name: k for k in (PAIRS, RANKING, TRAJECTORY,
                                                   THUMBS)}
DEMONSTRATIONS = DataKind("demonstrations", ("completion",), {})


def get_kind(kind) -> DataKind:
  """A DataKind from itself or its name, or an error that lists the kinds."""
  if isinstance(kind, DataKind):
    return kind
  if kind not in KINDS:
    raise ValueError(f"unknown data kind {kind!r}; the kinds are "
                     f"{sorted(KINDS)}.")
  return KINDS[kind]
