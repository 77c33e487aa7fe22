"""The rollout's decisions, on fake connections (tests/fake_connection.py): admission, loss, silence, order.

The same decisions are exercised for real on the sandbox in test_release.py and test_fleet_safety.py;
these pin each rule exactly and fast.
"""

from __future__ import annotations

import io
import json

import pytest

from fake_connection import FakeNode, fleet
from flatshare_ops.control.connection import Lost
from flatshare_ops.control.rollout import Rollout
from flatshare_ops.errors import Exit
from flatshare_ops.common import protocol
from flatshare_ops.node.output import ReleaseOutput

ADMIT = protocol.line(protocol.AdmitRequest("cyan", "s1")).encode()
RESULTS: dict[int, str] = {Exit.OK: protocol.OutcomeResult.ROLLED_BACK, Exit.REFUSED: protocol.OutcomeResult.REFUSED,
                           Exit.NOTHING_TO_DO: protocol.OutcomeResult.NOTHING_TO_DO}


def outcome(code: int) -> bytes:
    return protocol.line(protocol.Outcome("s1", int(code), RESULTS.get(code, protocol.OutcomeResult.FAILED))).encode()


#: The summary document of the last :func:`run` (control/rollout.py ``Rollout.document``): what it says of each node.
last: dict = {}


def run(targets, chosen=None, **options):
    stream = io.StringIO()
    rollout = Rollout(None, chosen or targets, targets, ReleaseOutput(None, stream), mode="rollback", **options)
    code = rollout.run()
    last.clear()
    last.update(json.loads(json.dumps(rollout.document())))  # as --json prints it: JSON through and through
    return code, stream.getvalue()


def result_of(name: str) -> str:
    """What the last run's summary document says became of node ``name``."""
    return last["nodes"][name]["result"]


def test_a_node_is_admitted_while_the_other_takes_calls_and_is_not_locked():
    cyan = FakeNode(switch_script=[ADMIT, b"switching\n", outcome(0)])
    targets = fleet(cyan=cyan, peacock=FakeNode())
    code, text = run(targets, chosen=targets[:1])
    assert code == Exit.OK, text
    assert json.loads(cyan.stdin[-1]) == {"admit": True, "reason": None}
    assert "admission for cyan: peacock: takes calls, no release holds it" in text


def test_a_node_is_refused_while_the_other_is_locked_or_not_serving_or_unreachable():
    for other in (FakeNode(probe={"takes_calls": True, "locked": True, "problems": [], "holder": "x pid 9"}),
                  FakeNode(probe={"takes_calls": False, "locked": False, "problems": ["gateway inactive"],
                                  "holder": None}),
                  FakeNode(reachable=False)):
        cyan = FakeNode(switch_script=[ADMIT, outcome(Exit.REFUSED)], switch_status=Exit.REFUSED)
        targets = fleet(cyan=cyan, peacock=other)
        code, text = run(targets, chosen=targets[:1])
        answer = json.loads(cyan.stdin[-1])
        assert answer["admit"] is False and "min_serving 1" in answer["reason"], text
        assert code == Exit.REFUSED


def test_a_node_being_released_that_takes_calls_counts_its_calls_as_moving_onto_the_carrier_too():
    # A breaker's case: cyan and peacock released at once, teal left serving; each admission counted its own
    # calls only (50 of 64 seats each), and teal was left with 70 requests.
    twenty = {"running": 20, "waiting": 0, "max_num_seqs": 32, "kv_cache_usage": 0.1}
    cyan = FakeNode(switch_script=[protocol.line(protocol.AdmitRequest("cyan", "s1", load=twenty)).encode(),
                                   outcome(Exit.REFUSED)], switch_status=Exit.REFUSED)
    peacock = FakeNode(probe={"takes_calls": True, "locked": True, "problems": [], "holder": "x pid 9",
                              "load": twenty})
    teal = FakeNode(probe={"takes_calls": True, "locked": False, "problems": [], "holder": None,
                           "load": {**twenty, "running": 30}})
    targets = fleet(cyan=cyan, peacock=peacock, teal=teal)
    code, text = run(targets, chosen=targets[:1])
    answer = json.loads(cyan.stdin[-1])
    assert answer["admit"] is False and "70 requests for 64 seats" in answer["reason"], (answer, text)
    assert "peacock, which may drain too, moves 20 running + 0 waiting" in answer["reason"], answer
    # peacock not being released: its calls stay where they are, and cyan alone fits (50 of 64 seats; the other
    # carrier, peacock, adds its own 20 running and 32 seats: 70 of 128)
    cyan = FakeNode(switch_script=[protocol.line(protocol.AdmitRequest("cyan", "s1", load=twenty)).encode(),
                                   b"switching\n", outcome(0)])
    targets = fleet(cyan=cyan, peacock=FakeNode(probe={**peacock.probe, "locked": False, "holder": None}), teal=teal)
    code, text = run(targets, chosen=targets[:1])
    assert json.loads(cyan.stdin[-1]) == {"admit": True, "reason": None}, text


