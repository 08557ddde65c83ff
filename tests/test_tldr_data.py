"""The TL;DR data as the N+ implementation details paper prepares it: SFT
rows become "...\\n\\nTL;DR:" queries (detail 2: no trailing space; the
post's last paragraphs dropped to fit) and summaries with a leading space
and the EOS (detail 3); online RL never cuts the "TL;DR:" suffix; the
comparisons carry their annotation batch (detail 16).

Expected queries and ids are written out by hand, or taken from the
`tokenizers` library for the Pythia-style tokenizer fixture.
"""

import json

import pytest
import seqio
import tensorflow as tf
import tokenizers

from conftest import FIXTURES, REPO, tiny_config
from jaxrlhf import defaults
from jaxrlhf.data import alignment_kinds
from jaxrlhf.data import feature_converters as fc
from jaxrlhf.data import file_sources
from jaxrlhf.data import file_tasks
from jaxrlhf.data import names
from jaxrlhf.data import prompts as prompts_lib
from jaxrlhf.data.hf_tokenizer import HFTokenizerVocabulary

NEOX = FIXTURES / "tokenizers" / "neox_style" / "tokenizer.json"


@pytest.fixture(scope="module")
def vocab():
  return HFTokenizerVocabulary(NEOX)


def query(post, subreddit="cats", title="the cat"):
  return (f"SUBREDDIT: r/{subreddit}\n\nTITLE: {title}\n\nPOST: {post}"
          "\n\nTL;DR:")


def write_jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def sft_row(post, summary, **extra):
  return {"id": "t3_x", "subreddit": "cats", "title": "the cat",
          "post": post, "summary": summary, **extra}


def test_sft_rows_become_queries_and_summaries(tmp_path, vocab):
  kept = "the cat sat on the mat\nthe dog sat"
  full = kept + "\non the log and the mat and the cat"
  limit = len(vocab.encode(query(kept))) + 1  # + the EOS the task appends
  assert len(vocab.encode(query(full))) + 1 > limit
  rows = [sft_row(full, "a cat sat"),
          sft_row("one line", " a leading space"),
          {"info": {"subreddit": "dogs", "title": "t", "post": "p"},
           "summary": "nested"},
          sft_row("the cat " * 40, "no paragraph to drop"),
          sft_row("p", None), sft_row("p", "  ")]
  source = file_sources.AlignmentFileSource(
      write_jsonl(tmp_path / "sft.jsonl", rows),
      kind=alignment_kinds.DEMONSTRATIONS, layout="tldr_sft",
      vocabulary=vocab, max_prompt_tokens=limit,
      on_bad_row="skip_and_report")
  assert source.examples() == [
      {"prompt": query(kept), "completion": " a cat sat"},
      {"prompt": query("one line"), "completion": " a leading space"},
      {"prompt": "SUBREDDIT: r/dogs\n\nTITLE: t\n\nPOST: p\n\nTL;DR:",
       "completion": " nested"}]
  assert source.bad_row_counts() == {"prompt_too_long": 1,
                                     "missing_field": 1,
                                     "empty_completion": 1}


def test_sft_files_become_an_inputs_targets_task_with_eos_on_targets(
    tmp_path, vocab):
  config = tiny_config(algorithm="sft", data__task="tldr_sft_files",
                       data__inputs_length=64, data__targets_length=8)
  config.data.files.train = write_jsonl(
      tmp_path / "sft.jsonl", [sft_row("the cat sat", "on the mat")])
  config.data.files.layout = "tldr_sft"
  config.data.files.vocabulary = str(NEOX)
  file_tasks.register_task_from_files(config, file_tasks.DEMONSTRATIONS)
  task = seqio.get_mixture_or_task("tldr_sft_files")
  [ex] = list(task.get_dataset({"inputs": 64, "targets": 8}, split="train",
                               shuffle=False).as_numpy_iterator())
  library = tokenizers.Tokenizer.from_file(str(NEOX))
  eos = vocab.eos_id
  assert eos == 1 and library.id_to_token(0) == "<|endoftext|>"
  assert ex["inputs"].tolist() == library.encode(
      query("the cat sat")).ids + [eos]
  assert ex["targets"].tolist() == library.encode(" on the mat").ids + [eos]
  assert ex["inputs_pretokenized"].decode() == query("the cat sat")
  # Decoder-only: query then summary; the loss on the summary and its EOS.
  converter = fc.sft_feature_converter("decoder_only", eos_id=eos)
  ds = task.get_dataset({"inputs": 64, "targets": 8}, split="train",
                        shuffle=False)
  [features] = list(converter(ds, {"inputs": 64, "targets": 8})
                    .as_numpy_iterator())
  n_query, n_summary = len(ex["inputs"]) - 1, len(ex["targets"])
  tokens = features["tokens"]
  assert tokens[:n_query].tolist() == ex["inputs"][:-1].tolist()
  assert tokens[n_query:n_query + n_summary].tolist() == ex["targets"].tolist()
  assert features["loss_weights"].tolist() == (
      [0] * n_query + [1] * n_summary + [0] * (len(tokens) - n_query
                                               - n_summary))


