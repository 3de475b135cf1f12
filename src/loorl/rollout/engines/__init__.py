"""The rollout engines: what samples K completions per prompt from the current policy.

`base` holds the interface every engine implements (`RolloutEngine`, `EngineContext`,
`PolicyWeights`); `factory` picks the class `rollout.engine` or `rollout._target_` names (once, for
`check_config`: `EngineChoice`); `sync` is the callback that hands the engine the policy's weights.
The built-in engines: `hf_engine` (loorl's decoding loop, `decoding`, `kv_cache`, `kept_cache`),
`vllm_engine` (vLLM in the training process, placed by `vllm_colocation`), `vllm_server` (vLLM
servers over HTTP: `server_pool` holds them, `server_launch` starts them, `server_requests` asks
them, `server_adapters` loads LoRA adapters on them, `weight_transfer` sends them weights). The
engines around an engine are in `wrappers`: `ToolEngine` (turns with tools between them) and
`ProcessEngine` (one step off, in a process of its own: `sampler_process`). The DataModule's side of
a rollout (prompts, grading, batches) is the rest of `loorl.rollout`.
"""

from loorl.rollout.engines.base import EngineContext, PolicyWeights, RolloutEngine

__all__ = ["EngineContext", "PolicyWeights", "RolloutEngine"]
