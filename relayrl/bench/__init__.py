"""Benchmarks run by ``relayrl bench <name>``: one module per benchmark (``HELP``,
``add_arguments``, ``run``), importing heavy dependencies inside ``run``.

Imports: any layer below (relayrl.train, relayrl.sync, relayrl.launch, relayrl.eval,
relayrl.config and lower); never relayrl.experiments (its independent sibling) or
relayrl.cli, which loads these modules by name.
"""
