"""A recording fake of a node's systemd manager, for tests that run a node's logic in their own process.

It has :class:`flatshare_ops.common.systemd.Manager`'s methods (what a node's side may ask of its manager:
node/context.py ``NodeContext.manager``) and keeps, in order, every call made to it (``calls``), as pyinfra's
fake connector records the commands it is given. Units are a table of properties; a job changes the unit's
``ActiveState`` (and, for a start, its ``InvocationID``) as systemd would once the job is done, and an enable
makes ``UnitFileState`` ``enabled``. A property the table does not hold is what systemd answers for a unit it
has not loaded (org.freedesktop.systemd1(5): ``LoadState`` ``not-found``, ``ActiveState`` ``inactive``, an empty
``UnitFileState``).

Use it for matrices of cases whose class of fault has a test against a real manager (tests that drive a
sandbox node's systemd through pystemd), never as the only test of a behaviour.
"""

from __future__ import annotations

import itertools
from typing import Any

#: What systemd answers for a property of a unit it has not loaded (org.freedesktop.systemd1(5)).
NOT_LOADED: dict[str, Any] = {"LoadState": "not-found", "ActiveState": "inactive", "SubState": "dead",
                              "UnitFileState": "", "NRestarts": 0, "InvocationID": b"", "MainPID": 0,
                              "DropInPaths": [], "FragmentPath": ""}


class FakeManager:
    """A node's manager as a table of units, recording what it is asked.

    Attributes:
        units: unit name -> property name -> value.
        manager: the manager's own properties (``UnitPath``, ...).
        calls: each call, in order: ``(method, args...)``.
    """

    def __init__(self, units: dict[str, dict[str, Any]] | None = None,
                 manager: dict[str, Any] | None = None) -> None:
        self.units = {name: dict(props) for name, props in (units or {}).items()}
        self.manager = dict(manager or {"UnitPath": []})
        self.calls: list[tuple] = []
        self._invocations = itertools.count(1)

    def _property(self, unit: str, prop: str) -> Any:
        if not unit:
            return self.manager[prop]
        return self.units.get(unit, {}).get(prop, NOT_LOADED.get(prop))

    def properties(self, queries: list[tuple[str, str, str]], timeout_s: float = 5.0) -> dict[str, Any]:
        self.calls.append(("properties", tuple(queries)))
        return {f"{unit}/{prop}": self._property(unit, prop) for unit, _interface, prop in queries}

    def job(self, verb: str, unit: str, timeout_s: float, progress=None) -> str:
        self.calls.append(("job", verb, unit))
        props = self.units.setdefault(unit, {})
        if verb == "stop":
            props["ActiveState"] = "inactive"
        else:  # start, restart, reload-or-restart: active once the job is done
            if verb != "start" or props.get("ActiveState") != "active":
                props["InvocationID"] = f"{next(self._invocations):032x}".encode()
            props["ActiveState"] = "active"
        return "done"

    def reload(self, timeout_s: float = 60.0) -> None:
        self.calls.append(("reload",))

    def enable(self, units: list[str], timeout_s: float = 30.0) -> list:
        self.calls.append(("enable", tuple(units)))
        changes = []
        for unit in units:
            props = self.units.setdefault(unit, {})
            if props.get("UnitFileState") != "enabled":
                changes.append(["symlink", f"/etc/systemd/system/multi-user.target.wants/{unit}", unit])
            props["UnitFileState"] = "enabled"
        return changes

    def unit_processes(self, unit: str, timeout_s: float = 5.0) -> list[tuple[int, str]]:
        self.calls.append(("unit_processes", unit))
        return []

    def asked(self, method: str) -> list[tuple]:
        """The calls of one method, each without its method's name."""
        return [call[1:] for call in self.calls if call[0] == method]
