"""The built-in synthetic summarisation task and its gold reward.

A prompt is a list of words ("summarize: fox red fox owl red"); its ideal
summary lists each distinct word once, in order of first appearance
("fox red owl"), then ends. The gold reward r*(prompt, completion) grades a
whole completion the way a summary is judged: accurate (no words the prompt
does not contain), complete (every distinct word), concise (no repeats) and
properly ended. Because it is a program, every alignment method's effect can
be measured exactly, as the DRO paper measures with an LLM judge.

The SFT demonstrations are deliberately imperfect, like human-written
summaries: some stop early, some repeat themselves, some mention a word the
prompt never had. A model that imitates them inherits their mistakes, which
leaves headroom for preference and reward optimisation above SFT.

In the graded variant (`make_examples(..., graded=True)`) prompts differ in
difficulty, and the prompt shows how hard it is: each prompt draws its words
from one of `GRADED_LEVELS`' word pools, and the demonstrator's mistake
rates are those of the level. SFT samples of an easy prompt then score high
and those of a hard prompt low, so much of the reward's variance lies
between prompts, which a value per prompt (DRO-V's V(x)) can learn and one
value per batch cannot.
"""

import dataclasses
import hashlib
from typing import List, Sequence

import numpy as np

PROMPT_PREFIX = "summarize:"
WORDS = ("red blue green gold cat dog fox owl sun moon star rain oak elm fig "
         "lime salt iron silk wool").split()
# The words of the task's vocabulary (`tasks.synthetic_vocabulary`).
VOCABULARY_WORDS = (PROMPT_PREFIX, *WORDS)


@dataclasses.dataclass(frozen=True)
class DemonstrationNoise:
  """How often the SFT demonstrator makes each kind of mistake."""
  # Drops the last distinct word (incomplete summary).
  p_incomplete: float = 0.35
  # Repeats 1-3 words it already said before ending (rambling).
  p_ramble: float = 0.25
  # Inserts one word the prompt does not contain (inaccurate).
  p_hallucinate: float = 0.15


@dataclasses.dataclass(frozen=True)
class Level:
  """One difficulty level of the graded task: its word pool and noise."""
  words: Sequence[str]
  noise: DemonstrationNoise


# Easy, medium and hard prompts, in equal shares; each level's words are its
# own, so the prompt tells its level.
GRADED_LEVELS = (
    Level(WORDS[0:7], DemonstrationNoise(p_incomplete=0.05, p_ramble=0.03,
                                         p_hallucinate=0.02)),
    Level(WORDS[7:14], DemonstrationNoise()),
    Level(WORDS[14:20], DemonstrationNoise(p_incomplete=0.9, p_ramble=0.8,
                                           p_hallucinate=0.6)),
)


def ideal_summary(prompt_words: Sequence[str]) -> List[str]:
  """Distinct words of the prompt in order of first appearance."""
  return list(dict.fromkeys(prompt_words))


def prompt_words(prompt: str) -> List[str]:
  words = prompt.split()
  if words and words[0] == PROMPT_PREFIX:
    words = words[1:]
  return words


def gold_reward(prompt: str, completion: str, finished: bool = True) -> float:
  """r*(prompt, completion) in [0, 1]; 0 for a completion that never ended.

  The score is the F1 of the completion against the ideal summary where each
  distinct prompt word counts once: recall is the fraction of distinct prompt
  words the completion mentions; precision is the fraction of the
  completion's words that are a first mention of a prompt word, so repeats and
  foreign words both cost precision. Order does not matter.

  Args:
    prompt: the prompt text, with or without the "summarize:" prefix.
    completion: the completion text up to (not including) its EOS.
    finished: False when the completion hit the length limit without EOS; it
      then scores 0, like a summary that rambles on without ending.
  """
  if not finished:
    return 0.0
  target = set(prompt_words(prompt))
  said = completion.split()
  if not target or not said:
    return 0.0
  covered = set()
  first_mentions = 0
  for w in said:
    if w in target and w not in covered:
      covered.add(w)
      first_mentions += 1
  recall = len(covered) / len(target)
  precision = first_mentions / len(said)
  if recall == 0.0:
    return 0.0
  return 2 * precision * recall / (precision + recall)


def _rng_for(split: str, seed: int) -> np.random.Generator:
  digest = hashlib.sha256(f"{split}/{seed}".encode()).digest()
  return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def make_examples(split: str, num_examples: int, seed: int = 0,
                  min_words: int = 4, max_words: int = 9,
                  noise: DemonstrationNoise = DemonstrationNoise(),
                  graded: bool = False):
  """Deterministic examples {"inputs", "targets", "ideal"} for one split.

  Each split draws from its own random stream, so held-out prompts do not
  depend on how many training examples were made. `graded`: the graded
  variant (module docstring; `noise` is then the levels'), whose examples
  also carry their "level" (0 easy, 1 medium, 2 hard).
  """
  rng = _rng_for(f"graded/{split}" if graded else split, seed)
  examples = []
  for _ in range(num_examples):
    vocabulary = WORDS
    if graded:
      level = int(rng.integers(len(GRADED_LEVELS)))
      vocabulary, noise = (GRADED_LEVELS[level].words,
                           GRADED_LEVELS[level].noise)
    n = int(rng.integers(min_words, max_words + 1))
    # Few distinct words per prompt, so repeats are common.
    pool = rng.choice(len(vocabulary),
                      size=int(rng.integers(2, min(n, 6) + 1)), replace=False)
    words = [vocabulary[i] for i in rng.choice(pool, size=n)]
    ideal = ideal_summary(words)
    demo = list(ideal)
    if len(demo) > 1 and rng.random() < noise.p_incomplete:
      demo = demo[:-1]
    if rng.random() < noise.p_ramble:
      demo += [str(w) for w in rng.choice(demo, size=int(rng.integers(1, 4)))]
    if rng.random() < noise.p_hallucinate:
      foreign = [w for w in WORDS if w not in ideal]
      demo.insert(int(rng.integers(0, len(demo) + 1)),
                  foreign[int(rng.integers(len(foreign)))])
    example = {
        "inputs": " ".join([PROMPT_PREFIX] + words),
        "targets": " ".join(demo),
        "ideal": " ".join(ideal),
    }
    if graded:
      example["level"] = level
    examples.append(example)
  return examples
