"""Saving: the router that sends each save to its tier, the Orbax writer's training metadata, the data iterator's
state saved with a step, and a bad step moved aside."""
