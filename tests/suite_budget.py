"""What ``make test`` leaves to ``make test-full``: the slower end-to-end variants whose
property a cheaper test in ``make test`` keeps covered (issue 45: a suite sized to CI's
budget, with room for the features to come).

``make test-full`` (``pytest --full``, or ``PORTARL_TEST_FULL=1``) runs every test; it runs
before a release and in the GPU / Ascend workflows (docs/hardware-ci.md). ``make test``
skips the node ids below, each with the reason printed by ``pytest -rs``.

Rules the collection enforces (``check_full_only``, called from conftest.py), so that a
cover cannot silently disappear:

- every entry names at least one cover, and every cover is a test that runs in ``make
  test`` (a node id below tests/, or a test function's id to mean all its parameters);
- an entry or a cover whose file was collected but that matches no test fails the run (a
  renamed test must be renamed here too).
"""

from __future__ import annotations

import os

#: Environment variable that turns ``make test`` into ``make test-full``.
FULL_ENV = "PORTARL_TEST_FULL"

_LINEAR = "parity/test_linear_logprobs.py::test_linear_logprobs_matches_float64"
_ASYNC2 = "distributed/test_async_torchrun.py::"
_RESUME = "trainer/test_async_resume.py::test_async_resume_reproduces_the_uninterrupted_run_bitwise"
_VLM2 = "distributed/test_vlm_fsdp.py::"
_JUDGE_CLI = "trainer/test_model_rewards_cli.py::test_a_judge_that_fails_mid_run_stops_it_with_a_checkpoint_and_exit_3"
_DEATH = "trainer/test_silent_death.py::test_user_code_that_ends_the_process_is_named_and_the_run_exits_non_zero"
_DEATHS, _PLACES, _MODES = ("exit0", "exit7", "segv"), ("reward", "tool", "environment"), ("colocated", "async")
#: The user-code deaths make test keeps: every (death, place), (death, mode) and (place, mode)
#: pair once (a Latin square: 9 of the 18 runs).
_DEATHS_KEPT = {(d, w, _MODES[(i + j) % 2]) for i, d in enumerate(_DEATHS) for j, w in enumerate(_PLACES)}
_AOT = "kernels/test_aot_compile.py::"

