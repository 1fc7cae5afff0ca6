"""The pure resume planner: resizing the data-parallel axis, divisibility, and refusals."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainer_client.planning import PlanningError, choose_mesh, fit_array, plan_mesh, resume_plan
from trainer_client.protocol import ArraySpec, ErrorCode, MeshSpec, ResumeRequest, SliceAlive, TrainingMetadata

SAVED = MeshSpec(axis_names=["replica", "data"], shape=[4, 2])


@pytest.mark.parametrize(
    ("alive", "shape", "idle"),
    [(8, [4, 2], 0), (6, [3, 2], 0), (7, [3, 2], 1), (4, [2, 2], 0), (2, [1, 2], 0), (16, [8, 2], 0)],
)
def test_resize_shrinks_and_grows_the_replica_axis(alive: int, shape: list[int], idle: int) -> None:
    plan = plan_mesh(SAVED, {}, alive, "resize")
    assert plan.mesh.shape == shape and plan.mesh.axis_names == ["replica", "data"]
    assert plan.idle_devices == idle


def test_model_axes_are_kept_and_too_few_devices_is_no_valid_mesh() -> None:
    saved = MeshSpec(axis_names=["data", "model"], shape=[2, 4])
    assert choose_mesh(saved, 5, "resize")[0].shape == [1, 4]
    with pytest.raises(PlanningError) as err:
        choose_mesh(saved, 3, "resize")
    assert err.value.code is ErrorCode.NO_VALID_MESH and "model" in err.value.message


def test_pause_never_shrinks() -> None:
    with pytest.raises(PlanningError) as err:
        choose_mesh(SAVED, 6, "pause")
    assert err.value.code is ErrorCode.NOT_ENOUGH_DEVICES
    assert choose_mesh(SAVED, 8, "pause")[0].shape == [4, 2]


def test_an_array_that_no_longer_divides_is_replicated_on_that_axis() -> None:
    mesh = MeshSpec(axis_names=["replica", "data"], shape=[3, 2])
    spec = ArraySpec(shape=[8, 6], dtype="float32", partition_spec=["replica", "data"])
    fitted, why = fit_array("params.w", spec, mesh)
    assert fitted.partition_spec == [None, "data"] and fitted.changed
    assert why is not None and "replica=3" in why
    same, none = fit_array("params.b", ArraySpec(shape=[6], partition_spec=["replica"]), mesh)
    assert same.partition_spec == ["replica"] and not same.changed and none is None


def test_resume_plan_uses_training_metadata_and_checks_slices() -> None:
    training = TrainingMetadata(step=30, data_position=1440, global_batch=48, mesh=SAVED, slices=[0, 1, 2, 3],
                                wall_time=0.0, arrays={"w": ArraySpec(shape=[8], partition_spec=["replica"])})
    request = ResumeRequest(policy="resize", alive_devices=6,
                            slices=[SliceAlive(index=i, devices=2) for i in (0, 1, 3)])
    plan = resume_plan(job="j", step=30, path="/r/j/30", request=request, training=training,
                       saved_sharding=(None, {}))
    assert (plan.step, plan.data_position, plan.global_batch, plan.mesh.shape) == (30, 1440, 48, [3, 2])
    assert plan.arrays["w"].changed and plan.arrays["w"].partition_spec == [None]
    bad = request.model_copy(update={"alive_devices": 8})
    with pytest.raises(PlanningError) as err:
        resume_plan(job="j", step=30, path="/r/j/30", request=bad, training=training, saved_sharding=(None, {}))
    assert err.value.code is ErrorCode.INVALID_REQUEST


@given(
    replica=st.integers(1, 8), data=st.integers(1, 8), model=st.integers(1, 4), alive=st.integers(0, 80),
    dims=st.lists(st.integers(1, 64), min_size=1, max_size=3),
)
def test_every_plan_is_valid(replica: int, data: int, model: int, alive: int, dims: list[int]) -> None:
    saved = MeshSpec(axis_names=["replica", "data", "model"], shape=[replica, data, model])
    spec = ArraySpec(shape=dims, partition_spec=[["replica", "data"], "model", None][: len(dims)])
    try:
        plan = plan_mesh(saved, {"a": spec}, alive, "resize")
    except PlanningError as exc:
        # refused only when the model axis cannot be kept on the devices alive
        assert exc.code in (ErrorCode.NO_VALID_MESH, ErrorCode.NOT_ENOUGH_DEVICES)
        assert alive < model
        return
    sizes = dict(zip(plan.mesh.axis_names, plan.mesh.shape, strict=True))
    assert plan.mesh.size <= alive and plan.idle_devices == alive - plan.mesh.size
    assert sizes["model"] == model
    if alive >= model:
        assert plan.mesh.size * 2 > alive or plan.mesh.size == replica * data * model or alive < 2 * model
    for extent, entry in zip(dims, plan.arrays["a"].partition_spec, strict=False):
        axes = [] if entry is None else [entry] if isinstance(entry, str) else entry
        divisor = 1
        for a in axes:
            divisor *= sizes[a]
        assert extent % divisor == 0
