"""The elastic runner: one attempt after another in the same process. A slice loss becomes an exception the
runner catches; it asks where to resume, restores onto the devices left (or waits for the slice) and trains on.
Here: the runner, its options, the attempt's context (the step boundary), recovery records and the classification
of a JAX error as a slice loss or not."""
