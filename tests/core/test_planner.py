"""The pure resume planner: meshes, divisibility, memory, slices, refusals — and properties checked
against a brute-force oracle over every mesh in the planner's search space."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer_client.core._dtypes import dtype_bytes
from trainer_client.core._planner import DATA_PARALLEL_AXES, array_bytes_per_device, fit_array, plan_mesh
from trainer_client.core._resume_decision import assign_slices, resume_plan
from trainer_client.core.protocol import (
    ArraySpec,
    BatchOptions,
    ErrorCode,
    MeshSpec,
    ResumeRequest,
    SliceAlive,
    TrainingMetadata,
)
from trainer_client.errors import PlanningError

SAVED = MeshSpec(axis_names=["replica", "data"], shape=[4, 2])


@pytest.mark.parametrize(
    ("alive", "shape", "idle"),
    [(8, [4, 2], 0), (6, [3, 2], 0), (7, [3, 2], 1), (4, [2, 2], 0), (2, [1, 2], 0), (1, [1, 1], 0),
     (16, [8, 2], 0)],
)
def test_resize_changes_the_replica_axis_first(alive: int, shape: list[int], idle: int) -> None:
    plan = plan_mesh(SAVED, {}, alive, "resize")
    assert plan.mesh.shape == shape and plan.mesh.axis_names == ["replica", "data"]
    assert plan.idle_devices == idle


def test_many_axes_keep_model_parallel_axes() -> None:
    saved = MeshSpec(axis_names=["replica", "fsdp", "expert", "tensor"], shape=[2, 4, 2, 2])
    for alive, shape in [(32, [2, 4, 2, 2]), (16, [1, 4, 2, 2]), (24, [1, 4, 2, 2]), (8, [1, 2, 2, 2]),
                         (4, [1, 1, 2, 2])]:
        mesh = plan_mesh(saved, {}, alive, "resize").mesh
        assert mesh.shape == shape, (alive, mesh.shape)
    with pytest.raises(PlanningError) as err:
        plan_mesh(saved, {}, 3, "resize")
    assert err.value.code is ErrorCode.NO_VALID_MESH
    assert "expert=2" in err.value.message and "tensor=2" in err.value.message


def test_pause_never_shrinks() -> None:
    with pytest.raises(PlanningError) as err:
        plan_mesh(SAVED, {}, 6, "pause")
    assert err.value.code is ErrorCode.NOT_ENOUGH_DEVICES and "resize" in err.value.message
    assert plan_mesh(SAVED, {}, 8, "pause").mesh.shape == [4, 2]


def test_an_array_that_no_longer_divides_stops_being_sharded_on_that_axis() -> None:
    mesh = MeshSpec(axis_names=["replica", "data"], shape=[3, 2])
    spec = ArraySpec(shape=[8, 6], dtype="float32", partition_spec=["replica", "data"])
    fitted, why = fit_array("params.w", spec, mesh)
    assert fitted.partition_spec == [None, "data"] and fitted.changed
    assert why is not None and "replica=3" in why and "params.w" in why
    same, none = fit_array("params.b", ArraySpec(shape=[6], partition_spec=["replica"]), mesh)
    assert same.partition_spec == ["replica"] and not same.changed and none is None
    multi, _ = fit_array("x", ArraySpec(shape=[4, 2], partition_spec=[["replica", "data"], None]),
                         MeshSpec(axis_names=["replica", "data"], shape=[2, 2]))
    assert multi.partition_spec == [["replica", "data"], None] and not multi.changed


def test_memory_per_device_and_does_not_fit() -> None:
    saved = MeshSpec(axis_names=["replica", "fsdp"], shape=[2, 4])
    arrays = {"w": ArraySpec(shape=[1024, 1024], dtype="bfloat16", partition_spec=["fsdp", None])}
    assert array_bytes_per_device(arrays["w"], saved) == 1024 * 1024 * 2 // 4
    plan = plan_mesh(saved, arrays, 8, "resize", device_memory_bytes=600_000)
    assert plan.bytes_per_device == 524_288 and plan.fits_memory is True
    # 4 alive: replica-only resize keeps fsdp=4 (512 KiB per device) -> still fits
    assert plan_mesh(saved, arrays, 4, "resize", device_memory_bytes=600_000).mesh.shape == [1, 4]
    # 2 alive: fsdp must shrink to 2 -> 1 MiB per device -> does not fit, and says by how much
    with pytest.raises(PlanningError) as err:
        plan_mesh(saved, arrays, 2, "resize", device_memory_bytes=600_000)
    assert err.value.code is ErrorCode.DOES_NOT_FIT and "1.00 MiB per device" in err.value.message
    # headroom counts: (2, 4) no longer fits, so fsdp takes all 8 devices
    tight = plan_mesh(saved, arrays, 8, "resize", device_memory_bytes=600_000, headroom_bytes=100_000)
    assert tight.mesh.shape == [1, 8] and tight.bytes_per_device == 262_144


def test_memory_pushes_the_planner_off_the_preferred_layout_when_it_must() -> None:
    saved = MeshSpec(axis_names=["replica", "fsdp"], shape=[2, 2])
    arrays = {"w": ArraySpec(shape=[64, 64], dtype="float32", partition_spec=["fsdp", None])}
    # 4 devices alive, but the state only fits when fsdp grows to 4
    plan = plan_mesh(saved, arrays, 4, "resize", device_memory_bytes=64 * 64 * 4 // 4)
    assert plan.mesh.shape == [1, 4]


def test_dtype_bytes() -> None:
    assert [dtype_bytes(d) for d in ("float32", "bfloat16", "int8", "float64", "complex64", "float8_e4m3fn",
                                     "bool", None)] == [4, 2, 1, 8, 8, 1, 1, 4]


def test_slices_pick_whole_slices_and_name_the_idle_devices() -> None:
    slices = [SliceAlive(index=0, devices=2), SliceAlive(index=1, devices=1), SliceAlive(index=3, devices=2),
              SliceAlive(index=2, devices=2)]
    used, idle = assign_slices(slices, 6)
    assert used == [0, 2, 3] and idle == [SliceAlive(index=1, devices=1)]


def _training(**kw: object) -> TrainingMetadata:
    base: dict[str, object] = dict(step=30, data_position=1440, global_batch=48, mesh=SAVED, slices=[0, 1, 2, 3],
                                   wall_time=0.0, arrays={"w": ArraySpec(shape=[8], partition_spec=["replica"])})
    base.update(kw)
    return TrainingMetadata.model_validate(base)


def test_resume_plan_states_mesh_batch_data_position_and_idle_slices() -> None:
    request = ResumeRequest(policy="resize", alive_devices=7,
                            slices=[SliceAlive(index=i, devices=d) for i, d in ((0, 2), (1, 2), (2, 1), (3, 2))])
    plan = resume_plan(job="j", step=30, path="/r/j/30", request=request, training=_training(),
                       saved_layout=(None, {}))
    assert (plan.step, plan.data_position, plan.mesh.shape, plan.idle_devices) == (30, 1440, [3, 2], 1)
    assert plan.slices_used == [0, 1, 3] and plan.idle_slices == [SliceAlive(index=2, devices=1)]
    assert plan.arrays["w"].changed and plan.arrays["w"].partition_spec == [None]
    assert plan.batch is not None
    assert (plan.batch.global_batch, plan.batch.accumulation_steps, plan.batch.per_device_batch) == (48, 2, 4)
    assert plan.batch.exact and plan.global_batch == 48
    scaled = resume_plan(job="j", step=30, path="/r/j/30", training=_training(), saved_layout=(None, {}),
                         request=request.model_copy(update={"batch": BatchOptions(mode="scale_batch",
                                                                                  lr_scaling="sqrt")}))
    assert scaled.batch is not None and scaled.batch.global_batch == 36
    assert scaled.batch.lr_scale == pytest.approx(math.sqrt(36 / 48))


def test_resume_plan_gives_inconsistent_slices_a_meaning() -> None:
    """Slices that do not hold alive_devices: planned for alive_devices, naming no slice; a slice listed twice:
    its entries added up (both were INVALID_REQUEST, which a schema cannot state: docs/protocol.md, Resume)."""
    good = ResumeRequest(policy="resize", alive_devices=8, slices=[SliceAlive(index=i, devices=2) for i in range(4)])
    plan = resume_plan(job="j", step=30, path="/p", request=good, training=_training(), saved_layout=(None, {}))
    bad = ResumeRequest(policy="resize", alive_devices=8, slices=[SliceAlive(index=0, devices=2)])
    odd = resume_plan(job="j", step=30, path="/p", request=bad, training=_training(), saved_layout=(None, {}))
    assert odd.mesh == plan.mesh and odd.arrays == plan.arrays and odd.slices_used == [] and odd.idle_slices == []
    assert odd.notes[0] == ("alive_devices=8 but the slices listed hold 2 devices: planned for alive_devices, "
                            "naming no slice")
    dup = ResumeRequest(policy="resize", alive_devices=4,
                        slices=[SliceAlive(index=0, devices=2), SliceAlive(index=0, devices=2)])
    merged = resume_plan(job="j", step=30, path="/p", request=dup, training=_training(), saved_layout=(None, {}))
    assert merged.slices_used == [0]
    assert merged.notes[0] == "a slice is listed more than once: its entries were added up"


# ---- properties against a brute-force oracle ---------------------------------------------------------

AXES = ["replica", "data", "fsdp", "tensor"]


def _oracle_has_plan(saved: MeshSpec, arrays: dict[str, ArraySpec], alive: int, memory: int | None) -> bool:
    """Is there any mesh (model axes kept, data-parallel axes any size) the state fits on?"""
    dp = [i for i, a in enumerate(saved.axis_names) if a in DATA_PARALLEL_AXES]
    for sizes in itertools.product(*[range(1, alive + 1)] * len(dp)):
        shape = list(saved.shape)
        for i, s in zip(dp, sizes, strict=True):
            shape[i] = s
        if math.prod(shape) > alive:
            continue
        mesh = MeshSpec(axis_names=saved.axis_names, shape=shape)
        need = sum(array_bytes_per_device(fit_array(n, a, mesh)[0], mesh) for n, a in arrays.items())
        if memory is None or need <= memory:
            return True
    return False


@st.composite
def _cases(draw: st.DrawFn) -> tuple[MeshSpec, dict[str, ArraySpec], int, int | None]:
    names = draw(st.lists(st.sampled_from(AXES), min_size=1, max_size=3, unique=True))
    shape = [draw(st.integers(1, 4)) for _ in names]
    saved = MeshSpec(axis_names=names, shape=shape)
    arrays = {}
    for k in range(draw(st.integers(0, 3))):
        dims = draw(st.lists(st.integers(1, 24), min_size=0, max_size=3))
        spec = [draw(st.sampled_from([None, *names])) for _ in dims]
        if len({a for a in spec if a}) != len([a for a in spec if a]):
            spec = [None] * len(dims)
        arrays[f"a{k}"] = ArraySpec(shape=dims, dtype=draw(st.sampled_from(["float32", "bfloat16"])),
                                    partition_spec=spec)
    alive = draw(st.integers(0, 20))
    memory = draw(st.one_of(st.none(), st.integers(1, 4096)))
    return saved, arrays, alive, memory


@settings(max_examples=300, deadline=None)
@given(_cases())
def test_every_plan_is_valid_and_no_plan_only_when_none_exists(
    case: tuple[MeshSpec, dict[str, ArraySpec], int, int | None],
) -> None:
    saved, arrays, alive, memory = case
    try:
        plan = plan_mesh(saved, arrays, alive, "resize", device_memory_bytes=memory)
    except PlanningError as exc:
        assert exc.code in (ErrorCode.NO_VALID_MESH, ErrorCode.NOT_ENOUGH_DEVICES, ErrorCode.DOES_NOT_FIT)
        assert exc.message
        assert alive == 0 or not _oracle_has_plan(saved, arrays, alive, memory)
        return
    sizes = dict(zip(plan.mesh.axis_names, plan.mesh.shape, strict=True))
    assert 1 <= plan.mesh.size <= alive and plan.idle_devices == alive - plan.mesh.size
    for axis, size in zip(saved.axis_names, saved.shape, strict=True):
        if axis not in DATA_PARALLEL_AXES:
            assert sizes[axis] == size, "a model-parallel axis changed"
    for name, spec in plan.arrays.items():
        assert spec.shape is not None
        for dim, entry in enumerate(spec.partition_spec):
            axes = [] if entry is None else [entry] if isinstance(entry, str) else entry
            assert spec.shape[dim] % math.prod(sizes[a] for a in axes) == 0, (name, spec)
        assert spec.changed == (spec.partition_spec != arrays[name].partition_spec)
    if memory is not None and arrays:
        assert plan.bytes_per_device is not None and plan.bytes_per_device <= memory


def test_a_huge_device_count_tries_a_bounded_set_of_meshes_and_still_finds_the_best() -> None:
    # 300,000 devices over (replica=4, data=2) once meant 150,000 candidate meshes (33 s per resume answer,
    # a worker thread held that long); the sizes that divide real arrays (5-smooth multiples) are still tried
    from trainer_client.core._planner import candidate_meshes

    saved = MeshSpec(axis_names=["replica", "data"], shape=[4, 2])
    arrays = {f"a{i}": ArraySpec(shape=[4096, 4096], dtype="float32", partition_spec=["data", None]) for i in range(8)}
    assert sum(1 for _ in candidate_meshes(saved, 300_000)) < 2_000
    with pytest.raises(PlanningError, match=r"128.00 KiB per device at best \(mesh \(replica=73, data=4096\)\)"):
        plan_mesh(saved, arrays, 300_000, "resize", device_memory_bytes=1)
    fits = plan_mesh(saved, arrays, 300_000, "resize", device_memory_bytes=200 << 10)
    assert fits.mesh.shape == [73, 4096] and fits.fits_memory
