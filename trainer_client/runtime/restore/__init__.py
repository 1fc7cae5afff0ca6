"""Restoring: the one restore loop (a plan, then the next plan without a tier that failed), the direct reader of
Orbax's layout, and the host memory a restore may use."""
