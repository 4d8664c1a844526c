"""Run configuration: the typed schema (pydantic v2, ``schema``), YAML loading, dotted
command-line overrides and their error messages (``loader``), the ``algo`` keys each loss and
advantage estimator declares (``objectives``), the generated reference page
(``reference``) and ``RunBudget`` (``budget``): the size of a short measured run as
benchmarks and experiments set it.

Imports: pydantic, yaml, and the owners of the options the schema composes, all in layers
below: relayrl.rollout (controller options, the staleness bound, workflows), relayrl.engine
(engine options), relayrl.rewards (graders), relayrl.algo (losses, advantages, their
parameters), relayrl.models (GGUF paths), relayrl.tasks, relayrl.plugins, relayrl.registry,
relayrl.errors. The layers above (launch, eval, sync, train, the entry points) read a
``RunConfig``; the layers below never do: they take plain options built from it.
"""
