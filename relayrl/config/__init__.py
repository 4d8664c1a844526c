"""Run configuration: the typed schema (pydantic v2), YAML loading, dotted command-line
overrides and their error messages, and ``RunBudget`` (budget.py): the size of a short
measured run as benchmarks and experiments set it.

Imports: pydantic, yaml and relayrl.errors only; every other package reads its settings from here.
"""