#: node id (below tests/) -> (covers in make test, what the cover keeps)
FULL_ONLY: dict[str, tuple[list[str], str]] = {
    # The Triton interpreter is slow on the two large fused linear log-prob shapes: each
    # keeps one dtype in make test; the dtypes themselves are held on the smaller shapes.
    f"{_LINEAR}[cuda-interpreted-v4099_h896_strided_t13-fp32]": (
        [f"{_LINEAR}[cuda-interpreted-v4099_h896_strided_t13-bf16]",
         f"{_LINEAR}[cuda-interpreted-v4099_h64_batch-fp32]"],
        "the large-hidden strided shape in bf16; fp32 on V 4099 with a batch"),
    f"{_LINEAR}[cuda-interpreted-v4099_h896_strided_t13-fp16]": (
        [f"{_LINEAR}[cuda-interpreted-v4099_h896_strided_t13-bf16]",
         f"{_LINEAR}[cuda-interpreted-v4099_h64_batch-fp16]"],
        "the large-hidden strided shape in bf16; fp16 on V 4099 with a batch"),
    f"{_LINEAR}[cuda-interpreted-v32000_h8-fp32]": (
        [f"{_LINEAR}[cuda-interpreted-v32000_h8-fp16]", f"{_LINEAR}[cuda-interpreted-v4099_h64_batch-fp32]"],
        "the 32000-token vocabulary in fp16; fp32 on V 4099"),
    f"{_LINEAR}[cuda-interpreted-v32000_h8-bf16]": (
        [f"{_LINEAR}[cuda-interpreted-v32000_h8-fp16]", f"{_LINEAR}[cuda-interpreted-v4099_h64_batch-bf16]"],
        "the 32000-token vocabulary in fp16; bf16 on V 4099"),
    # The linear heads' invariance gate at 4095-8192 rows under the interpreter (minutes per
    # head): make test gates 1-128 rows on every head, dtype and tile, several chunks included.
    **{f"parity/test_linear_heads.py::test_invariance_gate_at_thousands_of_rows[cuda-interpreted-{head}]": (
        [f"parity/test_linear_heads.py::test_invariance_gate[cuda-interpreted-{head}-bf16-big-tile]",
         f"parity/test_linear_heads.py::test_invariance_gate[cuda-interpreted-{head}-fp32-small-tile]"],
        "the same head's gate on 1-128 rows in several chunks, both tiles and dtypes")
       for head in ("split", "cublas", "tile")},
    # Two-rank async runs: each property stays covered on two ranks or by its one-process twin.
    f"{_ASYNC2}test_lora_async_on_two_ranks_matches_one_process": (
        [f"{_ASYNC2}test_lora_async_on_two_ranks_publishes_the_merged_weights_of_every_version_bitwise[collective]",
         f"{_ASYNC2}test_one_async_step_on_two_ranks_matches_one_process",
         "distributed/test_torchrun_options.py::test_lora_on_two_ranks_matches_one_process"],
        "2-rank LoRA async publishes one process's merged weights bitwise; async and LoRA each 2 ranks = 1 process"),
    f"{_ASYNC2}test_lora_async_on_two_ranks_publishes_the_merged_weights_of_every_version_bitwise[file]": (
        [f"{_ASYNC2}test_lora_async_on_two_ranks_publishes_the_merged_weights_of_every_version_bitwise[collective]",
         "trainer/test_async_weight_sync.py::test_the_workers_weights_equal_the_trainers_bitwise_at_every_version[file]",
         f"{_ASYNC2}test_a_weights_file_that_cannot_be_written_stops_every_rank_with_the_same_line"],
        "the merged LoRA weights over collective sync; file sync bitwise, and under torchrun"),
    f"{_ASYNC2}test_two_workers_under_torchrun_share_the_steps_and_hold_the_trainers_weights_bitwise": (
        ["trainer/test_async_weight_sync.py::test_two_workers_share_the_steps_and_each_holds_the_trainers_weights_bitwise",
         f"{_ASYNC2}test_the_gathered_shards_are_the_unsharded_weights",
         f"{_ASYNC2}test_one_async_step_on_two_ranks_matches_one_process"],
        "two workers share the steps bitwise (one rank); 2-rank publishing gathers the unsharded weights"),
    f"{_ASYNC2}test_a_dying_worker_stops_both_ranks_with_one_checkpoint_and_resume_regenerates": (
        [f"{_ASYNC2}test_a_reward_failing_in_the_worker_stops_both_ranks_naming_it",
         "trainer/test_async_resume.py::test_a_checkpoint_of_a_failed_pipeline_holds_no_batches_in_flight_and_its_"
         "resume_says_so"],
        "a failing worker stops both ranks with one sharded checkpoint; resume regenerates the lost batch"),
    # Async kill-and-resume points: the kill between checkpoints and the SIGTERM stay.
    f"{_RESUME}[hang@5-_kill_while_a_checkpoint_waits_for_its_batch_in_flight]": (
        [f"{_RESUME}[hang@4-_kill_between_checkpoints]", f"{_RESUME}[None-_sigterm]"],
        "SIGKILL and resume bitwise from a checkpoint holding batches in flight"),
    f"{_RESUME}[hang@6-_kill_right_after_a_checkpoint]": (
        [f"{_RESUME}[hang@4-_kill_between_checkpoints]", f"{_RESUME}[None-_sigterm]"],
        "resume bitwise from a just-written checkpoint holding its batch in flight"),
    "trainer/test_async_rollout.py::test_kill_9_then_resume_trains_every_step_and_prompt_once": (
        [f"{_RESUME}[hang@4-_kill_between_checkpoints]"],
        "SIGKILL mid-run, then --resume trains every step and prompt once (bitwise)"),
    # Vision-language on two ranks: Qwen2.5-VL padding-free stays; the padded layout and Qwen3-VL
    # are held on one process (their layouts, their CLI runs) and by the same 2-rank code path.
    f"{_VLM2}test_one_vlm_step_on_two_ranks_matches_one_process[qwen2.5-vl-padded]": (
        [f"{_VLM2}test_one_vlm_step_on_two_ranks_matches_one_process[qwen2.5-vl-padding-free]",
         "vision/test_vlm_numerics.py::test_packed_layouts_match_the_padded_one_and_1d_positions_would_not"],
        "2 ranks = 1 process for a VLM on padding-free rows; the padding-free layouts equal the padded one"),
    f"{_VLM2}test_a_two_rank_vlm_checkpoint_resumes_on_one_process[qwen2.5-vl-padded]": (
        [f"{_VLM2}test_a_two_rank_vlm_checkpoint_resumes_on_one_process[qwen2.5-vl-padding-free]"],
        "a 2-rank VLM checkpoint (DCP) resumes on one process"),
    f"{_VLM2}test_one_vlm_step_on_two_ranks_matches_one_process[qwen3-vl-padding-free]": (
        [f"{_VLM2}test_one_vlm_step_on_two_ranks_matches_one_process[qwen2.5-vl-padding-free]",
         "vision/test_vlm_train_cli.py::test_a_saved_vlm_trains_resumes_and_exports_from_the_command_line"],
        "2 ranks = 1 process on Qwen2.5-VL; Qwen3-VL trains, resumes and exports on one process"),
    f"{_VLM2}test_a_two_rank_vlm_checkpoint_resumes_on_one_process[qwen3-vl-padding-free]": (
        [f"{_VLM2}test_a_two_rank_vlm_checkpoint_resumes_on_one_process[qwen2.5-vl-padding-free]",
         "vision/test_vlm_train_cli.py::test_a_saved_vlm_trains_resumes_and_exports_from_the_command_line"],
        "a 2-rank Qwen2.5-VL checkpoint resumes on one process; Qwen3-VL resumes on one process"),
    # One signal of the two on two ranks; SIGINT is held on one process.
    "distributed/test_fsdp_gloo.py::test_signal_on_one_rank_stops_both_with_one_checkpoint[2]": (
        ["distributed/test_fsdp_gloo.py::test_signal_on_one_rank_stops_both_with_one_checkpoint[15]",
         "trainer/test_signals.py::test_second_signal_aborts_at_once_and_says_nothing_was_saved"],
        "a signal to one rank stops both with one checkpoint; SIGINT's handling on one process"),
    # An async MoE run resumed with a batch in flight: the dense resume with a batch in flight
    # holds the checkpoint's reply bitwise; the routed experts' JSON and replay-file round trips hold
    # the recording it carries.
    "trainer/test_async_resume.py::test_an_moe_run_resumed_with_a_batch_in_flight_replays_its_routed_experts": (
        [f"{_RESUME}[hang@4-_kill_between_checkpoints]",
         "moe/test_moe_train_cli.py::test_recorded_experts_round_trip_through_json_and_refuse_damage",
         "moe/test_moe_train_cli.py::test_recorded_experts_travel_in_replay_files"],
        "a batch in flight resumes bitwise; the recorded experts survive its JSON"),
    # The node keeping the rendezvous store dying: the other node's death on two agents, and the
    # store-gone line at unit level.
    "distributed/test_two_nodes.py::test_a_node_that_dies_stops_the_other_within_the_timeout_naming_it[node0_keeping_the_store]": (
        ["distributed/test_two_nodes.py::test_a_node_that_dies_stops_the_other_within_the_timeout_naming_it[node1]",
         "test_heartbeat.py::test_silent_peers_says_when_the_rendezvous_store_is_gone"],
        "a dying node stops the other naming it; a gone store is named"),
    # A judge failing mid-run through the command line: the stopped server in make test; the slow
    # and the garbage server end the same way (the runner-level tests hold their one-line reward failure).
    **{f"{_JUDGE_CLI}[{fault}]": (
        [f"{_JUDGE_CLI}[stop]",
         f"trainer/test_judges.py::test_a_failing_judge_is_one_reward_failure_naming_its_url_and_the_sample[{fault}]"],
        "a judge's reward failure ends a run with a checkpoint and exit 3; this fault's failure names the judge")
       for fault in ("slow", "garbage")},
    # User code ending its process: each of the other 9 runs shares its death, its place and its
    # mode, pairwise, with runs make test keeps (the fixture runs only the kept ones).
    **{f"{_DEATH}[{d}-{w}-{m}]": (
        [f"{_DEATH}[{d}-{w}-{other}]", *(f"{_DEATH}[{'-'.join(c)}]" for c in sorted(_DEATHS_KEPT)
                                         if c[2] == m and (c[0] == d or c[1] == w))],
        f"this death and place in the other mode; the same death and the same place in {m} mode")
       for d in _DEATHS for w in _PLACES for m in _MODES
       if (d, w, m) not in _DEATHS_KEPT for other in [_MODES[1 - _MODES.index(m)]]},
    # Ahead-of-time compiles for sm_80: the same kernels and variants compile for sm_90 (the
    # Hopper tile's HGMMA, no spills) in make test; sm_80's HMMA and spills in make test-full,
    # and on the GPU (docs/hardware-ci.md). The fixture compiles only the targets whose tests run.
    **{f"{_AOT}{test}[80]": ([f"{_AOT}{test}[90]"], "the same variants compiled for sm_90")
       for test in ("test_variants_compile_without_spills", "test_linear_tile_runs_on_tensor_cores",
                    "test_split_head_runs_on_tensor_cores")},
    # The sbatch script's own two-"node" run and requeue (2 minutes): make test keeps the script
    # as the docs show it, and the two-node torchrun job it launches resuming as uninterrupted.
    "distributed/test_slurm.py::test_the_sbatch_script_trains_on_two_nodes_and_a_requeued_job_continues": (
        ["distributed/test_slurm.py::test_the_docs_show_the_script_as_shipped",
         "distributed/test_two_nodes.py::test_two_nodes_train_save_sharded_checkpoints_and_resume_as_the_uninterrupted_run",
         "trainer/test_resume.py::test_sigkill_then_resume"],
        "the script's text; two nodes of torchrun ranks save and resume bitwise; --resume-or-start after a kill"),
    # The short chaos runs (2-4 minutes each): make test keeps every fault kind's own test and
    # the chaos run's parts; the long runs are in docs/checkpoints.md.
    **{f"bench/test_chaos.py::test_a_short_chaos_run_ends_equal_to_the_uninterrupted_run[{mode}]": (
        [*covers, "bench/test_chaos.py::test_the_disk_full_hook_fails_one_write_of_its_kind_once"],
        f"{mode}: {what}, each fault alone")
       for mode, covers, what in (
           ("colocated", ["trainer/test_resume.py::test_sigkill_then_resume",
                          "trainer/test_write_failures.py::test_a_full_file_system_names_the_file_keeps_the_checkpoints_and_resumes"],
            "a SIGKILL and a full disk then resume"),
           ("async", [f"{_RESUME}[hang@4-_kill_between_checkpoints]", f"{_RESUME}[None-_sigterm]"],
            "a trainer SIGKILL or SIGTERM in async mode resumes bitwise"),
           ("torchrun", ["distributed/test_fsdp_gloo.py::test_save_on_two_ranks_resume_on_one", "distributed/test_fsdp_gloo.py::test_reward_error_on_one_rank_stops_both_with_a_checkpoint"],
            "two ranks under torchrun"))},
}


