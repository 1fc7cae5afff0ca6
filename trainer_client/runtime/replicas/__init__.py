"""The replica tier: snapshots of the state in the accelerator hosts' memory, copied from an on-device copy and
paced from the measured step and copy times, restored onto the slices left after a loss."""
