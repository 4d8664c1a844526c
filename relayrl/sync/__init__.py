"""Which weights the rollout servers serve, and how the trainer's get there: one owner.

One module per piece:

- ``weight_sync``: :class:`WeightSync`, the owner: publish the trainer's weights (in the
  background, one publication after the other), decide when (:meth:`WeightSync.maybe_publish`,
  :func:`publish_interval`), bring the servers to the trainer's version before an
  evaluation, name the snapshot a restarted server loads and catch a restarted server up,
  resume servers a publication kept paused, close the transport;
- ``clock``: :class:`VersionClock`, the trainer's version and the published version, read
  from one place: the run's one clock, which ``WeightSync`` alone advances and the rollout
  controller's admission reads (as its ``relayrl.rollout.controller.PublishedVersion``);
- ``transaction``: one publication as a transaction (pause → load → verify → resume, each
  step under a deadline), :class:`PublishMode`, :class:`Deadlines`,
  :class:`PublicationError`;
- ``canary``: the check that each server samples from the weights it loaded;
- ``transports``: the weight transports (``train.weight_transport``: disk, broadcast, a
  plugin's), the sending side only: what a server does with what it receives is
  ``relayrl.engine``'s.

Import the names from their modules (this package's ``__init__`` imports nothing, so a
transport's registry path loads only the transports). The supervisor
(``relayrl.launch.supervisor``) keeps the servers alive and does not know
this package: it sees :class:`WeightSync` as its ``ServedWeights`` Protocol. Published weight
versions live here and on the servers; the rollout controller reads them from the clock
and is told to look again after each publication.

Imports: relayrl.launch (the supervisor, free ports), relayrl.engine (clients, transfer,
adapters, checksums), relayrl.config, relayrl.errors, relayrl.registry,
relayrl.metric_names; imported by relayrl.train (a live run) and relayrl.bench.
"""
