"""The local sandbox fleet: two nodes on one machine, each with its own systemd
user manager, OpenSSH server and node layout, running vLLM 0.32.0's real CPU
engine (``--engine vllm``) or a stand-in engine, and stand-ins for the other
GPU-bound services. Never used outside the sandbox and the tests.

``fleet.py`` brings it up and down, ``node_profile.py`` writes each node's
profile, ``tiny_model.py`` makes the real engine's model, ``module_build.py``
builds the serve module, ``manager.py`` runs the systemd managers, and
``engine.py``, ``gateway.py``, ``voice.py`` (with ``http.py``) and
``vllm_standin/`` are the stand-ins.
"""
