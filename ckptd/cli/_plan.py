"""``ckptd plan [ROOT/]JOB --devices N``: the resume plan a trainer would get, printed from storage.

It calls the one planner the server and the client's fallback call too (``trainer_client.core._step_plan``). Its
options are the fields of ``ResumeRequest`` under names of their own (``--devices`` is ``alive_devices``), so a
value the model refuses is reported under the flag's name.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from pydantic import ValidationError

from ckptd.cli._support import EXIT_BAD, EXIT_OK, EXIT_USAGE, TARGET_HELP, add_json, add_read_only, open_job
from trainer_client.core import PlanningError, format_bytes, plan_for_step
from trainer_client.core.protocol import BatchOptions, ResumePlan, ResumeRequest, SliceAlive, StepState

# ResumeRequest's fields (and BatchOptions', under ``batch``) -> the flag that sets them
FLAGS = {"alive_devices": "--devices", "slices": "--slices", "policy": "--policy", "step": "--step",
         "device_memory_bytes": "--device-memory", "memory_headroom_bytes": "--headroom", "mode": "--batch-mode",
         "lr_scaling": "--lr-scaling", "run_id": "--run-id", "process_count": "--process-count",
         "allow_foreign_run": "--allow-foreign-run", "allow_foreign_topology": "--allow-foreign-topology"}


def flag_words(text: str) -> str:
    """``text`` with the request's field names replaced by their flags (``alive_devices`` -> ``--devices``); plain
    words (``step``, ``slices``) stay words."""
    names = sorted((n for n in FLAGS if "_" in n), key=len, reverse=True)
    return re.sub(r"\b(" + "|".join(names) + r")\b", lambda m: FLAGS[m.group(1)], text)


def _where(loc: tuple[Any, ...]) -> str:
    names = [str(x) for x in loc if not isinstance(x, int) and x != "batch"]
    return FLAGS.get(names[-1], "--" + names[-1].replace("_", "-")) if names else "request"


def _parse_slices(text: str) -> list[SliceAlive]:
    """``"0:2,1:2,3:2"`` -> slices 0, 1 and 3 with 2 devices each (an argparse type: bad text is a usage error)."""
    out = []
    for part in text.split(","):
        index, _, devices = part.strip().partition(":")
        try:  # "foo", "1" (no devices), "0:-1": a usage error, not a traceback
            out.append(SliceAlive(index=int(index), devices=int(devices)))
        except (ValueError, ValidationError):
            raise argparse.ArgumentTypeError(
                f"not INDEX:DEVICES: {part!r} (use e.g. 0:2,1:2,3:2; indices and device counts >= 0)") from None
    return out


_UNITS = {"": 1, "b": 1, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
          "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4}


def _parse_bytes(text: str) -> int:
    """``"16GiB"`` -> 17179869184; plain integers are bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 16GiB, 512MiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def run(args: argparse.Namespace) -> int:
    try:  # checked before storage is read: a bad flag needs no root
        request = ResumeRequest(
            policy=args.policy, alive_devices=args.devices, slices=args.slices, step=args.step,
            device_memory_bytes=args.device_memory, memory_headroom_bytes=args.headroom or 0,
            batch=BatchOptions(mode=args.batch_mode, lr_scaling=args.lr_scaling),
            run_id=args.run_id, process_count=args.process_count, allow_foreign_run=args.allow_foreign_run,
            allow_foreign_topology=args.allow_foreign_topology,
        )
    except ValidationError as exc:  # e.g. --devices -1: one line each, under the flag's name, no traceback
        for err in exc.errors():
            print(f"ckptd: plan: {_where(tuple(err['loc']))}: {flag_words(err['msg'])}", file=sys.stderr)
        return EXIT_USAGE
    opened = open_job(args.target, read_only=args.read_only)
    if opened is None:
        return EXIT_BAD
    cat, job = opened
    info = cat.latest_good(job) if args.step is None else cat.step(job, args.step)
    if info is None or info.state is not StepState.VERIFIED:
        print(f"ckptd: job {job!r} has no good step{'' if args.step is None else f' {args.step}'}",
              file=sys.stderr)
        return EXIT_BAD
    try:  # the one planner the server and the client's fallback call too (trainer_client/core/_step_plan.py)
        plan = plan_for_step(cat.storage, info.path, request, job=job, step=info.step)
    except PlanningError as exc:
        print(f"ckptd: {exc.code.value}: {flag_words(exc.message)}", file=sys.stderr)
        return EXIT_BAD
    print(plan.model_dump_json(indent=2) if args.json else _render_plan(plan))
    return EXIT_OK


