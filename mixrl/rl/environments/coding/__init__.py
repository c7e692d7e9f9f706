"""The agentic coding environment (the seed's task): tasks, sandboxed tools, test-based reward.

``rollout.environment: mixrl.rl.environments.coding:CodingEnvironment`` (real chat models, JSON
tool calls) or ``mixrl.rl.environments.coding:PlainCodingEnvironment`` (tiny models, plain-text
calls).  See docs/rollout.md and docs/sandbox.md.
"""

from mixrl.rl.environments.coding.environment import CodingEnvironment, CodingEpisode, PlainCodingEnvironment
from mixrl.rl.environments.coding.tasks import CodingTask, generate_tasks

__all__ = ["CodingEnvironment", "CodingEpisode", "CodingTask", "PlainCodingEnvironment", "generate_tasks"]
