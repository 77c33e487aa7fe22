"""What the operator's side, the node and serving-check share: standard library only.

Nothing here imports pydantic, jinja2, tomlkit, paramiko or typer, so that
serving-check (every minute on every node) and the node's switcher stay
cheap to start (adr/0006-serving-check-cost.md).
"""
