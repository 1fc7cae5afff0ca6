"""ckptd's tests, by layer: core/, server/, trainer/, system/; helpers in support/."""
