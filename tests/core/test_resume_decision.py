"""The one resume decision (trainer_client/core/_resume_decision.py): the newest good step wins, at equal steps
the faster tier; otherwise the refusal of the newest step held, or none at all — as the rule in
docs/protocol.md ("Resume") states it, for the server and the client's fallback alike."""

from __future__ import annotations

import pytest

from trainer_client.core._errors import PlanningError
from trainer_client.core._resume_candidates import as_is, whole_replica, with_replicas
from trainer_client.core._resume_decision import (
    MEMORY,
    REPLICAS,
    STORAGE,
    TIERS_FASTEST_FIRST,
    Candidate,
    Refusal,
    decide,
)
from trainer_client.core.protocol import (
    ArraySpec,
    ErrorCode,
    MeshSpec,
    ReplicasHeld,
    ResumePlan,
    ResumeRequest,
    SliceAlive,
    TrainingMetadata,
)

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


# ---- the replica snapshot tier, told by the request (docs/protocol.md, "Resume") -------------------------

MESH = MeshSpec(axis_names=["replica", "data"], shape=[4, 2])
# 8 devices on 4 slices of 2; the trainer holds step 20 as two replicas: one on slices 0 and 1, one on 2 and 3.
HELD = ReplicasHeld(step=20, slices=[[0, 1], [2, 3]])


def _asked(alive: list[int], replicas: ReplicasHeld | None = HELD, step: int | None = None) -> ResumeRequest:
    return ResumeRequest(alive_devices=2 * len(alive), slices=[SliceAlive(index=i, devices=2) for i in alive],
                         replicas=replicas, step=step)


def _plan(source: str, step: int) -> Candidate[ResumePlan]:
    return Candidate(source, step, lambda: ResumePlan(
        job="llm", step=step, path=f"/{source}/{step}", policy="resize", mesh=MESH, saved_mesh=MESH,
        data_position=step * 32, tier="memory" if source == MEMORY else "storage", notes=["laid out"]))


def _decided(candidates: list[Candidate[ResumePlan]], request: ResumeRequest) -> ResumePlan | Refusal:
    return decide(with_replicas(candidates, request, load=as_is, dump=as_is, job="job"), request)


def test_replicas_are_the_fastest_tier() -> None:
    assert TIERS_FASTEST_FIRST == (REPLICAS, MEMORY, STORAGE)


@pytest.mark.parametrize(("memory", "storage", "tier", "step"), [
    (15, 10, "replicas", 20),  # replicas newer than both
    (20, 10, "replicas", 20),  # equal to memory: the faster tier
    (10, 20, "replicas", 20),  # equal to storage
    (25, 10, "memory", 25),  # older than memory
    (10, 30, "storage", 30),  # older than storage
])
def test_the_newest_step_whole_in_some_tier_wins_equal_steps_the_fastest(
        memory: int, storage: int, tier: str, step: int) -> None:
    plan = _decided([_plan(MEMORY, memory), _plan(STORAGE, storage)], _asked([0, 1, 2]))
    assert isinstance(plan, ResumePlan) and (plan.tier, plan.step) == (tier, step)
    if tier == "replicas":  # laid out as the newest good step of another tier, named for the replicas' step
        assert plan.path == "" and plan.data_position is None and plan.mesh == MESH
        assert plan.notes[0] == "laid out" and "slices [0, 1]" in plan.notes[-1]
    else:
        assert plan.path == f"/{tier}/{step}"


@pytest.mark.parametrize("alive", [[0, 2], [1, 3], [0], []])
def test_no_replica_whole_on_the_alive_slices_falls_to_memory_or_storage(alive: list[int]) -> None:
    request = _asked(alive)
    assert whole_replica(request) is None
    plan = _decided([_plan(MEMORY, 15), _plan(STORAGE, 10)], request)
    assert isinstance(plan, ResumePlan) and (plan.tier, plan.step) == ("memory", 15)
    plan = _decided([_plan(STORAGE, 10)], request)
    assert isinstance(plan, ResumePlan) and (plan.tier, plan.step) == ("storage", 10)


