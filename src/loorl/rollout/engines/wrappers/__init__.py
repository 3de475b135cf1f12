"""The engines around an engine: `tool_engine` (`ToolEngine`: generating in turns with tools between
them, `tools.max_turns`) and `process_engine` (`ProcessEngine`: one step off, sampled in a process of
its own, `rollout.devices`). Each holds the run's engine as `inner` and hands it the weights."""
