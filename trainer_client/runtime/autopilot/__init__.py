"""The autopilot in a run: each tier's costs measured as it saves and restores, and the periods re-chosen at step
boundaries by the period model of ``trainer_client.core.planning``."""
