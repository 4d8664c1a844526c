"""Rollout controller: the seeded data loader, group sampling, staleness-bounded
admission, resubmission of interrupted requests and the Trajectory record.

Imports: relayrl.engine (client), relayrl.rewards, relayrl.tasks, relayrl.config.
"""
