"""Drop-in faces for code written against Orbax: a ``CheckpointManager`` that saves through ckptd's tiers, its
retention, and the MaxText integration."""
