"""Golden answers in a canary analysis, the pure core: the canary's greedy answers compared token for token.

The profile's ``[release.analysis.golden]`` names a few prompts. When a canary analysis starts, each node
involved answers them through ``flatshare-node answers`` (greedy, ``temperature`` 0, vLLM 0.32.0's
``return_token_ids``: common/completions.py :func:`golden_body`). The canary's answers are compared with the
baseline's (a node still on the old release, same weights: greedy decoding gives the same tokens), or, with no
baseline, with the canary's reference: the answers its history recorded at its last analysis that had them.
With neither, the canary's answers are recorded (in the analysis's history record) as its reference.

A difference fails the analysis, named by the prompt and the first position where the token ids differ,
unless the release says it changes answers (``flatshare release --changes-answers``, recorded with the
analysis). A prompt a node could not answer is said and decides nothing. docs/reference/canary-analysis.md
has the rule; this module does no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..common.protocol import AnalysisPhase
from ..common.text import clip, one_line


@dataclass(frozen=True)
class Difference:
    """The first position where the canary's answer to one prompt differs.

    Attributes:
        number: the prompt's number in the profile (1 for the first).
        prompt: the prompt.
        position: the first differing token's position (0 for the first); where one answer is a prefix of the
            other, the shorter one's length.
        canary_token, other_token: the token ids there; None where that answer had already ended.
    """

    number: int
    prompt: str
    position: int
    canary_token: int | None
    other_token: int | None

    def document(self) -> dict[str, Any]:
        return {"prompt_number": self.number, "prompt": self.prompt, "position": self.position,
                "canary_token": self.canary_token, "other_token": self.other_token}


@dataclass(frozen=True)
class GoldenCheck:
    """One canary's golden answers, and what they were compared with.

    Attributes:
        canary: the canary node.
        against: what the answers were compared with: a baseline node's name, ``reference`` (the canary's
            recorded answers), or None (nothing to compare with: these answers become the reference).
        prompts, max_tokens: the profile's ``[release.analysis.golden]``.
        canary_answers: per prompt, the canary's token ids, or None where it could not answer.
        other_answers: per prompt, the baseline's or the reference's token ids (None: not answered); empty
            when ``against`` is None.
        errors: what could not be answered, one line each (``cyan, prompt 2: ...``).
        changes_answers: the release says it changes answers: a difference is said, not a failure.
    """

    canary: str
    against: str | None
    prompts: tuple[str, ...]
    max_tokens: int
    canary_answers: tuple[tuple[int, ...] | None, ...]
    other_answers: tuple[tuple[int, ...] | None, ...]
    errors: tuple[str, ...]
    changes_answers: bool = False

    @property
    def differences(self) -> tuple[Difference, ...]:
        """Each prompt whose two answers differ (both answered), in the profile's order."""
        if self.against is None:
            return ()
        found = []
        for number, (prompt, mine, theirs) in enumerate(zip(self.prompts, self.canary_answers, self.other_answers,
                                                            strict=True), 1):
            if mine is None or theirs is None or mine == theirs:
                continue
            position = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            found.append(Difference(number, prompt, position, mine[position] if position < len(mine) else None,
                                    theirs[position] if position < len(theirs) else None))
        return tuple(found)

    @property
    def compared(self) -> int:
        """Prompts both sides answered."""
        if self.against is None:
            return 0
        return sum(a is not None and b is not None for a, b in zip(self.canary_answers, self.other_answers))

    @property
    def failed(self) -> bool:
        """The answers differ and the release does not say it changes them: the analysis fails."""
        return bool(self.differences) and not self.changes_answers

    def reason(self) -> str:
        """The analysis's reason when the check failed (the first difference, named)."""
        first = self.differences[0]
        more = len(self.differences) - 1
        return (f"golden answers differ from {self._other_name()}: {self._named(first)}"
                + (f"; {more} more prompt(s) differ" if more else ""))

    def line(self) -> str:
        """The operator's line: what was compared with what, and what came of it."""
        errors = f"; not answered: {'; '.join(self.errors)}" if self.errors else ""
        if self.against is None:
            answered = sum(a is not None for a in self.canary_answers)
            return (f"golden answers of {self.canary}: {answered} of {len(self.prompts)} prompt(s) answered and "
                    f"recorded as its reference (no baseline and no reference to compare with){errors}")
        if not self.compared:
            return (f"golden answers of {self.canary} against {self._other_name()}: none of the "
                    f"{len(self.prompts)} prompt(s) could be compared{errors}")
        if not self.differences:
            tokens = sum(len(a) for a, b in zip(self.canary_answers, self.other_answers)
                         if a is not None and b is not None)
            return (f"golden answers of {self.canary} against {self._other_name()}: {self.compared} of "
                    f"{len(self.prompts)} prompt(s) agree token for token ({tokens} tokens in all){errors}")
        said = "; ".join(self._named(d) for d in self.differences)
        then = (" (the release says it changes answers, --changes-answers: not a failure)" if self.changes_answers
                else ": the analysis fails")
        return f"golden answers of {self.canary} differ from {self._other_name()}: {said}{then}{errors}"

    def _other_name(self) -> str:
        return f"{self.canary}'s reference answers" if self.against == "reference" else f"{self.against}'s"

    def _named(self, d: Difference) -> str:
        def token(value: int | None) -> str:
            return "its end" if value is None else f"token id {value}"

        other = "the reference" if self.against == "reference" else self.against
        return (f"prompt {d.number} ('{clip(one_line(d.prompt), 40)}') first differs at token {d.position}: "
                f"{self.canary} {token(d.canary_token)}, {other} {token(d.other_token)}")

    def document(self) -> dict[str, Any]:
        """JSON-ready, for the analysis's history record (the canary's answers become a later reference)."""
        return {"against": self.against, "prompts": list(self.prompts), "max_tokens": self.max_tokens,
                "canary_answers": [None if a is None else list(a) for a in self.canary_answers],
                "other_answers": [None if a is None else list(a) for a in self.other_answers],
                "errors": list(self.errors), "changes_answers": self.changes_answers, "failed": self.failed,
                "differences": [d.document() for d in self.differences], "line": self.line()}


