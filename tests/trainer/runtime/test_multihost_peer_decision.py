"""The resume decision with peer copies (docs/multihost.md, "Peer copies"): the newest step every host can get
from its own memory or from a peer's copy of its part, else storage; and which peer each host fetches from.
Also: the copies a host offers are those its sidecar checked in, of the job's process count."""

from __future__ import annotations

from pathlib import Path

from tests.support.peer_parts import write_part
from trainer_client.core import _resume_decision as decision
from trainer_client.core.format._peer_copies import copies_dir
from trainer_client.core.protocol import ErrorCode, ResumeRequest
from trainer_client.runtime.multihost._multihost import candidates, copy_parts, decide, peer_sources


def test_a_wiped_host_takes_its_part_from_the_peer_holding_a_copy() -> None:
    offers = [[[50, "a"], [40, "b"]], []]  # host 1 wiped
    copies = [[[1, 50, "a"], [1, 40, "b"]], []]  # host 0 holds copies of host 1's parts
    assert decide(offers, 30, copies) == ("memory", 50, "a")
    assert peer_sources(offers, copies, 50, "a") == {1: 0}
    assert decide(offers, 30) == ("storage", 30, None)  # without the copies: storage, as before


def test_a_host_and_its_peer_both_wiped_send_the_job_to_storage() -> None:
    assert decide([[], []], 30, [[], []]) == ("storage", 30, None)
    # three hosts: host 1 wiped, its copy was on host 2, wiped too; host 0 holds host 2's copy only
    offers, copies = [[[50, "a"]], [], []], [[[2, 50, "a"]], [], []]
    assert decide(offers, 30, copies) == ("storage", 30, None)


def test_the_newest_step_reachable_by_every_host_wins_and_a_copy_of_another_save_does_not_count() -> None:
    offers = [[[50, "a"], [40, "b"]], [[40, "b"]]]
    copies = [[[1, 50, "other save"]], [[0, 50, "a"]]]
    assert decide(offers, 30, copies) == ("memory", 40, "b")
    assert peer_sources(offers, copies, 40, "b") == {}  # both hold 40 themselves: nobody fetches
    assert decide(offers, 60, [[[1, 50, "a"]], []]) == ("storage", 60, None)  # storage is newer
    # a host never counts as its own peer, and the lowest holder is asked
    assert decide([[], [[50, "a"]], [[50, "a"]]], None, [[[0, 50, "a"]], [[0, 50, "a"]], [[0, 50, "a"]]]) == (
        "memory", 50, "a")
    assert peer_sources([[], [[50, "a"]], [[50, "a"]]], [[[0, 50, "a"]], [[0, 50, "a"]], []], 50, "a") == {0: 1}


def test_the_copies_offered_are_intact_parts_of_the_job_s_process_count(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    write_part(shm, "job", 50, index=0)
    held = copies_dir(shm, "job", 1)
    held.mkdir(mode=0o700)
    write_part(tmp_path / "other", "job", 50, index=1).rename(held / "50")
    write_part(tmp_path / "other", "job", 40, index=1).rename(held / "40")
    (held / "40" / "data.bin").write_bytes(b"short")  # damaged: its size no longer matches
    write_part(tmp_path / "three", "job", 60, index=1, count=4).rename(held / "60")  # another process count
    assert [(p.meta.process_index, p.step) for p in copy_parts(str(shm), "job", 2)] == [(1, 50)]
    assert copy_parts(str(shm), "job", 2, at_most=45) == []


def test_the_agreement_hands_its_candidates_to_the_one_resume_decision() -> None:
    """Every step all hosts can get from memory and the storage step are candidates of the core decision ckptd and
    the client's fallback make (``trainer_client/core/_resume_decision.py``): its tie rule, its step asked for."""
    offers = [[[20, "a"], [10, "b"]], [[20, "a"], [10, "b"], [5, "c"]]]
    held = candidates(offers, 20)
    assert [(c.source, c.step) for c in held] == [("memory", 20), ("memory", 10), ("storage", 20)]
    assert decide(offers, 20) == decision.decide(held) == ("memory", 20, "a")  # a tie: the faster tier
    assert decide(offers, 20, request=ResumeRequest(alive_devices=8, step=10)) == ("memory", 10, "b")
    assert decide(offers, 15, request=ResumeRequest(alive_devices=8, step=15)) == ("storage", 15, None)
    why = decide(offers, None, request=ResumeRequest(alive_devices=8, step=12))  # nowhere: refused as ckptd would
    assert isinstance(why, decision.Refusal) and (why.code, why.step) == (ErrorCode.STEP_NOT_FOUND, 12)
    assert decide([[], []], None, request=ResumeRequest(alive_devices=8)) == ("none", None, None)  # a fresh start
