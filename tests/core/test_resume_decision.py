"""The one resume decision (trainer_client/core/_resume_decision.py): the newest good step wins, at equal steps
the faster tier; otherwise the refusal of the newest step held, or none at all — as the rule in
docs/protocol.md ("Resume") states it, for the server and the client's fallback alike."""

from __future__ import annotations

import pytest

from trainer_client.core._errors import PlanningError
from trainer_client.core._resume_decision import MEMORY, STORAGE, Candidate, Refusal, decide
from trainer_client.core.protocol import ErrorCode, ResumeRequest

ASK = ResumeRequest(alive_devices=8)


def _good(source: str, step: int, laid: list[str] | None = None) -> Candidate[str]:
    def lay_out() -> str:
        if laid is not None:
            laid.append(f"{source}:{step}")
        return f"{source}:{step}"
    return Candidate(source, step, lay_out)


def _refused(step: int, code: ErrorCode = ErrorCode.NOT_READY) -> Candidate[str]:
    return Candidate(STORAGE, step, refused=Refusal(code, f"step {step}: {code.value}", step))


def test_the_newest_good_step_wins_and_only_it_is_laid_out() -> None:
    laid: list[str] = []
    assert decide([_good(MEMORY, 15, laid), _good(STORAGE, 10, laid)], ASK) == "memory:15"
    assert decide([_good(MEMORY, 10, laid), _good(STORAGE, 15, laid)], ASK) == "storage:15"
    assert laid == ["memory:15", "storage:15"]


@pytest.mark.parametrize("order", [(MEMORY, STORAGE), (STORAGE, MEMORY)])
def test_at_equal_steps_the_faster_tier_wins_whatever_the_order_given(order: tuple[str, str]) -> None:
    assert decide([_good(order[0], 10), _good(order[1], 10)], ASK) == "memory:10"
    asked = ASK.model_copy(update={"step": 10})
    assert decide([_good(order[0], 10), _good(order[1], 10)], asked) == "memory:10"


def test_a_step_asked_for_is_the_only_one_taken() -> None:
    asked = ASK.model_copy(update={"step": 10})
    assert decide([_good(MEMORY, 15), _good(STORAGE, 10)], asked) == "storage:10"
    assert decide([_good(MEMORY, 9), _good(STORAGE, 10)], asked) == "storage:10"
    missing = decide([_good(MEMORY, 9), _good(STORAGE, 8)], asked)
    assert missing == Refusal(ErrorCode.STEP_NOT_FOUND, step=10)


def test_a_refused_step_gives_way_to_a_good_one_of_another_tier_even_an_older_one() -> None:
    assert decide([_good(MEMORY, 10), _refused(12)], ASK) == "memory:10"
    asked = ASK.model_copy(update={"step": 10})
    assert decide([_good(MEMORY, 10), _refused(10, ErrorCode.STEP_NOT_GOOD)], asked) == "memory:10"


def test_with_nothing_good_the_newest_refusal_is_the_answer_else_no_good_checkpoint() -> None:
    why = decide([_refused(7, ErrorCode.STEP_NOT_GOOD), _refused(12)], ASK)
    assert isinstance(why, Refusal) and (why.code, why.step) == (ErrorCode.NOT_READY, 12)
    assert decide([], ASK) == Refusal(ErrorCode.NO_GOOD_CHECKPOINT)


def test_a_step_that_cannot_be_laid_out_is_refused_and_no_older_step_is_tried() -> None:
    laid: list[str] = []

    def too_few() -> str:
        raise PlanningError(ErrorCode.NOT_ENOUGH_DEVICES, "policy 'pause' needs 8 devices")

    why = decide([Candidate(MEMORY, 15, too_few), _good(STORAGE, 10, laid)], ASK)
    assert why == Refusal(ErrorCode.NOT_ENOUGH_DEVICES, "policy 'pause' needs 8 devices", 15)
    assert laid == []


def test_a_candidate_names_a_known_tier_and_is_either_laid_out_or_refused() -> None:
    with pytest.raises(ValueError, match="unknown tier"):
        Candidate("peer", 3, lambda: "x")
    with pytest.raises(ValueError, match="either"):
        Candidate(STORAGE, 3)
    with pytest.raises(ValueError, match="either"):
        Candidate(STORAGE, 3, lambda: "x", Refusal(ErrorCode.NOT_READY))


def test_then_passes_the_plan_through_and_keeps_a_refusal() -> None:
    assert decide([_good(STORAGE, 4).then(str.encode)], ASK) == b"storage:4"
    kept = _refused(4).then(str.encode)
    assert kept.refused is not None and kept.lay_out is None
