"""Benchmarks run by ``relayrl bench <name>``: one module per benchmark (``HELP``,
``add_arguments``, ``run``), importing heavy dependencies inside ``run``.
"""
