"""The long runs: tests that start several processes (trainers, sidecars, a GCS emulator, a `ckptd serve` of their
own) or whole benchmark families, several seconds each on a 2-core machine. `make test` leaves them out so that a
newcomer's run takes minutes; `make test-ci` (what CI runs) and `make test-all` run them (README, "Development").

One table, by file and test function (every parameter of a function alike): ``tests/conftest.py`` marks each test it
names ``long`` and fails the collection of a file that no longer has a function the table names, so the table cannot
silently go stale. The figures that chose them: docs/operations.md, "The test suites".
"""

from __future__ import annotations

LONG_RUNS: dict[str, frozenset[str]] = {
    "tests/bench/test_bench_cleanup.py": frozenset({
        "test_a_normal_run_of_two_families_leaves_the_shm_parent_as_it_found_it",
    }),
    "tests/bench/test_bench_device.py": frozenset({
        "test_the_device_profile_runs_at_its_toy_size",
        "test_the_device_profile_runs_at_its_toy_size_without_tcp",
    }),
    "tests/bench/test_bench_replicas.py": frozenset({
        "test_the_replica_family_writes_both_keys_side_by_side",
    }),
    "tests/bench/test_bench_smoke.py": frozenset({
        "test_bench_harness_writes_valid_results",
    }),
    "tests/server/api/test_advice_limits.py": frozenset({
        "test_resume_and_latest_good_answer_while_hostile_advice_piles_up",
        "test_sigterm_stops_serve_while_advice_is_in_flight",
    }),
    "tests/server/api/test_auth.py": frozenset({
        "test_a_token_that_cannot_work_stops_the_server",
        "test_token_never_in_logs",
    }),
    "tests/server/api/test_hostile.py": frozenset({
        "test_schemathesis_all_checks_all_phases",
    }),
    "tests/server/api/test_pending_steps.py": frozenset({
        "test_committed_steps_being_verified_answer_not_ready_not_absent",
    }),
    "tests/server/api/test_schema_rules.py": frozenset({
        "test_schemathesis_finds_no_valid_request_refused",
    }),
    "tests/server/cli/test_cli_lease.py": frozenset({
        "test_a_lease_on_the_side_of_a_read_only_job_counts_too",
        "test_a_released_or_expired_lease_does_not_stop_them",
    }),
    "tests/server/cli/test_serve_cli.py": frozenset({
        "test_listening_beyond_loopback_without_a_token_is_warned_about",
    }),
    "tests/server/cli/test_serve_uds.py": frozenset({
        "test_what_is_at_the_path_or_around_it_can_refuse_the_start",
    }),
    "tests/system/test_chaos.py": frozenset({
        "test_ckptd_sigkilled_and_restarted_during_training",
        "test_long_run_with_random_slice_failures",
        "test_storage_faults",
        "test_trainer_sigkilled_during_saves",
    }),
    "tests/system/test_crash.py": frozenset({
        "test_plain_orbax_default_mode_accepts_a_commit_file_step_cut_short",
        "test_sigkill_during_async_save_never_serves_the_partial_step",
    }),
    "tests/system/test_demo.py": frozenset({
        "test_a_slice_loss_is_restored_from_the_replicas",
        "test_one_slice_on_one_device_waits_for_it_and_goes_on_over_a_unix_socket",
    }),
    "tests/system/test_doc_snippets.py": frozenset({
        "test_the_quickstart_script_trains_through_a_slice_loss_in_one_process",
    }),
    "tests/system/test_forged_ocdbt_server.py": frozenset({
        "test_a_forged_step_and_a_slow_one_hold_up_neither_healthy_jobs_nor_probes_nor_sigterm",
    }),
    "tests/system/test_forged_records_server.py": frozenset({
        "test_a_read_only_sidecar_changes_no_byte_under_any_job",
        "test_forged_claims_and_parts_write_nothing_outside_the_root_and_stall_nothing",
    }),
    "tests/system/test_gcs_cli_errors.py": frozenset({
        "test_a_missing_bucket_is_one_line_naming_it",
    }),
    "tests/system/test_leader_lease.py": frozenset({
        "test_a_leader_stopped_cleanly_hands_the_lease_over_at_once",
        "test_one_leader_writes_and_a_follower_takes_over",
    }),
    "tests/system/test_lease_forged_sidecars.py": frozenset({
        "test_a_forged_epoch_leaves_the_job_a_leader_and_takeovers",
    }),
    "tests/system/test_load.py": frozenset({
        "test_concurrent_clients_during_deep_validation_and_gc",
    }),
    "tests/system/test_maxtext_example.py": frozenset({
        "test_the_maxtext_style_example_resumes_grain_exactly_and_maxtext_restores_its_steps",
    }),
    "tests/system/test_maxtext_layout.py": frozenset({
        "test_a_maxtext_job_is_listed_and_validated_quick_and_deep",
        "test_a_maxtext_step_is_planned_onto_6_of_8_devices_and_restored_exactly",
        "test_a_step_with_several_array_items_is_planned_and_restored_per_item",
    }),
    "tests/system/test_multihost_demo.py": frozenset({
        "test_a_host_that_lost_its_memory_gets_its_part_from_its_peer",
    }),
    "tests/system/test_multihost_trainer_kill.py": frozenset({
        "test_short_a_trainer_killed_while_the_sidecars_persist_leaves_one_whole_step_for_all",
    }),
    "tests/system/test_one_planner.py": frozenset({
        "test_the_cli_the_server_and_the_fallback_give_the_same_plan",
    }),
    "tests/system/test_peer_sidecars.py": frozenset({
        "test_a_holder_killed_mid_copy_keeps_nothing_and_gets_the_whole_copy_after_its_restart",
    }),
    "tests/system/test_peer_three_hosts.py": frozenset({
        "test_a_wiped_holder_is_sent_the_copies_it_kept_again_before_their_hosts_save_anew",
    }),
    "tests/system/test_server_integration.py": frozenset({
        "test_cli_serve",
    }),
    "tests/system/test_shutdown_drain.py": frozenset({
        "test_sigterm_persists_the_last_accepted_snapshot_before_exiting",
    }),
    "tests/system/test_soak.py": frozenset({
        "test_every_phase_recovers_and_nothing_of_a_trial_stays_alive",
    }),
    "tests/trainer/runtime/test_direct_restore.py": frozenset({
        "test_a_step_saved_by_two_processes_is_read_back_by_each",
    }),
    "tests/trainer/runtime/test_memory_tier.py": frozenset({
        "test_ckptd_persists_a_snapshot_of_a_trainer_killed_right_after_save",
    }),
    "tests/trainer/runtime/test_multihost_parts.py": frozenset({
        "test_two_sidecars_commit_each_step_once_with_a_sidecar_killed_mid_persist",
    }),
    "tests/trainer/runtime/test_multihost_resume.py": frozenset({
        "test_the_elastic_runner_of_every_process_resumes_the_agreed_step",
    }),
}
