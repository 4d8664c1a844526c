"""relayrl: fully asynchronous RL for LLM reasoning.

One package per part of a training step's data flow, in import layers: a package imports
only from the layers below its own, and the packages of one layer (``a | b``) import
neither each other. import-linter's layers contract in pyproject.toml is the rule;
docs/architecture.md lists each package, what it owns and why the layers are in this order,
and follows one training step through them. This module owns ``__version__`` and imports
nothing; the top-level modules ``runkey``, ``plugins``, ``registry``, ``errors`` and
``metric_names`` are the lowest layers, importable from every package.
"""

__version__ = "0.1.0"
