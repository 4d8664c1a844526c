"""relayrl: fully asynchronous RL for LLM reasoning.

Packages follow the data flow (see docs/architecture.md):
tasks -> engine -> rollout -> rewards -> buffer -> algo -> train, with eval, launch and cli around them.
"""

__version__ = "0.1.0"