def running_params(request, test: str, names: tuple[str, ...]) -> set[tuple]:
    """The parameter tuples (``names`` of the callspec) of the items of test function
    ``test`` in ``request``'s module that this session runs (not skipped by :data:`FULL_ONLY`),
    so that a module fixture computing every case's result up front computes only those."""
    out = set()
    for item in request.session.items:
        if getattr(item, "originalname", None) == test and item.module is request.module \
                and item.get_closest_marker("skip") is None:
            out.add(tuple(item.callspec.params[n] for n in names))
    return out


def full_suite(config) -> bool:
    """``make test-full``: every test runs."""
    return bool(config.getoption("--full", default=False)) or os.environ.get(FULL_ENV) == "1"


def _matches(nodeid: str, pattern: str) -> bool:
    return nodeid == pattern or nodeid.startswith(pattern + "[")


def check_full_only(items) -> dict[str, str]:
    """``{collected node id: skip reason}`` for the entries of :data:`FULL_ONLY`; raises
    ``pytest.UsageError`` on an entry or a cover that breaks the rules (module docstring)."""
    import pytest

    ids = {item.nodeid.removeprefix("tests/"): item.nodeid for item in items}
    files = {nodeid.split("::")[0] for nodeid in ids}
    reasons = {}
    for entry, (covers, keeps) in FULL_ONLY.items():
        if not covers:
            raise pytest.UsageError(f"tests/suite_budget.py: {entry} names no cover")
        if entry.split("::")[0] not in files:
            continue  # not collected in this run (a subset of the suite)
        if entry not in ids:
            raise pytest.UsageError(f"tests/suite_budget.py: {entry} is not a test (renamed?)")
        for cover in covers:
            if cover.split("::")[0] not in files:
                continue
            found = [nodeid for nodeid in ids if _matches(nodeid, cover)]
            if not found:
                raise pytest.UsageError(f"tests/suite_budget.py: {entry}'s cover {cover} is not a test")
            if all(nodeid in FULL_ONLY for nodeid in found):
                raise pytest.UsageError(f"tests/suite_budget.py: {entry}'s cover {cover} runs in make test-full only")
        reasons[ids[entry]] = f"make test-full only (covered in make test: {keeps})"
    return reasons
