"""A Python interpreter as a tool: the model writes code, reads its output.

    --config.online.tools=jaxrlhf.agents.python_tool:python

The code runs as the code reward runs a completion
(`jaxrlhf.rewards.code_execution.run_tests`): in a separate process with a
time and a memory limit, no network, a scratch directory, and bubblewrap's
namespaces where `bwrap` runs (`code_execution.network_protection()` says
which protection a machine gives). What the tool returns is what the code
printed (stdout and stderr, at most `MAX_REPLY_CHARS`), then the exception
that stopped it, if one did.
"""

from jaxrlhf.rewards import code_execution

TIMEOUT_S = 5.0
MEMORY_MB = 512
MAX_REPLY_CHARS = 2000


def python(code: str) -> str:
  """Runs Python code and returns what it prints.

  Args:
    code: the Python source to run; print what you want to see.
  """
  run = code_execution.run_tests(code, [], timeout_s=TIMEOUT_S,
                                 memory_mb=MEMORY_MB)
  reply = run.output
  if run.timed_out:
    reply += f"\nerror: the code ran past {TIMEOUT_S:g} s and was stopped."
  elif run.code_error:
    reply += f"\nerror: {run.code_error}"
  reply = reply.strip()
  if len(reply) > MAX_REPLY_CHARS:
    reply = reply[:MAX_REPLY_CHARS] + "\n... (output cut)"
  return reply
