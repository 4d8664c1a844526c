"""Process launching: rollout servers as child processes with their own thread budget,
health checks and clean shutdown; supervision (restart of dead or hung servers with the
latest weights, failover of their requests).

Imports: relayrl.engine, relayrl.config.
"""
