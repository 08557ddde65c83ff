"""The policy an episode loop samples turns from, over `turn_sampler`.

`TurnPolicy` holds B conversations on the device (`turn_sampler.Context`)
and every conversation's ids on the host. Between turns the environment's
tokens extend the KV cache (`extend_cache=True`, the default): the earlier
turns are never recomputed. When the cache has no room left for what comes
next (the columns of rows that ended early stay empty until then), or with
`extend_cache=False`, the conversations are prefilled afresh from their
ids: exact either way (`tests/test_agent_episodes.py` compares the two),
and what `experiments/bench_agents.py` measures. With `record_routes` (a
mixture-of-experts policy, router replay) it keeps the experts of every
id each conversation has fed (`routes`), those of its latest prefill where
it was prefilled afresh.
"""

from typing import List, Sequence, Tuple

import jax
import numpy as np

from jaxrlhf.agents import turn_sampler
from jaxrlhf.models import sampling


class TurnPolicy:
  """Samples turns of B conversations (`episodes.run_episodes`' policy).

  Args:
    model, params: a decoder-only module and its parameters (the policy's
      view: LoRA adapters merged by the caller).
    end_id: the end-of-turn id.
    temperature: the sampling temperature (0: greedy).
    width: the KV cache's columns: at least the longest conversation's
      ids plus a turn's tokens.
    turn_tokens: a turn's most tokens (room a prefill leaves after it).
    extend_cache: extend the cache with the environment's tokens (else
      prefill every turn afresh).
    pad_id: the padding id.
    record_routes: keep each fed id's experts (`routes`; a
      mixture-of-experts model's only).
  """

  def __init__(self, model, params, *, end_id: int, temperature: float,
               width: int, turn_tokens: int, extend_cache: bool = True,
               pad_id: int = 0, record_routes: bool = False):
    self.model, self.params = model, params
    self.end_id, self.temperature = int(end_id), float(temperature)
    self.turn_tokens = int(turn_tokens)
    self.width, self.extend_cache, self.pad_id = (int(width),
                                                  bool(extend_cache),
                                                  int(pad_id))
    self.sequences: List[List[int]] = []
    self.record_routes = sampling.records_routes(model, record_routes)
    # Per conversation, the experts of its ids fed so far: arrays [n,
    # moe layers, top_k], in order.
    self._routes: List[List[np.ndarray]] = []
    self.context = None
    self.decode_steps = 0
    self.prefills = 0
    self._stale = False

  def start(self, openings: Sequence[Sequence[int]]) -> None:
    self.sequences = [list(map(int, o)) for o in openings]
    self._prefill()

  def _prefill(self) -> None:
    """All conversations prefilled afresh from their ids."""
    longest = max(len(s) for s in self.sequences)
    length = max(longest, min(turn_sampler.bucket(longest, 16),
                              self.width - self.turn_tokens))
    if longest + self.turn_tokens > self.width:
      raise ValueError(f"TurnPolicy: a conversation of {longest} ids and a "
                       f"turn of {self.turn_tokens} do not fit the KV "
                       f"cache's {self.width} columns.")
    tokens = np.full((len(self.sequences), length), self.pad_id, np.int32)
    mask = np.zeros_like(tokens)
    for b, s in enumerate(self.sequences):
      tokens[b, length - len(s):] = s
      mask[b, length - len(s):] = 1
    self.context = turn_sampler.start(self.model, self.params, tokens, mask,
                                      self.width, self.record_routes)
    if self.record_routes:
      routes = jax.device_get(self.context.routes)
      self._routes = [[routes[b, length - len(s):]]
                      for b, s in enumerate(self.sequences)]
      self.context = self.context.replace(routes=None)
    self.prefills += 1
    self._stale = False

  def decode(self, active: np.ndarray, max_tokens: int, key
             ) -> List[Tuple[List[int], List[float], bool]]:
    """A turn of every active row: per row (its ids, the sampler's
    log-probs of them, whether it drew the end-of-turn id); ([], [],
    False) for the others."""
    if self._stale or turn_sampler.room(self.context) < max_tokens:
      self._prefill()
    before = int(self.context.column)
    turn, self.context = turn_sampler.decode(
        self.model, self.params, self.context, key, int(max_tokens),
        np.asarray(active, bool), self.end_id,
        temperature=self.temperature if self.temperature > 0 else 1.0,
        greedy=self.temperature <= 0, record_routes=self.record_routes)
    tokens, logprobs, lengths, ended, routes = jax.device_get(
        (turn.tokens, turn.logprobs, turn.lengths, turn.ended, turn.routes))
    self.decode_steps += int(self.context.column) - before
    out = []
    for b, on in enumerate(active):
      if not on:
        out.append(([], [], False))
        continue
      n = int(lengths[b])
      ids = [int(t) for t in tokens[b, :n]]
      self.sequences[b] += ids
      if self.record_routes:
        self._routes[b].append(routes[b, :n])
      out.append((ids, [float(x) for x in logprobs[b, :n]], bool(ended[b])))
    return out

  def extend(self, blocks: Sequence[Sequence[int]]) -> None:
    """Appends each row's block of the environment's ids (empty: none)."""
    for b, block in enumerate(blocks):
      self.sequences[b] += list(map(int, block))
    longest = max(len(b) for b in blocks)
    if not longest:
      return
    size = turn_sampler.bucket(longest, 8)
    if (not self.extend_cache or self._stale
        or turn_sampler.room(self.context) < size):
      self._stale = True  # prefilled afresh before the next turn
      return
    tokens = np.full((len(blocks), size), self.pad_id, np.int32)
    mask = np.zeros_like(tokens)
    for b, block in enumerate(blocks):
      if block:  # right-aligned: the block's last column is its last id
        tokens[b, size - len(block):] = block
        mask[b, size - len(block):] = 1
    self.context = turn_sampler.extend(self.model, self.params, self.context,
                                       tokens, mask, self.record_routes)
    if self.record_routes:
      routes = jax.device_get(self.context.routes)
      for b, block in enumerate(blocks):
        if block:
          self._routes[b].append(routes[b, size - len(block):])
      self.context = self.context.replace(routes=None)

  def routes(self, b: int, length: int) -> np.ndarray:
    """int32 [length, moe layers, top_k]: the experts of conversation b's
    first `length` ids (`record_routes`), every one of which was fed."""
    if self._stale:  # its latest block not fed yet
      self._prefill()
    routes = np.concatenate(self._routes[b])
    if len(routes) < length:
      raise ValueError(f"TurnPolicy.routes: conversation {b} fed "
                       f"{len(routes)} ids, fewer than {length}.")
    return routes[:length]