def test_which_replica_is_whole_is_read_from_the_slices_the_request_lists_with_devices() -> None:
    assert whole_replica(_asked([2, 3])) == [2, 3]
    assert whole_replica(_asked([0, 1, 2, 3])) == [0, 1]
    assert whole_replica(_asked([0, 1], ReplicasHeld(step=20, slices=[[1, 1, 0]]))) == [0, 1]
    emptied = ResumeRequest(alive_devices=2, slices=[SliceAlive(index=0, devices=2), SliceAlive(index=1, devices=0)],
                            replicas=HELD)
    assert whole_replica(emptied) is None  # slice 1 is listed without devices: not alive
    assert whole_replica(_asked([0, 1], replicas=None)) is None  # no replica tier: old clients unchanged
    # no slices, or slices that do not hold alive_devices: which survived is unknown, no replica is whole
    assert whole_replica(ResumeRequest(alive_devices=8, replicas=HELD)) is None
    assert whole_replica(_asked([0, 1]).model_copy(update={"alive_devices": 3})) is None


def test_replicas_with_no_other_good_step_to_take_the_layout_from_are_no_candidate() -> None:
    request = _asked([0, 1])
    assert _decided([], request) == Refusal(ErrorCode.NO_GOOD_CHECKPOINT)
    pending: Candidate[ResumePlan] = Candidate(STORAGE, 10, refused=Refusal(ErrorCode.NOT_READY, step=10))
    assert [c.source for c in with_replicas([pending], request, load=as_is, dump=as_is, job="job")] == [STORAGE]


def test_a_step_asked_for_takes_the_replicas_only_at_that_step() -> None:
    plan = _decided([_plan(STORAGE, 20)], _asked([0, 1], step=20))
    assert isinstance(plan, ResumePlan) and (plan.tier, plan.step) == ("replicas", 20)
    plan = _decided([_plan(STORAGE, 10)], _asked([0, 1], step=10))
    assert isinstance(plan, ResumePlan) and (plan.tier, plan.step) == ("storage", 10)


def test_the_replica_plan_is_refused_as_its_layout_is() -> None:
    def too_few() -> ResumePlan:
        raise PlanningError(ErrorCode.NOT_ENOUGH_DEVICES, "policy 'pause' needs 8 devices")

    why = _decided([Candidate(STORAGE, 10, too_few)], _asked([0, 1]))
    assert why == Refusal(ErrorCode.NOT_ENOUGH_DEVICES, "policy 'pause' needs 8 devices", 20)


def test_replicas_that_carry_their_training_metadata_are_laid_out_from_it_alone() -> None:
    """No other tier holds a good step (a failure before the first checkpoint), or it was saved on another mesh:
    the replicas' own metadata lays them out, with their data position and batch."""
    arrays = {"w": ArraySpec(shape=[8, 4], dtype="float32", partition_spec=[None, "data"])}
    own = TrainingMetadata(step=20, data_position=20 * 48, global_batch=48, mesh=MESH, wall_time=1.0, arrays=arrays)
    held = HELD.model_copy(update={"training": own})
    for candidates in ([], [_plan(STORAGE, 10)]):
        plan = _decided(candidates, _asked([0, 1, 3], held))
        assert isinstance(plan, ResumePlan) and (plan.tier, plan.step, plan.path) == ("replicas", 20, "")
        assert plan.data_position == 960 and plan.saved_mesh == MESH and plan.mesh.shape == [3, 2]
        assert plan.batch is not None and plan.batch.global_batch == 48 and "w" in plan.arrays
        assert "slices [0, 1]" in plan.notes[-1]
    # a newer good step elsewhere still wins; with no whole replica the metadata changes nothing
    newer = _decided([_plan(STORAGE, 30)], _asked([0, 1, 3], held))
    assert isinstance(newer, ResumePlan) and newer.tier == "storage"
    assert _decided([], _asked([0, 2], held)) == Refusal(ErrorCode.NO_GOOD_CHECKPOINT)
