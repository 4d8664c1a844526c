"""Code that relayrl and the vLLM worker extension both load (docs/engine.md "vLLM backend").

Each module here imports only the standard library and torch, never relayrl: the vLLM launcher
puts this directory on the vLLM server's ``PYTHONPATH`` (``relayrl.launch.vllm``), where its
modules are imported by their file names, and relayrl imports them as
``relayrl.engine.wire.<name>``. Their names start with ``relayrl_`` so that, as top-level
modules in vLLM's interpreter, they shadow nothing.
"""
