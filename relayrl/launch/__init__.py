"""Process launching: rollout servers as child processes (``servers``) with their own thread
budget, health checks and clean shutdown; the rollout-backend seam (``backends``: built-in,
vLLM) and the launcher seam (``launchers``: local, Ray); the vLLM server and its worker
extension (``vllm``, ``vllm_worker``); the distillation teacher's server (``teacher``);
supervision (``supervisor``: restart of dead or hung servers, failover of their requests).
Which weights the servers serve is relayrl.sync's: the supervisor sees it only through its
``ServedWeights`` Protocol.

Imports: relayrl.config, relayrl.engine, relayrl.registry, relayrl.plugins, relayrl.runkey,
relayrl.errors; never relayrl.eval (its independent sibling), relayrl.sync or relayrl.train.
"""