def _token_ids(value: object, max_tokens: int) -> tuple[int, ...] | None:
    """``value`` as an answer's token ids: a list of at most ``max_tokens`` ids, each a whole number from 0 to
    2**31 - 1 (never a boolean); None when it is not one."""
    if not isinstance(value, list) or len(value) > max_tokens:
        return None
    if not all(type(t) is int and 0 <= t < 2**31 for t in value):
        return None
    return tuple(value)


def answers_of(node: str, answer: object, count: int,
               max_tokens: int) -> tuple[tuple[tuple[int, ...] | None, ...], list[str]]:
    """A node's ``flatshare-node answers`` JSON -> (per prompt, its token ids or None; one line per prompt not
    answered). A whole answer that is not one (the node could not ask its engine) leaves every prompt None; so
    does, for its prompt, a list of ids that no answer of ``max_tokens`` tokens can be (too long, negative ids,
    booleans)."""
    if not isinstance(answer, dict) or not isinstance(answer.get("answers"), list) or len(answer["answers"]) != count:
        why = answer.get("error") if isinstance(answer, dict) and isinstance(answer.get("error"), str) else \
            "its answer holds no answer per prompt"
        return (None,) * count, [f"{node}: {clip(one_line(why), 300)}"]
    ids: list[tuple[int, ...] | None] = []
    errors = []
    for number, item in enumerate(answer["answers"], 1):
        tokens = _token_ids(item.get("token_ids"), max_tokens) if isinstance(item, dict) else None
        if tokens is not None:
            ids.append(tokens)
        else:
            ids.append(None)
            why = item.get("error") if isinstance(item, dict) and isinstance(item.get("error"), str) else (
                f"no token ids of at most {max_tokens} tokens")
            errors.append(f"{node}, prompt {number}: {clip(one_line(why), 300)}")
    return tuple(ids), errors


def reference_of(records: list, prompts: list[str], max_tokens: int) -> tuple[tuple[int, ...] | None, ...] | None:
    """The canary's reference answers from its history records (oldest first): the canary's answers of the
    newest analysis record that passed and whose golden answers were for these prompts and ``max_tokens``;
    None when there is none."""
    for record in reversed(records):
        analysis = record.get("analysis") if isinstance(record, dict) else None
        if not isinstance(analysis, dict) or analysis.get("phase") != AnalysisPhase.PASSED:
            continue
        golden = analysis.get("golden")
        if (not isinstance(golden, dict) or golden.get("prompts") != prompts
                or type(golden.get("max_tokens")) is not int or golden.get("max_tokens") != max_tokens
                or golden.get("failed") is not False or not isinstance(golden.get("canary_answers"), list)
                or len(golden["canary_answers"]) != len(prompts)):
            continue
        answers = [None if a is None else _token_ids(a, max_tokens) for a in golden["canary_answers"]]
        if any(a is None and b is not None for a, b in zip(answers, golden["canary_answers"])):
            continue  # a damaged answer: no reference
        if all(a is None for a in answers):
            continue  # nothing answered then: no reference, an older one may be
        return tuple(answers)
    return None