def test_a_lost_connection_reports_what_the_node_says_not_what_the_transport_guessed():
    record = {"result": "released", "target": "r2", "step": None}
    cyan = FakeNode(switch_script=[b"step 1/9\n", Lost], status_answers=[{"state": "recorded", "record": record}])
    targets = fleet(cyan=cyan, peacock=FakeNode())
    code, text = run(targets, chosen=targets[:1])
    assert code == Exit.OK and "cyan: the node says: released r2" in text, text


def test_a_stalled_session_trips_the_silence_bound_and_a_node_still_switching_has_its_own_code():
    cyan = FakeNode(switch_script=[b"step 1/9\n"] + [None] * 10,
                    status_answers=[{"state": "switching", "journal": "switch a -> b, 3/9 steps done"}])
    targets = fleet(cyan=cyan, peacock=FakeNode())
    code, text = run(targets)
    assert "the silence bound" in text and code == Exit.STILL_SWITCHING, text
    assert "cyan: the node is still switching after 2 s (the reconnect bound)" in text
    assert result_of("peacock") == "not started", last  # --all does not go on past a node still switching


def test_a_failed_node_stops_the_rollout_and_names_the_rest_not_started():
    cyan = FakeNode(switch_script=[outcome(Exit.FAILED)], switch_status=Exit.FAILED)
    targets = fleet(cyan=cyan, peacock=FakeNode())
    code, text = run(targets)
    assert code == Exit.FAILED
    assert result_of("cyan") == "failed mid-switch (journal kept)" and result_of("peacock") == "not started", last
    assert last["nodes"]["cyan"]["code"] == Exit.FAILED and last["code"] == Exit.FAILED, last
    assert targets[1].fake.commands == []


def test_a_command_that_ends_without_its_outcome_asks_the_node():
    record = {"result": "failed", "target": "r2", "step": "restart-engine", "reason": "boom"}
    cyan = FakeNode(switch_script=[b"step 4/9\n"], switch_status=None,
                    status_answers=[{"state": "recorded", "record": record}])
    targets = fleet(cyan=cyan, peacock=FakeNode())
    code, text = run(targets, chosen=targets[:1])
    assert code == Exit.FAILED and "failed at restart-engine: boom" in text, text


