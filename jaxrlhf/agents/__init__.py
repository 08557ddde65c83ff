"""Agents: tools offered to the model and tool calls read from its text.

`tools`: Python functions as the JSON schemas chat templates show
(`tool_schema`, `load_tools`). `tool_calls`: the calls in a model's turn
(`parse_tool_calls`), checked against those schemas (`validate_arguments`)
and run (`run_tool_call`). Multi-turn rollouts that use them are not built
yet (issue 40).
"""