def _render_plan(plan: ResumePlan) -> str:
    mesh = ", ".join(f"{a}={s}" for a, s in zip(plan.mesh.axis_names, plan.mesh.shape, strict=True))
    saved = ", ".join(f"{a}={s}" for a, s in zip(plan.saved_mesh.axis_names, plan.saved_mesh.shape, strict=True)
                      ) if plan.saved_mesh else "unknown"
    lines = [
        f"step           {plan.step}    ({plan.path})",
        f"mesh           ({mesh})    saved on ({saved})",
        f"devices        {plan.mesh.size} used, {plan.idle_devices} idle"
        + (f" (idle: {', '.join(f'slice {s.index}: {s.devices}' for s in plan.idle_slices)})"
           if plan.idle_slices else ""),
        *(["items          " + ", ".join(f"{item or '(the step directory)'} ({len(names)} arrays)"
                                      for item, names in plan.items.items())]
          if plan.items else []),
        f"data position  {plan.data_position}",
        f"memory         {format_bytes(plan.bytes_per_device)} per device"
        + ("" if plan.fits_memory is None else " (fits)" if plan.fits_memory else " (does NOT fit)"),
    ]
    if plan.batch is not None:
        b = plan.batch
        lines.append(
            f"batch          {b.mode}: global {b.global_batch} = {b.accumulation_steps} x {b.micro_batch} "
            f"({b.per_device_batch} per device on {b.data_parallel_size}), lr x {b.lr_scale:.4g}"
            + ("" if b.exact else "  (inexact)")
        )
    lines.append(f"{'ARRAY':<40} {'SHAPE':<18} {'DTYPE':<10} PARTITION SPEC")
    for name, spec in plan.arrays.items():
        lines.append(f"{name:<40} {spec.shape!s:<18} {spec.dtype or '?':<10} {spec.partition_spec}"
                     + ("  (changed)" if spec.changed else ""))
    lines.extend(f"note: {note}" for note in plan.notes)
    return "\n".join(lines)


def add_parser(sub: Any) -> None:
    """``ckptd plan`` on the CLI's subcommand parsers."""
    plan = sub.add_parser(
        "plan", help="print the resume plan for the devices given",
        description="Print the plan a trainer of the job would get now if it resumed on the devices given: the step "
        "and where it comes from, the mesh, the data position, the batch (microbatches and learning-rate scale) and "
        "each array's layout. Read from storage, with the same planner as the server. Exit 0 when there is a plan.")
    plan.add_argument("target", metavar="[ROOT/]JOB", help=TARGET_HELP)
    plan.add_argument("--devices", type=int, required=True, metavar="N", help="devices alive (required)")
    plan.add_argument("--slices", type=_parse_slices, help="alive slices as INDEX:DEVICES,... e.g. 0:2,1:2,3:2")
    plan.add_argument("--policy", choices=["pause", "resize"], default="resize",
                      help="pause: the saved mesh (refused with fewer devices); resize: the largest mesh the "
                      "devices allow (default)")
    plan.add_argument("--step", type=int, help="plan for this step (default: the newest good step)")
    plan.add_argument("--device-memory", type=_parse_bytes, help="memory of one device, e.g. 16GiB")
    plan.add_argument("--headroom", type=_parse_bytes, help="per-device memory to keep free, e.g. 2GiB")
    plan.add_argument("--batch-mode", choices=["keep_global_batch", "scale_batch"], default="keep_global_batch",
                      help="keep the job's global batch by microbatches (default), or keep the per-device batch")
    plan.add_argument("--lr-scaling", choices=["none", "linear", "sqrt"], default="linear",
                      help="how the learning rate follows a changed global batch (default linear)")
    plan.add_argument("--run-id", help="plan as this run asks (docs/protocol.md, Identity): another run's step is "
                      "refused unless --allow-foreign-run")
    plan.add_argument("--process-count", type=int, help="plan for this many JAX processes (another count's step is "
                      "refused unless --allow-foreign-topology)")
    plan.add_argument("--allow-foreign-run", action="store_true", help="accept a step another run saved")
    plan.add_argument("--allow-foreign-topology", action="store_true",
                      help="accept a step saved by another number of JAX processes")
    add_json(plan)
    add_read_only(plan)
    plan.set_defaults(func=run)


__all__ = ["FLAGS", "add_parser", "flag_words", "run"]
