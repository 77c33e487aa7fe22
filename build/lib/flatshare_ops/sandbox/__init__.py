"""The local sandbox fleet: two nodes on one machine, each with its own systemd
user manager, OpenSSH server and node layout, running stand-ins for the
GPU-bound services. Never used outside the sandbox and the tests.
"""
