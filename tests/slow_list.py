"""Tests that `make test-fast` leaves to `make test`: each named with why, and its seconds in a full run of
the suite on 2 cores (2026-12-06, junit of `make test-fast` beside another job).

`make test-fast` (``-m "not slow"``) is the quick loop: each file keeps its cheapest tests that exercise a
feature, and the further variants of a matrix (more architectures, meshes, drivers), the runs that wait on
the engine's own timing (a burst, a lingering prefill), the subprocess groups and the real-download
stand-ins run in `make test` only, which CI runs whole. A name here that no longer matches a collected
test fails the collection (tests/conftest.py), so the list cannot rot silently.
"""

from __future__ import annotations

SLOW: dict[str, str] = {
    # more architectures: llama and the logits tests stay in the quick loop
    "tests/service/test_model_parity.py::test_greedy_32_tokens_match_transformers[qwen2]": "22 s",
    "tests/service/test_model_parity.py::test_greedy_32_tokens_match_transformers[qwen3]": "11 s",
    "tests/service/test_model_parity.py::test_greedy_32_tokens_match_transformers[tied]": "8 s",
    "tests/service/test_model_parity.py::test_greedy_32_tokens_match_transformers[mistral]": "6 s",
    "tests/service/test_model_parity.py::test_greedy_32_tokens_match_transformers[llama3]": "13 s",
    "tests/service/test_vsurge.py::test_no_compilation_on_live_requests[bfloat16]": "9 s",
    # transformers' own GGUF loader dequantizes the whole model
    "tests/service/test_gguf.py::test_smollm2_tensors_equal_transformers_gguf_loader": "21 s",
    "tests/service/test_gguf_tokenizer.py::test_encode_equals_transformers_without_digits": "7 s",
    "tests/service/test_device_check.py::test_reduced_run": "21 s: the whole device benchmark, reduced",
    "tests/service/test_tpu_bench.py::test_tiny_shape_on_cpu": "60 s: the whole TPU benchmark, tiny shape",
    # the benchmark entry points that compile an engine or load a model or tokenizer, smallest run in a
    # subprocess (tests/service/test_benchmarks_run.py; seconds at load ~10 on the 2-core machine)
    "tests/service/test_benchmarks_run.py::test_entry_point_runs[engine]": "119 s",
    "tests/service/test_benchmarks_run.py::test_entry_point_runs[host_overhead]": "156 s",
    "tests/service/test_benchmarks_run.py::test_entry_point_runs[lora]": "278 s",
    "tests/service/test_benchmarks_run.py::test_entry_point_runs[model_sources]": "95 s",
    "tests/service/test_benchmarks_run.py::test_entry_point_runs[paged]": "420 s",
    "tests/service/test_benchmarks_run.py::test_entry_point_runs[sampling_bench]": "40 s",
    "tests/service/test_benchmarks_run.py::test_entry_point_runs[speculative]": "26 s",
    "tests/service/test_benchmarks_run.py::test_entry_point_runs[step_breakdown]": "100 s",
    "tests/service/test_benchmarks_run.py::test_entry_point_runs[structured_bench]": "130 s",
    "tests/service/test_benchmarks_run.py::test_entry_point_runs[structured_mask_bench]": "45 s",
    # TPU lowering: the 1-chip programs of each driver stay quick; the 8-chip and 8B variants are slow
    "tests/service/test_tpu_export.py::test_each_kind_of_program_lowers_for_tpu[smollm2-135m-vdriver-8chips]": "21 s",
    "tests/service/test_tpu_export.py::test_each_kind_of_program_lowers_for_tpu[smollm2-135m-vdriver+features-8chips]": "19 s",
    "tests/service/test_tpu_export.py::test_each_kind_of_program_lowers_for_tpu[llama-3.1-8b-odriver-1chips]": "8 s",
    "tests/service/test_sources_local.py::test_one_named_gguf_from_the_hub": "20 s: a hub stand-in download",
    "tests/service/test_sources_faults.py::test_two_processes_share_one_download": "9 s: two processes",
    "tests/service/test_sources_faults.py::test_killed_mid_download_resumes_without_a_corrupt_cache": "6 s",
    # LoRA: the blocks variant and vdriver's batch stay quick
    "tests/service/test_lora_paths.py::test_three_adapters_and_the_base_match_transformers[tp2]": "19 s",
    "tests/service/test_lora_paths.py::test_three_adapters_and_the_base_match_transformers[odriver-tp2]": "10 s",
    "tests/service/test_lora_paths.py::test_three_adapters_and_the_base_match_transformers[ngram]": "10 s",
    "tests/service/test_lora.py::test_three_adapters_and_the_base_in_one_batch_match_transformers[odriver]": "8 s",
    "tests/service/test_lora.py::test_eviction_unload_while_in_use_and_no_leak[odriver]": "7 s",
    # the whole-cache copy check: vEngine's programs stay quick, oEngine's mixed programs are many
    "tests/service/test_cache_copies.py::test_no_program_copies_a_whole_cache[oEngine]": "40 s",
    # the step lane: subprocess groups that wait out a lane timeout
    "tests/service/test_multihost_lane.py::test_a_slow_leader_is_waited_for_while_it_beats": "17 s",
    "tests/service/test_multihost_lane.py::test_the_worker_replays_every_call_and_a_silent_worker_breaks_the_lane": "10 s",
    "tests/service/test_multihost_lane.py::test_a_failed_group_answers_503_engine_unavailable": "30 s: a lane "
    "pair's two engines and a server, then 15 s of silence at the suite's 30 s bound",
    # the step histograms on the paged driver: a second engine compiles (vDriver's stay in the quick loop)
    "tests/server/test_server_profiling.py::test_odriver_steps_are_timed_by_kind": "10 s",
    "tests/service/test_multihost.py::test_a_start_up_error_on_any_process_ends_the_whole_group[worker]": "6 s",
    "tests/service/test_multihost_lora.py::test_adapters_on_a_group_make_the_single_process_tokens": "61 s: a "
    "two-process group serving --lora adapters (88 s with a cold compilation cache)",
    "tests/service/test_multihost_lora.py::test_a_driver_over_the_lane_serves_adapters_and_the_worker_keeps_up[vdriver]": "16 s: "
    "vdriver's whole engine twice (the group test serves vdriver; odriver's variant stays quick)",
    # operator end to end against a real server's occupancy, waiting out stabilization windows
    "tests/operator/test_operator_autoscaling_e2e.py::test_replicas_follow_occupancy_within_windows_and_bounds": "16 s",
    "tests/operator/test_operator_autoscaling_e2e.py::test_missing_metrics_hold_replicas": "16 s",
    "tests/router/test_router_e2e.py::test_models_are_listed": "18 s: starts two engine servers",
    "tests/router/test_router_e2e.py::test_a_killed_replica_is_replaced_by_the_other": "6 s",
    "tests/router/test_router_e2e.py::test_both_models_answer_streamed_and_not": "13 s (its servers' start)",
    "tests/router/test_router_e2e.py::test_an_unknown_model_is_404": "1 s (the file's servers)",
    "tests/operator/test_operator_cli.py::test_kopf_run_entrypoint": "7 s: kopf run as a subprocess",
    # in-place prefill: test_prompts_written_in_place_decode_like_the_reference stays quick
    "tests/service/test_dense_mixed.py::test_staggered_requests_prefilled_in_the_steps_match_reference": "16 s",
    "tests/service/test_dense_mixed.py::test_stream_decodes_while_a_long_prompt_is_chunked": "12 s",
    "tests/service/test_dense_mixed.py::test_repetition_penalty_sees_every_chunk_of_the_prompt": "11 s",
    "tests/service/test_dense_mixed.py::test_cancel_while_prefilling_in_the_steps_frees_the_slot": "11 s",
    # vdriver's scheduling behaviours under timed bursts; the staggered greedy parity stays quick
    "tests/service/test_vsurge.py::test_driver_prefills_a_queue_in_full_rows": "15 s",
    "tests/service/test_vsurge.py::test_decode_does_not_wait_for_prompts_being_prefilled": "13 s",
    "tests/service/test_vsurge.py::test_prefill_lingers_for_a_burst_then_not": "10 s",
    "tests/service/test_vsurge.py::test_disaggregated_prefill_and_decode_on_separate_devices": "9 s",
    "tests/service/test_vsurge.py::test_driver_packs_waiting_prompts_into_one_prefill": "8 s",
    "tests/service/test_vsurge.py::test_bfloat16_prefill_matches_float32_within_rounding": "8 s",
    "tests/service/test_vsurge.py::test_busy_driver_prefills_in_smaller_calls": "8 s",
    "tests/service/test_slot_moves.py::test_a_moved_request_that_stops_frees_its_slot_at_once": "15 s",
    "tests/service/test_slot_moves.py::test_a_request_left_in_a_high_slot_is_moved_down_and_stays_exact[plain]": "11 s",
    "tests/service/test_odriver.py::test_pages_sharded_over_kv_heads_on_a_mesh": "8 s",
    "tests/service/test_attention.py::test_blocked_prefill_equals_one_softmax[None]": "8 s",
    "tests/service/test_attention.py::test_packed_prefill_attends_within_each_prompt[6]": "6 s",
    "tests/service/test_token_budget.py::test_a_sample_gets_exactly_its_budget[vdriver-5-1-1]": "7 s",
    "tests/service/test_program_inventory.py::test_the_inventory_lowers_as_the_engine_calls[oEngine]": "6 s",
    # a server subprocess, a Helm render, another engine: each kept whole in make test
    "tests/server/test_server_lifecycle.py::test_sigterm_drains_without_losing_requests": "10 s",
    "tests/operator/test_operator_rbac_calls.py::test_every_operator_call_is_allowed_by_the_chart": "10 s",
    "tests/server/test_server_speculative.py::test_greedy_output_is_identical_and_drafts_are_accepted": "8 s",
    "tests/service/test_tpu_export.py::test_each_kind_of_program_lowers_for_tpu[smollm2-135m-odriver-1chips]": "8 s",
    "tests/service/test_seed_server.py::test_fire_with_metrics_port_minus_one_serves_no_metrics": "7 s",
    "tests/test_jax_cache_repair.py::test_a_write_without_the_limit_stops_the_cache_until_repaired": "9 s: two JAX processes",
    "tests/server/test_server_benchmarks.py::test_serve_sweep_over_a_unix_socket_with_a_peer_and_the_engine_only_run": "61 s: "
    "two `vsurge serve` starts and the in-process engine, each running the sweep's three workloads",
}


def stale(slow: dict[str, str], collected: set[str]) -> list[str]:
    """Names in ``slow`` whose file was collected but which match no collected test (renamed or gone)."""
    files = {nodeid.split("::", 1)[0] for nodeid in collected}
    return sorted(n for n in slow if n.split("::", 1)[0] in files and n not in collected)
