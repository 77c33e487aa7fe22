"""Fleet answers: one node-side command on every chosen node, each bounded, none lost from the answer.

``flatshare check``, ``status`` and ``releases`` ask each node at once (a
thread per node); a node that cannot be reached, is slow, or answers
something that is not JSON is reported by name as UNKNOWN (or with its
error), and the others are still reported.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from ..common import protocol
from ..common.files import loads
from ..common.text import one_line
from ..errors import FlatshareError, TransportError
from .targets import NodeTarget


def at_once(function: Callable[[Any], Any], items: list) -> list:
    """``function(item)`` for every item at once, each in a thread of its own; their results in the items' order.

    The threads are daemon threads, waited for in steps of 0.2 s: a signal reaches the main thread between
    steps, and an operator's side that a signal ends exits without waiting for them (its nodes' commands are
    left to their own bounds). ``concurrent.futures``' workers are joined at the interpreter's exit: an
    interrupted release waited out its retry guard's history reads (``command_timeout_s``) before it exited.

    Raises:
        BaseException: the first item's (in order) that ``function`` raised, once every thread has ended.
    """
    results: list = [None] * len(items)
    raised: list[BaseException | None] = [None] * len(items)

    def one(index: int, item) -> None:
        try:
            results[index] = function(item)
        except BaseException as err:  # raised in the caller's thread, below
            raised[index] = err

    threads = [threading.Thread(target=one, args=(i, item), daemon=True) for i, item in enumerate(items)]
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():
            thread.join(0.2)
    for err in raised:
        if err is not None:
            raise err
    return results


def ask(targets: list[NodeTarget], argv_for: Callable[[NodeTarget], list[str]]) -> dict[str, dict]:
    """Run a JSON-printing node-side command on each node; node name -> its JSON answer or ``{"error": ...}``
    (with ``"code"``, the node-side command's exit status, when it ran and ended without an answer: its
    refusal or damage, which the caller passes on; without one, the node could not be asked).

    Each node gets its own connection and the inventory's ``command_timeout_s``
    (plus its connect bound); the answers come back in inventory order.
    """
    answers: dict[str, dict] = {}

    def one(target: NodeTarget) -> None:
        bound = target.settings.transport.command_timeout_s
        try:
            argv = argv_for(target)  # the node's profile is read here: its error is this node's answer
            conn = target.connect()
        except TransportError as err:  # the node could not be reached (a damaged known_hosts included)
            answers[target.name] = {"error": str(err)}
            return
        except FlatshareError as err:  # this side's input for it is wrong (its profile): its own code, not 6
            answers[target.name] = {"error": str(err), "code": int(err.exit_code)}
            return
        try:
            result = conn.run(argv, timeout_s=bound)
            try:
                document = answer_of(result)
                answers[target.name] = document if isinstance(document, dict) else {"answer": document}
            except ValueError as err:
                answers[target.name] = {"error": not_an_answer(result.status, result.output + result.errors, err),
                                        **({"code": result.status} if isinstance(result.status, int) else {})}
        except TransportError as err:
            answers[target.name] = {"error": str(err)}
        finally:
            conn.close()

    threads = [threading.Thread(target=one, args=(t,), daemon=True) for t in targets]
    for thread in threads:
        thread.start()
    for target, thread in zip(targets, threads):
        bound = target.settings.transport.command_timeout_s + 2 * target.settings.transport.connect_timeout_s + 5
        thread.join(bound)
        if thread.is_alive():
            answers[target.name] = {"error": f"{target.name}: no answer within {bound:g} s"}
    return {t.name: answers.get(t.name, {"error": f"{t.name}: no answer"}) for t in targets}


class NodeCommandError(ValueError):
    """The node's command could not answer and said why (common/protocol.py ``CommandError``: ``error``)."""

    def __init__(self, error: protocol.CommandError) -> None:
        super().__init__(error.message)
        self.error = error


def answer_of(result) -> Any:  # any JSON value: its shape is the caller's to check
    """The JSON answer of a node-side command: its stdout, or else the last line of it (a node's login shell
    may print lines before the command runs; node-side answers are one line, serving-check's may be several).

    Raises:
        NodeCommandError: the command could not answer, and its :class:`protocol.CommandError` says why.
        ValueError: no answer is JSON (the caller names it with :func:`not_an_answer`).
    """
    for text in reversed(result.output.splitlines()):
        said = protocol.parse(text) if protocol.is_protocol(text) else None
        if isinstance(said, protocol.CommandError):
            raise NodeCommandError(said)
    try:
        return loads(result.output)
    except ValueError as err:
        lines = [line for line in result.output.splitlines() if line.strip()]
        if len(lines) < 2:
            raise
        try:
            return loads(lines[-1])
        except ValueError:
            raise err from None


def not_an_answer(status: int | None, output: str, err: ValueError) -> str:
    """One line for a node command's output that is not a JSON answer.

    Args:
        status: the command's exit status (None: none came).
        output: what it printed (stdout and stderr).
        err: the JSON parser's complaint.

    Returns:
        ``exit N: REASON`` for a command that said why it could not answer (:class:`NodeCommandError`: its
        reason whole, up to 4,000 characters, as it carries the way out); else ``exit N: LAST LINE``, each line
        shortened to 300 characters, then the first line when more came, then the parser's complaint when the
        exit status was 0.
    """
    def short(line: str, most: int = 300) -> str:
        return line if len(line) <= most else line[:most] + f"... ({len(line)} characters)"

    if isinstance(err, NodeCommandError):
        return f"exit {err.error.code}: {short(one_line(err.error.message), 4000)}"
    lines = output.strip().splitlines() or ["no output"]

    message = f"{'no exit status' if status is None else f'exit {status}'}: {short(lines[-1])}"
    if len(lines) > 1:
        message += f" (after {len(lines) - 1} other line(s), the first: {short(lines[0])})"
    if status == 0:
        message += f" (not a JSON answer: {err})"
    return message
