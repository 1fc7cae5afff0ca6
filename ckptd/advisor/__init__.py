"""The goodput advisor: checkpoint periods and recovery policy from a failure model, a simulator of a
job's timeline, failure sources, the job's history and its measured goodput."""
