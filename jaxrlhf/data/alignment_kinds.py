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
is not in `KINDS`. Demonstrations may also carry extra columns, a prompt's
other fields (a reference answer to check, unit tests to run), through to
the reward functions of online RL (`jaxrlhf.rewards`): each is a string
feature named `column_feature(name)`, "column:<name>", holding the value
JSON-encoded so that numbers and lists survive (`encode_column_value`);
`jaxrlhf.data.prompts.load_prompts` decodes them per prompt.

In a seqio task of a kind, text features are tokenized with the task's
vocabulary; every completion ends with EOS. `ranking` stores its completions
as one rank-2 feature `completions` of shape [num_completions, length]
(ragged), whose row count may differ between examples: the feature
converters pad it to K rows and mark real rows in `completions_mask`.
"""

import dataclasses
import json
from typing import Any, Dict, Mapping, Optional, Tuple, Union

PROMPT = "prompt"
# Extra columns travel as string features with this prefix.
COLUMN_FEATURE_PREFIX = "column:"
# Reward functions receive the prompts and completions under these names
# (positionally, `jaxrlhf.rewards.host`), so no extra column may have them.
RESERVED_COLUMN_NAMES = ("prompts", "completions")
# The extra column of layout "messages" rows: the conversation a prompt
# renders (its messages before the reply), so that an episode opens with
# the row's own messages (`agents.environments.ToolLoop`) rather than with
# their rendered text as one user message. Reward functions get it too.
CONVERSATION_COLUMN = "messages"


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
# Online RL's prompts: rows of the demonstration layouts whose completion, if
# they have one, is not read (a GRPO file holds a prompt and an answer).
PROMPTS = DataKind("prompts", (), {})
# The kinds whose examples carry extra columns (for online rewards).
WITH_EXTRA_COLUMNS = (DEMONSTRATIONS.name, PROMPTS.name)


def get_kind(kind) -> DataKind:
  """A DataKind from itself or its name (an alignment kind, demonstrations
  or prompts), or an error that lists the kinds."""
  if isinstance(kind, DataKind):
    return kind
  every = dict(KINDS, **{k.name: k for k in (DEMONSTRATIONS, PROMPTS)})
  if kind not in every:
    raise ValueError(f"unknown data kind {kind!r}; the kinds are "
                     f"{sorted(every)}.")
  return every[kind]


# --- extra columns -------------------------------------------------------------


def column_feature(name: str) -> str:
  """The seqio feature that carries extra column `name`."""
  return COLUMN_FEATURE_PREFIX + name


def column_of_feature(feature: str) -> Optional[str]:
  """The extra column a feature carries, or None for any other feature."""
  if feature.startswith(COLUMN_FEATURE_PREFIX):
    return feature[len(COLUMN_FEATURE_PREFIX):]
  return None


def check_column_name(name: str, where: str,
                      taken: Tuple[str, ...] = ()) -> None:
  """An extra column's name becomes a keyword argument of reward functions:
  it must be a Python identifier, and not one of `taken` or the reserved
  names."""
  if not (isinstance(name, str) and name.isidentifier()):
    raise ValueError(f"{where}: extra column name {name!r} must be a Python "
                     "identifier (reward functions take it as a keyword "
                     "argument).")
  if name in RESERVED_COLUMN_NAMES or name in taken:
    raise ValueError(f"{where}: {name!r} cannot name an extra column: "
                     f"{sorted(set(RESERVED_COLUMN_NAMES + taken))} are "
                     "taken.")


def encode_column_value(value: Any) -> str:
  """JSON text of an extra column's value (TypeError if it has none)."""
  return json.dumps(value, ensure_ascii=False)


def decode_column_value(text: Union[bytes, str]) -> Any:
  if isinstance(text, bytes):
    text = text.decode("utf-8")
  return json.loads(text)