def test_comparisons_carry_their_annotation_batch(tmp_path):
  def row(batch):
    return {"info": {"subreddit": "cats", "title": "t", "post": "p"},
            "summaries": [{"text": "a"}, {"text": "b"}], "choice": 0,
            "batch": batch}
  source = file_sources.AlignmentFileSource(
      write_jsonl(tmp_path / "c.json", [row("batch6"), row("batch22"),
                                        row("batch0_cnndm"), row(None)]),
      kind="pairs", layout="tldr")
  assert [e["annotation_batch"] for e in source.examples()] == [
      6.0, 22.0, -1.0, -1.0]


def _register_queries(name, texts, vocabulary):
  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)
  seqio.TaskRegistry.add(
      name, source=seqio.FunctionDataSource(
          lambda split, shuffle_files, seed=None:
          tf.data.Dataset.from_tensor_slices(
              {"inputs": texts, "targets": ["x"] * len(texts)}),
          splits=("train",)),
      preprocessors=[seqio.preprocessors.tokenize,
                     seqio.preprocessors.append_eos_after_trim],
      output_features={"inputs": seqio.Feature(vocabulary, add_eos=True),
                       "targets": seqio.Feature(vocabulary, add_eos=True)})


def test_online_prompt_cutting_never_cuts_the_tldr_suffix(vocab):
  kept = "the cat sat\nthe dog sat"
  long_query = query(kept + "\non the mat\nand the log")
  limit = len(vocab.encode(query(kept))) + 1
  name = "tldr_long_queries"
  _register_queries(name, [long_query, query("a cat")], vocab)
  try:
    prompts = prompts_lib.load_prompts(
        name, "train", limit, suffix=names.TLDR_QUERY_SUFFIX)
    assert prompts.num_cut == 1
    first = prompts.tokens[0][prompts.tokens[0] != 0].tolist()
    assert first == vocab.encode(query(kept)) + [vocab.eos_id]
    assert vocab.decode(first).endswith("\n\nTL;DR:")
    # A prompt that does not end with the configured suffix is refused by
    # name rather than cut anywhere.
    _register_queries(name, ["the cat sat\non the mat\nand the log " * 3],
                      vocab)
    with pytest.raises(prompts_lib.PromptTooLongError,
                       match=r"row 0 .*does not end with the suffix "
                       r"'\\n\\nTL;DR:' \(config.online.prompt_suffix\)"):
      prompts_lib.load_prompts(name, "train", limit,
                               suffix=names.TLDR_QUERY_SUFFIX)
  finally:
    seqio.TaskRegistry.remove(name)


def test_fit_prompt_puts_the_suffix_back_after_every_cut():
  encode = lambda text: text.split() + ["</s>"]
  text = query("one two\nthree four five\nsix seven")
  tokens, cuts = prompts_lib.fit_prompt(
      text, encode, 11, suffix=names.TLDR_QUERY_SUFFIX)
  assert (tokens, cuts) == (encode(query("one two")), 2)
  with pytest.raises(prompts_lib.PromptTooLongError, match="does not end"):
    prompts_lib.fit_prompt(text + " more", encode, 11,
                           suffix=names.TLDR_QUERY_SUFFIX)


def test_tldr_configs_use_the_papers_settings():
  """Tables 3, 4, 6 and 7 of the paper, and its details 2-4, 21, 23."""
  load = lambda name: defaults.load_config_file(REPO / "configs" / name)
  sft, rm, dpo, ppo = (load(f"tldr_pythia_{s}.py")
                       for s in ("sft", "rm", "dpo", "ppo"))
  for c in (sft, rm, dpo, ppo):
    assert (c.model.arch, c.model.size) == ("gpt_neox", "pythia-1b")
    assert (c.optimizer.name, c.optimizer.eps, c.optimizer.learning_rate) == (
        "adamw", 1e-5, 3e-6)
    assert c.data.files.vocabulary.endswith("tokenizer.json")
    # The 512-token query as the decoder reads it (no EOS after a prompt).
    assert c.data.inputs_length == 512
  assert (sft.optimizer.schedule, sft.train.batch_size,
          sft.train.num_steps) == ("cosine", 128, 116_722 // 128)
  assert sft.data.files.layout == "tldr_sft"
  assert sft.data.targets_length == 53
  for c in (rm, dpo):
    assert (c.optimizer.schedule, c.train.batch_size, c.train.num_steps) == (
        "cosine", 64, 92_858 // 64)
    assert c.data.files.layout == "tldr" and c.data.targets_length == 169
  assert (dpo.dpo.loss_type, dpo.dpo.beta) == ("dpo", 0.05)
  assert rm.reward_model.normalize_layout == "tldr_sft"
  assert (ppo.optimizer.schedule, ppo.train.batch_size,
          ppo.train.num_steps) == ("linear", 512, 1_000_000 // 512)
  assert (ppo.online.temperature, ppo.online.kl_coef,
          ppo.online.max_new_tokens) == (0.7, 0.05, 53)
  assert (ppo.online.num_epochs, ppo.online.num_minibatches,
          ppo.online.clip_eps) == (4, 1, 0.2)
  assert (ppo.ppo.gamma, ppo.ppo.lam, ppo.ppo.vf_coef,
          ppo.ppo.value_clip_eps) == (1.0, 0.95, 0.1, 0.2)
  assert ppo.online.eos_trick and ppo.online.missing_eos_penalty == -1.0
  assert ppo.online.prompt_suffix == "\n\nTL;DR:"
  assert not ppo.ppo.whiten_rewards and ppo.ppo.whiten_advantages
  assert ppo.data.files.layout == "tldr_sft"
