"""Rewards computed by programs from a completion's text.

Online RL may train on scores that Python functions compute from the decoded
text, several summed with weights (TRL's `GRPOTrainer(reward_funcs=[...])`
convention, so that users can bring the functions they already have).

The convention. A reward function is called on a batch of rows:

    fn(prompts: list[str], completions: list[str], **columns)
        -> list[float | None]

* `prompts[i]` is row i's prompt text and `completions[i]` the text the
  policy wrote for it (without the EOS).
* `columns` are the prompt rows' other fields, each a list aligned with
  `prompts` (e.g. `answer=["72", "\\\\frac{1}{2}", ...]` for GSM8K or MATH;
  `jaxrlhf.data.prompts.Prompts.columns` holds them per prompt). A function
  takes the columns it needs as keyword arguments and must accept `**kwargs`
  it does not use: every function of a run gets every column.
* It returns one value per row: a float, or None when this reward does not
  apply to the row (a math reward on a row without a reference answer);
  the caller leaves such rows out of this reward's sum.

`host.score` calls a function under that contract with guards (time limit,
wrong counts, non-numbers, exceptions; `host.HostScores`), and
`host.load_function` loads one named "package.module:function" in a config.

Built-in functions:
* `math_answer.make_math_answer_reward` / `math_answer.math_answer_reward`:
  1 when the completion's final answer equals the reference answer
  symbolically (`math-verify`), else 0; compared in a process of its own
  with a time limit per row (`verifier_process`), so that an answer sympy
  cannot evaluate scores 0 instead of stopping the run.
* `text_rewards.make_regex_reward` (format rewards) and
  `text_rewards.make_length_reward`.
* `code_execution.make_code_reward`: the fraction of a row's unit tests the
  completion's code passes, run in a separate, limited process.
And one on the device: `overlong.soft_overlong_penalty` (DAPO's soft
overlong punishment, a jnp function of response lengths).

This package is a floor under the trainer: it imports no model, algorithm,
training or data module.
"""