def test_a_fleet_answer_that_is_not_json_is_named_with_its_first_and_last_lines():
    from flatshare_ops.control import commands
    from flatshare_ops.control.fanout import ask

    record = json.dumps({"records": [{"result": "released"}] * 40, "skipped": []})
    torn = record[: len(record) // 2]
    targets = fleet(cyan=FakeNode(other_output=f"a stray warning\n{torn}\n".encode()),
                    peacock=FakeNode(other_output=f"{record}\n".encode()))
    answers = ask(targets, lambda t: commands.history(t.spec))
    error = answers["cyan"]["error"]
    assert error.startswith("exit 0: {") and "the first: a stray warning" in error, error
    assert "not a JSON answer: " in error and f"({len(torn)} characters)" in error, error
    assert "\n" not in error and len(error) < 800
    assert answers["peacock"] == json.loads(record)


def test_a_line_a_nodes_shell_prints_before_the_answer_is_not_taken_for_the_answer():
    # pyenv's rehash in a login script, racing another session's, printed this on a node's stderr (seen here):
    # the answer is the command's last line of stdout, and stderr is apart.
    from flatshare_ops.control import commands
    from flatshare_ops.control.fanout import ask

    record = json.dumps({"records": [], "skipped": []})
    noise = "rm: cannot remove '/root/.pyenv/shims/tmp.QeP6J5ds93': No such file or directory"
    answers = ask(fleet(cyan=FakeNode(other_output=f"{noise}\n{record}\n".encode()), peacock=FakeNode()),
                  lambda t: commands.history(t.spec))
    assert answers["cyan"] == json.loads(record), answers


def test_the_summary_says_what_the_node_did_as_its_outcome_says_never_its_text_for_people():
    # The people's line says "released"; the outcome document is what counts.
    nodes = {name: FakeNode(switch_script=[f"{name}: released r1\n".encode(), protocol.line(
        protocol.Outcome("s1", 0, word, "r1")).encode()], switch_status=Exit.OK)
             for name, word in (("cyan", protocol.OutcomeResult.ROLLED_BACK),
                                ("peacock", protocol.OutcomeResult.REPAIRED))}
    targets = fleet(**nodes)
    code, text = run(targets)  # two nodes: a row each in the summary
    assert code == Exit.OK and (result_of("cyan"), result_of("peacock")) == ("rolled back", "repaired"), last
    rows = {line.split()[0]: line for line in text.splitlines() if line.startswith(("  cyan ", "  peacock "))}
    assert " rolled back " in rows["cyan"] and " repaired " in rows["peacock"], text  # the summary table's rows
    assert text.splitlines()[-2:] == ["cyan: rolled back", "peacock: repaired"], text  # and a line a node


def test_an_automatic_rollback_stops_the_rollout_with_its_own_code_and_says_why():
    why = "restart-engine failed: http://127.0.0.1:8000/health did not answer 200 within the engine's start budget"
    cyan = FakeNode(switch_script=[protocol.line(protocol.Outcome(
        "s1", int(Exit.ROLLED_BACK), protocol.OutcomeResult.AUTO_ROLLED_BACK, "r0", why)).encode()],
                    switch_status=Exit.ROLLED_BACK)
    peacock = FakeNode()
    targets = fleet(cyan=cyan, peacock=peacock)
    code, text = run(targets)
    assert code == Exit.ROLLED_BACK, text
    assert (result_of("cyan"), last["nodes"]["cyan"]["message"]) == ("rolled back automatically", why), last
    assert f"cyan: rolled back automatically: {why}" in text.splitlines(), text  # under the summary table
    assert result_of("peacock") == "not started", last
    assert not [c for c in peacock.commands if c[1] == "switch"], peacock.commands


def test_a_node_without_the_node_side_command_is_named_at_once_and_nothing_is_followed_up():
    cyan = FakeNode(switch_script=[b"bash: /opt/flatshare-ops/.venv/bin/flatshare-node: No such file or directory\n"],
                    switch_status=127)
    targets = fleet(cyan=cyan, peacock=FakeNode())
    code, text = run(targets, chosen=targets[:1])
    assert code == Exit.REFUSED, text
    assert "flatshare-node could not be run on cyan (exit 127); nothing was changed there" in text
    assert "'flatshare node bootstrap --node cyan'" in text
    assert [argv[1] for argv in cyan.commands] == ["switch"]  # no status follow-up


def test_a_lost_session_whose_node_refused_reports_the_refusal_the_node_kept():
    # The node refused (its operator went away at the admission) and kept its outcome (node/outcomes.py).
    kept = {"switch": "s1", "code": 3, "result": "refused", "message": "release refused: cyan may not drain now: x"}
    cyan = FakeNode(switch_script=[ADMIT[:10], Lost], status_answers=[{"state": "ended", "outcome": kept}])
    targets = fleet(cyan=cyan, peacock=FakeNode())
    code, text = run(targets, chosen=targets[:1])
    assert code == Exit.REFUSED, text
    assert "cyan: the node says: refused: release refused: cyan may not drain now: x" in text, text
    assert "unreachable" not in text


def test_more_canaries_than_a_rollout_can_have_is_said_not_silently_capped():
    # A breaker's case: rollout.canaries 3 on a two-node fleet ran one canary without a word.
    targets = fleet(rollout={"canaries": 3}, cyan=FakeNode(switch_script=[outcome(Exit.NOTHING_TO_DO)],
                                                        switch_status=Exit.NOTHING_TO_DO),
                    peacock=FakeNode(switch_script=[outcome(Exit.NOTHING_TO_DO)], switch_status=Exit.NOTHING_TO_DO))
    code, text = run(targets)
    assert code == Exit.NOTHING_TO_DO, text
    assert "batches cyan | peacock (the first: the canary)" in text, text
    assert "rollout.canaries 3 is more than this rollout of 2 nodes can have: 1, so that a node follows" in text, text


def test_a_canary_that_rolled_itself_back_stops_the_rollout_whatever_max_failed_tolerates():
    # A breaker's case: four nodes, max_failed 1: the canary rolled itself back (its new engine never started)
    # and the next batch was switched to the same release.
    canary = FakeNode(switch_script=[outcome(Exit.ROLLED_BACK)], switch_status=Exit.ROLLED_BACK)
    targets = fleet(rollout={"canaries": 1, "batch": 2, "max_failed": 1}, n1=canary, n2=FakeNode(), n3=FakeNode())
    code, text = run(targets)
    assert code == Exit.ROLLED_BACK, text
    assert "rollout" in text and "stops: the canary n1 did not switch to the release" in text, text
    assert targets[1].fake.commands == [] and targets[2].fake.commands == [], text  # never started


def test_a_canary_refused_in_a_dry_run_is_said_as_a_dry_runs():
    # A new user's case: a held canary in `release --all --dry-run` "did not switch", as if something had run.
    canary = FakeNode(switch_script=[outcome(Exit.REFUSED)], switch_status=Exit.REFUSED)
    targets = fleet(rollout={"canaries": 1, "batch": 2, "max_failed": 1}, n1=canary, n2=FakeNode(), n3=FakeNode())
    code, text = run(targets, dry_run=True)
    assert code == Exit.REFUSED, text
    assert "stops: the canary n1 would not switch to the release in this dry run" in text, text
    assert "did not switch" not in text, text
    assert targets[1].fake.commands == [] and targets[2].fake.commands == [], text


def test_one_node_reached_under_two_names_is_counted_once():
    # A breaker's case: the inventory listed peacock twice (as peacock and ghost); both answered "takes calls"
    # and cyan drained with one node serving. The SSH host key tells one node from another, whatever its name.
    cyan = FakeNode(switch_script=[ADMIT, outcome(3)], identity="ssh-ed25519 CYAN")
    peacock, ghost = (FakeNode(identity="ssh-ed25519 PEACOCK") for _ in range(2))
    targets = fleet(min_serving=2, cyan=cyan, peacock=peacock, ghost=ghost)
    code, text = run(targets, chosen=targets[:1])
    answer = json.loads(cyan.stdin[-1])
    assert answer["admit"] is False and "1 other node(s) take calls" in answer["reason"], text
    assert "ghost: the same node as peacock (the same SSH host key): not counted again" in text, text


def test_the_draining_node_under_another_name_is_not_counted_for_itself():
    cyan = FakeNode(switch_script=[ADMIT, outcome(3)], identity="ssh-ed25519 CYAN")
    targets = fleet(cyan=cyan, alias=FakeNode(identity="ssh-ed25519 CYAN"))
    code, text = run(targets, chosen=targets[:1])
    assert json.loads(cyan.stdin[-1])["admit"] is False, text
    assert "alias: the same node as cyan, the node that would drain (the same SSH host key)" in text, text


def _reporting(node_id: str, **probe) -> dict:
    return {"takes_calls": True, "locked": False, "problems": [], "holder": None, "node_id": node_id, **probe}


def test_one_node_reached_with_two_host_keys_is_counted_once_by_the_id_it_reports():
    # A breaker's case: a second sshd on cyan's address (another host key type, as production's sshd offers
    # several) listed as cyan2: two host keys, one node, counted twice towards min_serving 2. The node's own id
    # (its machine and state directory, node/probe.py node_identity) tells: the same id is the same node.
    peacock = FakeNode(switch_script=[protocol.line(protocol.AdmitRequest("peacock", "s1", False, "m:1:9")).encode(),
                                      outcome(3)], identity="ssh-ed25519 PEACOCK")
    cyan = FakeNode(identity="ssh-ed25519 CYAN", probe=_reporting("m:1:2"))
    cyan2 = FakeNode(identity="ecdsa-sha2-nistp256 CYAN", probe=_reporting("m:1:2"))
    targets = fleet(min_serving=2, peacock=peacock, cyan=cyan, cyan2=cyan2)
    code, text = run(targets, chosen=targets[:1])
    answer = json.loads(peacock.stdin[-1])
    assert answer["admit"] is False and "1 other node(s) take calls" in answer["reason"], text
    assert "cyan2: the same node as cyan (the same node id): not counted again" in text, text


def test_the_draining_node_reporting_its_own_id_is_not_counted_for_itself():
    cyan = FakeNode(switch_script=[protocol.line(protocol.AdmitRequest("cyan", "s1", False, "m:1:2")).encode(),
                                   outcome(3)], identity="ssh-ed25519 CYAN")
    targets = fleet(cyan=cyan, alias=FakeNode(identity="ecdsa-sha2-nistp256 CYAN", probe=_reporting("m:1:2")))
    code, text = run(targets, chosen=targets[:1])
    assert json.loads(cyan.stdin[-1])["admit"] is False, text
    assert "alias: the same node as cyan, the node that would drain (the same node id)" in text, text


def test_a_probe_that_read_another_hosts_gateway_is_not_counted():
    # A breaker's case: peacock's profile named cyan's gateway as its own; its probe answered for cyan's.
    probe = {"takes_calls": True, "locked": False, "problems": [], "holder": None, "gateway": "http://cyan:8080"}
    cyan = FakeNode(switch_script=[ADMIT, outcome(3)])
    targets = fleet(cyan=cyan, peacock=FakeNode(probe=probe))
    code, text = run(targets, chosen=targets[:1])
    assert json.loads(cyan.stdin[-1])["admit"] is False, text
    assert "peacock: its probe read the gateway at http://cyan:8080, which does not name peacock" in text
    # Its own loopback, asked on the node itself, is its own gateway.
    own = FakeNode(switch_script=[ADMIT, outcome(0)])
    targets = fleet(cyan=own, peacock=FakeNode(probe={**probe, "gateway": "http://127.0.0.1:8080"}))
    code, text = run(targets, chosen=targets[:1])
    assert json.loads(own.stdin[-1])["admit"] is True, text


def test_a_gateway_url_names_its_node_by_the_inventorys_host_or_its_own_loopback():
    from flatshare_ops.control.targets import names_node

    # Production: the inventory reaches the node by name; the probe on the node asks its loopback.
    assert names_node("http://127.0.0.1:8080", "cyan.fleet.internal")
    assert names_node("http://[::1]:8080", "cyan.fleet.internal") and names_node("http://localhost:8080", "10.0.0.5")
    assert names_node("http://cyan.fleet.internal:8080", "cyan.fleet.internal")
    assert names_node("http://CYAN.fleet.internal.:8080", "cyan.Fleet.internal")  # case-blind, a root dot
    assert not names_node("http://peacock.fleet.internal:8080", "cyan.fleet.internal")
    assert not names_node("http://10.0.0.6:8080", "10.0.0.5")
    # A fleet on one machine (the sandbox): each node is its own loopback address, and another is another node.
    assert names_node("http://127.93.0.3:8080", "127.93.0.3")
    assert not names_node("http://127.93.0.2:8080", "127.93.0.3")
    assert not names_node("http://127.0.0.1:8080", "127.93.0.3")
    # A breaker's case: an address spelled as SSH also reads it (127.95.3 is 127.95.0.3) is still that address.
    assert names_node("http://127.95.0.3:8080", "127.95.3") and not names_node("http://127.95.0.2:8080", "127.95.3")


def test_min_serving_0_on_a_fleet_of_several_nodes_is_said_before_anything_drains():
    # A breaker's note: min_serving 0 with batch 2 drained both nodes at once without a word. The operator's
    # value is honoured (a maintenance window may want it), and said first.
    targets = fleet(min_serving=0, rollout={"canaries": 0, "batch": 2},
                    cyan=FakeNode(switch_script=[outcome(0)]), peacock=FakeNode(switch_script=[outcome(0)]))
    code, text = run(targets)
    assert code == Exit.OK, text
    assert text.splitlines()[1].startswith("note: min_serving 0 (the inventory's): no node of these 2 need take "
                                           "calls"), text
    quiet = fleet(cyan=FakeNode(switch_script=[outcome(0)]), peacock=FakeNode(switch_script=[outcome(0)]))
    assert "min_serving 0" not in run(quiet)[1]


def _record(result: str, switch: str, target: str | None = None, **fields) -> dict:
    return {"result": result, "switch": switch, "target": target, "finished_at": 1000.0 + len(switch), **fields}


def test_which_releases_failed_and_were_taken_back_by_each_kind_of_record():
    # The retry guard's reading of a node's history (node/history.py failed_releases), case by case.
    from flatshare_ops.node.history import failed_releases

    auto = [_record("released", "s1", "A", before=None, after="A", served=True),
            _record("failed", "s2", "B", before="A", step="serving-check", reason="CRITICAL", verdict=True),
            _record("rolled back", "s2", "A", before="B", after="A", served=True, auto="serving-check failed")]
    assert failed_releases(auto) == {"B": {"how": "rolled back automatically", "at": auto[2]["finished_at"],
                                           "switch": "s2", "why": "serving-check failed: CRITICAL"}}
    # a failure that says nothing about the release (a signal: verdict false), or one left failed: not listed
    assert failed_releases([auto[0], {**auto[1], "verdict": False}, auto[2]]) == {}
    assert failed_releases(auto[:2]) == {}
    # a canary analysis that failed: listed while the canary's rollback is owed (marked so), and once it was
    # rolled back from it; no longer once a later analysis of it passed (a --retry)
    analysed = [_record("released", "s3", "C", before="A", after="C", served=True),
                _record("analysed", "s3", "C", before="C", after="C", reason="TTFT worse",
                        analysis={"phase": "failed"})]
    assert failed_releases(analysed) == {"C": {"how": "its canary analysis failed", "at": analysed[1]["finished_at"],
                                               "switch": "s3", "why": "TTFT worse", "owed": True}}
    back = _record("rolled back", "s4", "A", before="C", after="A", served=True)
    assert failed_releases(analysed + [back])["C"]["how"] == "its canary analysis failed"
    assert "owed" not in failed_releases(analysed + [back])["C"]
    passed = _record("analysed", "s3", "C", before="C", after="C", analysis={"phase": "passed"})
    assert failed_releases(analysed + [passed]) == {}
    # an inconclusive analysis is no failure
    assert failed_releases([analysed[0], {**analysed[1], "analysis": {"phase": "inconclusive"}}, back]) == {}
    # served again since (a --retry that held): no longer listed
    again = _record("released", "s5", "B", before="A", after="B", served=True)
    assert failed_releases(auto + [again]) == {}


def test_the_room_of_the_nodes_that_would_carry_a_drained_nodes_calls_by_each_kind_of_load():
    # The admission's second question (control/rollout.py headroom), computed by hand for each case.
    from flatshare_ops.config.profile import Admission
    from flatshare_ops.control.rollout import headroom

    settings = Admission(seats_share=1.0)  # kv_cache_max 0.95 (the default): an idle fleet is always admitted
    idle = {"running": 0, "waiting": 0, "max_num_seqs": 4, "kv_cache_usage": 0.0}
    assert headroom("cyan", idle, {"peacock": idle}, settings)[1] is None
    full = {"running": 4, "waiting": 0, "max_num_seqs": 4, "kv_cache_usage": 0.5}
    assert headroom("cyan", idle, {"peacock": full}, settings)[1] is None  # 4 of 4 seats: it fits
    one = {"running": 1, "waiting": 0, "max_num_seqs": 4}
    lines, refusal = headroom("cyan", one, {"peacock": full}, settings)
    assert refusal == ("the nodes that would carry cyan's calls lack the room: peacock 4 running + 0 waiting of "
                       "max_num_seqs 4; cyan moves 1 running + 0 waiting: 5 requests for 4 seats "
                       "([release.admission] seats_share 1)"), refusal
    # a share of the seats: int(0.5 x 4) = 2 seats; 1 + 1 = 2 fits, 2 + 1 = 3 does not
    half = Admission(seats_share=0.5)
    assert headroom("cyan", one, {"peacock": {**one, "max_num_seqs": 4}}, half)[1] is None
    assert "3 requests for 2 seats" in headroom("cyan", one, {"peacock": {**one, "running": 2}}, half)[1]
    # the default, 2: a full batch running and one more waiting (4 + 1 = 5 of 8 seats)
    assert headroom("cyan", one, {"peacock": full}, Admission())[1] is None
    # two carriers: their seats add up (6 + 1 = 7 of 8)
    assert headroom("cyan", one, {"a": {**one, "running": 3}, "b": {**one, "running": 3}}, settings)[1] is None
    # a KV cache used above the ceiling refuses whatever the seats
    hot = headroom("cyan", idle, {"peacock": {**idle, "kv_cache_usage": 0.97}}, settings)[1]
    assert hot == "peacock's KV cache is 97% used, above [release.admission] kv_cache_max 95%: it cannot take cyan's calls"
    # a load not read is said and not judged; no max_num_seqs known: no seat count
    lines, refusal = headroom("cyan", one, {"peacock": {"error": "http://x/metrics answered 500"}}, settings)
    assert refusal is None and lines == ["peacock's engine load not read (http://x/metrics answered 500): its room "
                                         "is not judged"]
    assert headroom("cyan", one, {"peacock": {**full, "max_num_seqs": None}}, settings) == ([], None)
    # A breaker's case: two releases at once (cyan and peacock, teal left serving) were each admitted counting only
    # its own calls, and teal was left with 30 + 20 + 20 = 70 requests for 64 seats. A node being released that
    # takes calls may drain too: its calls count as moving.
    teal = {"running": 30, "waiting": 0, "max_num_seqs": 32}
    twenty = {"running": 20, "waiting": 0, "max_num_seqs": 32}
    assert headroom("cyan", twenty, {"teal": teal}, Admission())[1] is None  # 50 of 64 alone
    lines, refusal = headroom("cyan", twenty, {"teal": teal}, Admission(), {"peacock": twenty})
    assert refusal == ("the nodes that would carry cyan's calls lack the room: teal 30 running + 0 waiting of "
                       "max_num_seqs 32; cyan moves 20 running + 0 waiting; peacock, which may drain too, moves 20 "
                       "running + 0 waiting: 70 requests for 64 seats ([release.admission] seats_share 2)"), refusal
    lines, refusal = headroom("cyan", twenty, {"teal": teal}, Admission(), {"peacock": {"error": "no /metrics"}})
    assert refusal is None and "peacock, which may drain too: its load not read (no /metrics), counted as 0" in lines[0]


def test_an_interrupt_while_waiting_to_ask_again_says_the_node_was_waiting_and_quiet_still_says_why(monkeypatch):
    # Breakers' cases: Ctrl-C during a --wait pause said the node was "deciding on the node" (its refused
    # attempt's state), and -q hid the "waiting (--wait)" line, this side's own decision. The interrupt lands in
    # the pause itself (its sleep), which no real run can time for certain. (Interrupts of a real run:
    # test_fleet_safety.py's Ctrl-C in a slow preflight.)
    from flatshare_ops.control import rollout as rollout_module
    from flatshare_ops.control.rollout import OperatorInterrupted

    why = "cyan may not drain now: 0 other node(s) take calls"
    refusal = protocol.Outcome("s1", int(Exit.REFUSED), protocol.OutcomeResult.REFUSED, message=why,
                               refused_for=protocol.RefusedFor.ADMISSION)
    cyan = FakeNode(switch_script=[protocol.line(refusal).encode()], switch_status=Exit.REFUSED)
    targets = fleet(cyan=cyan, peacock=FakeNode())
    pauses = []

    def interrupted(seconds: float) -> None:
        pauses.append(seconds)
        raise OperatorInterrupted(Exit.INTERRUPTED)

    monkeypatch.setattr(rollout_module.time, "sleep", interrupted)
    code, text = run(targets, chosen=targets[:1], quiet=True, wait_s=60)
    assert code == Exit.INTERRUPTED and len(pauses) == 1 and 2 <= pauses[0] <= 8, (code, pauses, text)
    assert f"waiting (--wait): {why}; asking again in " in text, text
    assert f"cyan: waiting (--wait) to ask again when interrupted: its last attempt was refused ({why}); " \
           "nothing changed on it" in text, text
    assert "deciding" not in text and result_of("cyan").startswith("waiting (--wait)")


def test_an_interrupt_during_a_canarys_rollback_says_the_rollback_was_under_way_not_that_it_was_released():
    # A breaker's case: Ctrl-C while the canary was being rolled back after its failed analysis, and the summary
    # and --json said "released" (code 0), with no word of the rollback under way or owed.
    from flatshare_ops.control.rollout import OperatorInterrupted

    cyan = FakeNode(switch_script=[b"rollback of cyan\n", OperatorInterrupted(Exit.INTERRUPTED)], switch_status=None)
    targets = fleet(cyan=cyan, peacock=FakeNode())
    stream = io.StringIO()
    rollout = Rollout(None, targets, targets, ReleaseOutput(None, stream), mode="rollback")
    targets[0].result = Exit.OK  # released, then its analysis failed
    try:
        rollout._roll_back_canaries(targets[:1], "analysis failed")
    except OperatorInterrupted:
        pass
    else:
        raise AssertionError("the interrupt did not reach the rollout")
    result, message = rollout._result(targets[0])
    assert result == "its rollback (its analysis failed) was under way when interrupted", result
    assert message is not None and "the rollback is then owed" in message, message
    document = json.loads(json.dumps(rollout.document()))["nodes"]["cyan"]
    assert document["result"] == result and document["code"] is None, document


def test_an_interrupt_during_a_canarys_analysis_says_it_is_unjudged(monkeypatch):
    # A breaker's case: Ctrl-C during the golden answers said "cyan: released", with no word that its analysis was
    # cut short and the canary left unjudged (the next release --all does analyse it).
    from flatshare_ops.control import canary
    from flatshare_ops.control.rollout import OperatorInterrupted

    def interrupted(*_args, **_kwargs):
        raise OperatorInterrupted(Exit.INTERRUPTED)

    monkeypatch.setattr(canary, "analyse", interrupted)
    targets = fleet(cyan=FakeNode(), peacock=FakeNode())
    rollout = Rollout(None, targets, targets, ReleaseOutput(None, io.StringIO()), mode="release")
    targets[0].result = Exit.OK
    rollout.switch_ids["cyan"] = "s1"
    try:
        rollout._canary_analysis(targets[:1], [targets[1:]])
    except OperatorInterrupted:
        pass
    else:
        raise AssertionError("the interrupt did not reach the rollout")
    assert rollout.analysed["cyan"].startswith("its analysis was under way when interrupted: it is unjudged"), \
        rollout.analysed
    stream = io.StringIO()
    rollout.out = ReleaseOutput(None, stream)
    rollout._summary(interrupted=True)
    (line,) = [row for row in stream.getvalue().splitlines() if row.startswith("cyan: ")]
    assert line.endswith("(its analysis was under way when interrupted: it is unjudged, and 'flatshare release "
                         "--all' analyses it first)"), line


def test_each_nodes_wait_leaves_room_for_one_more_attempt_as_long_as_its_last():
    # A breaker's case: the wait asked again with 3 s left when an attempt takes 8 s (its preflight), and ran
    # past its bound by an attempt.
    refusal = protocol.Outcome("s1", int(Exit.REFUSED), protocol.OutcomeResult.REFUSED, message="busy",
                               refused_for=protocol.RefusedFor.BUSY)
    targets = fleet(cyan=FakeNode(), peacock=FakeNode())
    rollout = Rollout(None, targets[:1], targets, ReleaseOutput(None, io.StringIO()), mode="rollback", wait_s=60)
    rollout.outcomes["cyan"] = refusal
    import time

    now = time.monotonic()
    assert rollout._wait_again(targets[0], Exit.REFUSED, now + 60, attempt_s=1) is not None
    assert rollout._wait_again(targets[0], Exit.REFUSED, now + 10, attempt_s=8) is None  # a pause is 2 s at least
    assert rollout._wait_again(targets[0], Exit.REFUSED, None, attempt_s=0) is None  # no --wait
    rollout.outcomes["cyan"] = protocol.Outcome("s1", int(Exit.REFUSED), protocol.OutcomeResult.REFUSED,
                                                message="held")
    assert rollout._wait_again(targets[0], Exit.REFUSED, now + 600, attempt_s=0) is None  # a hold: no waiting


def test_an_interrupt_during_an_automatic_rollback_names_the_rollback_not_the_failed_switch():
    # A breaker's case: Ctrl-C while the node rolled back by itself said "switching on the node ... (step
    # restart-engine)", the failed switch's words. The node says its phase (common/protocol.py Progress).
    from flatshare_ops.control.rollout import OperatorInterrupted

    said = [protocol.Progress("s1", protocol.SwitchPhase.SWITCHING, "restart-engine"),
            protocol.Progress("s1", protocol.SwitchPhase.ROLLING_BACK, "restart-engine")]
    cyan = FakeNode(switch_script=[*(protocol.line(p).encode() for p in said), OperatorInterrupted(Exit.INTERRUPTED)],
                    switch_status=None)
    targets = fleet(cyan=cyan, peacock=FakeNode())
    code, text = run(targets, chosen=targets[:1])
    assert code == Exit.INTERRUPTED, text
    assert ("cyan: rolling back automatically on the node when interrupted (step restart-engine) (its new release "
            "did not serve) (it carries on: ") in text, text
    assert result_of("cyan").startswith("rolling back automatically"), last


@pytest.mark.parametrize("phase, drains, said", [
    # Real-fleet tests hold the first two (tests/test_node_state.py: interrupted at the go-ahead of a node with
    # nothing to do, and while the automatic rollback asks to drain); the third, an admission asked again at the
    # gateway's stop after a drain of more than ADMISSION_FRESH_S, is held here only.
    (protocol.SwitchPhase.NOTHING_TO_DO, False, "had nothing to do on the node when interrupted: it runs what was "
                                                "asked already, changes nothing"),
    (protocol.SwitchPhase.ROLLING_BACK, True, "its automatic rollback was asking for admission to drain when "
                                              "interrupted (its new release did not serve): without an answer the "
                                              "rollback does not begin: the node stays on the release that did not "
                                              "serve"),
    (protocol.SwitchPhase.SWITCHING, True, "was asking for admission to drain again mid-switch (its gateway's stop) "
                                           "when interrupted: without an answer it ends its switch early"),
    (protocol.SwitchPhase.DECIDING, True, "was asking for admission to drain: without an answer it refuses and "
                                          "changes nothing"),
])
def test_an_interrupted_runs_line_for_a_node_that_asks_says_what_its_phase_leaves(phase, drains, said):
    # A breaker's case: every ask was "refuses and changes nothing", whatever the node had done before it.
    targets = fleet(cyan=FakeNode(), peacock=FakeNode())
    rollout = Rollout(None, targets[:1], targets, ReleaseOutput(None, io.StringIO()), mode="release")
    rollout.switching.add("cyan")
    rollout.asking["cyan"] = drains
    rollout.progress["cyan"] = protocol.Progress("s1", phase, "")
    stream = io.StringIO()
    rollout.out = ReleaseOutput(None, stream)
    rollout._summary(interrupted=True)
    (line,) = [row for row in stream.getvalue().splitlines() if row.startswith("cyan: ")]
    assert line.startswith(f"cyan: {said}"), line
    assert line.count("(") == line.count(")") and "((" not in line and "None" not in line, line
