"""Process launching: rollout servers as child processes with their own thread budget,
health checks and clean shutdown.

Imports: relayrl.engine, relayrl.config.
"""
