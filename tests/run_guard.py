"""The guard every comparison of runs goes through (issue 58).

Two runs compared prove nothing unless their weights moved. An untrained model scores 0 on
the built-in task, so every GRPO advantage is 0, the loss and the gradient are 0, the
weights never change, and any two such runs "agree" whatever the layout, thread count,
resume or weight sync under test. So a test that compares runs (several steps, two layouts,
two thread counts, a resume against the uninterrupted run, a worker's or an engine's weights
against the trainer's) calls :func:`assert_trained` (or, for one step's gradients compared
without an optimizer step, :func:`assert_gradient_flows`) on what it compares, and carries
``@pytest.mark.compares_runs``. ``tests/conftest.py`` fails a marked test that passed
without calling the guard, and ``tests/test_run_guard.py`` fails a test whose name says it
compares runs but which is neither marked nor listed in :data:`NOT_RUN_COMPARISONS`.

The guard is a plain module (several conftest.py files exist, so ``from conftest import``
would be ambiguous); its loaders read a run directory the way a user's tools would: the GRPO
rows of ``metrics.jsonl``, the model of a checkpoint (sharded or not, LoRA adapters applied)
rebuilt from the run config saved in it, and the start weights rebuilt from that same config
(the built-in models' random initial weights come from ``model.init_seed``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

#: One entry per guard call in this process (what it checked): tests/conftest.py reads it
#: to fail a ``compares_runs`` test that never called the guard.
calls: list[str] = []


class NotTrained(AssertionError):
    """The runs a test compares did not train: the comparison cannot fail, so it proves nothing."""


def require_guard_called(test: str, calls_before: int) -> None:
    """Fail ``test`` (marked ``compares_runs``) if it made no guard call since ``calls_before``."""
    if len(calls) == calls_before:
        raise NotTrained(f"{test} is marked compares_runs but never called run_guard.assert_trained / "
                         "assert_run_trained / assert_gradient_flows: a comparison of runs must show that the "
                         "weights it compares moved")


def _finite_positive(values: Iterable) -> list[float]:
    out = []
    for v in values:
        try:
            f = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(f) and f > 0:
            out.append(f)
    return out


def moved(start: Mapping[str, torch.Tensor], end: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the tensors of ``end`` that differ from ``start`` (bitwise; a name missing
    from ``start`` counts as moved only if ``end`` has it and ``start`` does not: refused)."""
    missing = sorted(set(end) - set(start))
    if missing:
        raise NotTrained(f"the end weights have tensors the start weights lack ({missing[:3]}...): compare the "
                         "same model's state before and after")
    return [name for name, tensor in end.items()
            if not torch.equal(torch.as_tensor(tensor).detach().cpu(), torch.as_tensor(start[name]).detach().cpu())]


def assert_trained(grad_norms: Iterable, start: Mapping[str, torch.Tensor], end: Mapping[str, torch.Tensor], *,
                   what: str) -> list[str]:
    """Fail unless some step's gradient norm is finite and > 0 *and* some tensor of ``end``
    differs from ``start``: the weights a comparison of runs compares moved. ``what`` names
    the runs in the message. Returns the names of the tensors that moved."""
    norms = list(grad_norms)
    calls.append(f"assert_trained: {what}")
    if not norms:
        raise NotTrained(f"{what}: no step's grad_norm to check (no GRPO rows in metrics.jsonl?)")
    if not _finite_positive(norms):
        raise NotTrained(f"{what}: no step had a finite grad_norm > 0 (grad_norms {norms[:8]}): the advantages "
                         "were all 0 (an untrained model scores 0 on the built-in task), so the runs compared "
                         "cannot differ. Use a reward that varies within groups (trainer_fast.varied_reward, "
                         "dist_rewards.length_and_digits) or a warm-up")
    if not start:
        raise NotTrained(f"{what}: no start weights to compare with")
    changed = moved(start, end)
    if not changed:
        raise NotTrained(f"{what}: 0 of {len(end)} tensors moved from their start although a grad_norm was > 0 "
                         f"(max {max(_finite_positive(norms)):.3g}): the learning rate is 0, the update was "
                         "skipped, or the weights compared are not the trained ones")
    return changed


def assert_gradient_flows(grads: Iterable[torch.Tensor] | Mapping[str, torch.Tensor], *, what: str) -> float:
    """One step's gradients compared across layouts without an optimizer step: fail unless
    they are all finite and some element is non-zero (zero advantages give zero gradients
    in every layout). Returns the gradients' total norm."""
    calls.append(f"assert_gradient_flows: {what}")
    tensors = list(grads.values()) if isinstance(grads, Mapping) else list(grads)
    tensors = [g for g in tensors if g is not None]
    if not tensors:
        raise NotTrained(f"{what}: no gradients (did backward run? are the parameters trainable?)")
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach().double().cpu())
                                                 for g in tensors])).item()
    if not math.isfinite(norm):
        raise NotTrained(f"{what}: the gradient is not finite (norm {norm})")
    if norm == 0:
        raise NotTrained(f"{what}: every gradient is 0: the advantages were all 0, so every layout agrees. "
                         "Use rewards that vary within groups")
    return norm


# ---------------------------------------------------------------------------- run directories
def metrics(run: str | Path, phase: str = "grpo") -> list[dict]:
    """The rows of ``run/metrics.jsonl`` of ``phase`` (a row without one is GRPO)."""
    path = Path(run) / "metrics.jsonl"
    if not path.exists():
        raise NotTrained(f"{path} does not exist: the run wrote no metrics")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("phase", "grpo") == phase]


def grad_norms(run: str | Path) -> list[float]:
    """Each GRPO step's ``grad_norm`` (NaN where a row has none)."""
    return [r.get("grad_norm", float("nan")) for r in metrics(run)]


def _config_of(checkpoint: Path):
    from portarl.trainer.checkpoint import CheckpointManager
    from portarl.trainer.config import TrainConfig

    return TrainConfig.from_dict(CheckpointManager.load_state(checkpoint)["config"])


def _build(config):
    """The model as the run built it before training: the config's model in its dtype, LoRA
    adapters applied (the built-in models' weights and the adapters' from ``model.init_seed``)."""
    from portarl.assets.lora import apply_lora
    from portarl.assets.models import build_model
    from portarl.trainer.guards.precision import DTYPES

    dtype = DTYPES[config.precision.dtype]
    model, _ = build_model(config.model, dtype)
    if config.model.lora is not None:
        model = apply_lora(model, config.model.lora, seed=config.model.init_seed)
    return model.to(dtype=dtype)


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def checkpoint(run_or_checkpoint: str | Path) -> Path:
    """A checkpoint directory, or a run directory's newest complete checkpoint."""
    from portarl.trainer.checkpoint.export import resolve_checkpoint

    return resolve_checkpoint(run_or_checkpoint)


def checkpoint_weights(run_or_checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """The model state of a checkpoint (or of a run's newest), sharded (DCP) or not, rebuilt
    from the run config saved in it."""
    from portarl.trainer.checkpoint import CheckpointManager

    directory = checkpoint(run_or_checkpoint)
    model = _build(_config_of(directory))
    if CheckpointManager.is_sharded(directory):
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
        CheckpointManager.load_sharded(directory, model, optimizer)
    else:
        CheckpointManager.load_weights(model, directory)
    return _state(model)


def start_weights(run_or_checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """The weights the run started from, rebuilt from the config saved in its checkpoint."""
    return _state(_build(_config_of(checkpoint(run_or_checkpoint))))


def assert_run_trained(run: str | Path, *, end: str | Path | None = None,
                       start: Mapping[str, torch.Tensor] | None = None, what: str | None = None) -> list[str]:
    """:func:`assert_trained` on a run directory: its GRPO grad norms, the weights of ``end``
    (a checkpoint; default the run's newest) against ``start`` (default: rebuilt from the
    saved config). Returns the names of the tensors that moved."""
    end_dir = checkpoint(end if end is not None else run)
    return assert_trained(grad_norms(run), start if start is not None else start_weights(end_dir),
                          checkpoint_weights(end_dir), what=what or str(run))


#: Tests whose names read like comparisons of runs but compare no runs, each with the reason
#: (tests/test_run_guard.py: a test in a run folder whose name matches RUN_COMPARISON_NAME is
#: marked ``compares_runs`` or listed here). Keys: "folder/file.py::test_name".
NOT_RUN_COMPARISONS: dict[str, str] = {
    'distributed/test_console.py::test_the_head_passthrough_returns_a_tensor_of_its_own_with_the_same_bits':
        'one forward of fixed weights, its output against the decoder\'s own: no run, nothing trains',
    'distributed/test_slurm.py::test_the_sbatch_script_trains_on_two_nodes_and_a_requeued_job_continues':
        'checks that the requeued job resumes from the stopped job\'s checkpoint and logs each step once; it compares '
        'no two runs\' numbers (resume equality: trainer/test_resume.py, distributed/test_two_nodes.py)',
    'trainer/test_trackers.py::test_every_metric_reaches_the_tracker_at_its_step_and_the_resume_continues_its_run':
        'the tracker\'s copy of one run\'s metrics against that run\'s metrics.jsonl (every metric at its step); '
        'no two runs are compared',
    'bench/test_stability_gap.py::test_replay_from_a_tar_trains_on_the_extracted_copy':
        'the harness is faked: checks that a .tar is extracted for --replay-from and removed after; nothing trains',
    'cli/test_first_hour_errors.py::test_resume_where_there_is_no_checkpoint_is_refused_unless_a_new_run_is_asked_for':
        'CLI refusal of --resume without a checkpoint, and --resume-or-start starting then continuing; no results compared',
    'cli/test_newcomer_pass.py::test_resume_with_fewer_steps_than_done_is_refused_with_both_numbers':
        "a refused resume's one-line error and untouched config.yaml; no results compared",
    'distributed/test_async_torchrun.py::test_a_dying_worker_stops_both_ranks_with_one_checkpoint_and_resume_regenerates':
        'a worker fault stops both ranks with one checkpoint and the resume regenerates the lost batch: steps and batches counted, no results compared with an uninterrupted run',
    'distributed/test_async_torchrun.py::test_async_on_two_ranks_trains_with_staleness_wait_and_mismatch_metrics':
        "one async run's own schedule (staleness, versions, waits, sharded checkpoint, worker gone), compared with no other run",
    'distributed/test_async_torchrun.py::test_the_gathered_lora_shards_are_one_process_merged_weights':
        'publishes a fixed LoRA model (adapter B randomised, no training step) gathered from shards vs merged on one process: a bitwise gather/merge of given weights, no run trained',
    'distributed/test_fsdp_gloo.py::test_save_on_two_ranks_resume_on_one':
        'a 2-rank sharded checkpoint loads into one process, which runs on to step 3: step bookkeeping of one run, no results compared with another run',
    'distributed/test_strict_hccl.py::test_train_and_resume_in_the_npu_process_group':
        'a run and its resume complete in the stand-in HCCL process group (every collective accepted): step bookkeeping, no results compared with another run',
    'distributed/test_vlm_fsdp.py::test_a_two_rank_vlm_checkpoint_resumes_on_one_process':
        'a 2-rank VLM DCP checkpoint loads into one process, which trains on to step 2: step bookkeeping, no results compared with another run',
    'trainer/test_agent_observations.py::test_a_10mb_environment_observation_and_reset_text_are_cut_and_a_step_trains':
        'one run: a 10 MB environment observation and reset text are cut and one step completes unskipped; compares no runs',
    'trainer/test_agent_observations.py::test_a_10mb_tool_output_is_cut_and_a_step_trains_with_bounded_memory':
        'one run: a 10 MB tool output is cut and one step completes unskipped in bounded memory; compares no runs',
    'trainer/test_async_resume.py::test_a_checkpoint_of_a_failed_pipeline_holds_no_batches_in_flight_and_its_resume_says_so':
        'one run stopped by a dying worker then resumed: checks its checkpoint holds no batch in flight, the log line and the staleness sequence; no second run compared',
    'trainer/test_async_weight_sync.py::test_a_sender_stopped_mid_version_leaves_the_worker_on_its_previous_one_and_resume_goes_on':
        'a torn weight version is refused and --resume finishes the steps: checks versions loaded, exit codes and steps; no weights or numbers compared between runs',
    'trainer/test_attention_masks.py::test_causal_rows_equal_padded':
        "no-grad log-probs of fixed inputs, causal rows vs padded: numerics (the step's gradients: test_causal_rows_step_gradients_equal_padded)",
    'trainer/test_checkpoint_safety.py::test_a_step_saved_again_keeps_the_checkpoint_this_run_wrote_or_resumed_from':
        'a re-save of a step keeps the existing checkpoint (inode, mtime) and which directory is kept; no run compared',
    'trainer/test_detectors.py::test_configs_saved_with_the_retired_collapse_entropy_still_load_and_resume':
        'config loading with a retired field (from_dict, check_resume_config); no training',
    'trainer/test_dynamic_sampling.py::test_round_seeds_never_repeat_across_rounds_and_steps':
        "unit test of round_seeds' uniqueness; no model, no run",
    'trainer/test_gguf.py::test_cli_trains_from_a_gguf_file_and_names_a_missing_one':
        'one portarl train run from a .gguf must exit 0 and write metrics, plus one-line refusals of missing/cut files; compares no runs',
    'trainer/test_lean_decode.py::test_models_it_cannot_reproduce_keep_the_forward_and_say_why':
        "one engine's decode-path fallback and its stated reason; no training, nothing compared",
    'trainer/test_logs_append_only.py::test_rows_past_the_resumed_step_and_a_torn_line_are_dropped':
        'unit test of prepare_log on a hand-written metrics file; no training',
    'trainer/test_lora.py::test_cli_resume_continues_a_lora_run_and_refuses_a_changed_rank':
        'a changed LoRA rank is refused on --resume and the unchanged resume writes its adapter file; compares no runs',
    'trainer/test_memory_micro_batches.py::test_no_grad_logprobs_equal_one_micro_batch':
        'no-grad log-probs of a fixed batch, token-budget micro-batches vs one: numerics, no update compared',
    'trainer/test_memory_micro_batches.py::test_split_to_equalises_counts_across_ranks':
        "unit test of split_to's partition of row indices; no model, no run",
    'trainer/test_padding_free.py::test_attention_across_sequences_is_caught':
        'negative control: planted packing faults must break the no-grad log-prob equality of fixed inputs; no training',
    'trainer/test_padding_free.py::test_materialised_logits_and_npu_emulation_paths_equal_padded':
        'one no-grad forward of fixed inputs (materialised-logits and npu-emulated paths), packed vs padded: numerics, no training',
    'trainer/test_padding_free.py::test_packed_logprobs_and_entropy_equal_padded':
        "one no-grad forward's log-probs and entropy of fixed inputs, packed vs padded: numerics, no training or gradient",
    'trainer/test_padding_free_smollm2.py::test_smollm2_attention_across_sequences_is_caught':
        'negative control: a planted packing fault must break the no-grad equality of fixed sequences; no training',
    'trainer/test_padding_free_smollm2.py::test_smollm2_packed_logprobs_and_entropy_equal_padded':
        'one no-grad forward of SmolLM2 on fixed sequences, packed vs padded: numerics, no training or gradient',
    'trainer/test_padding_free_smollm2.py::test_smollm2_shared_prompt_rows_equal_padded':
        'one no-grad forward of SmolLM2 on fixed sequences, shared-prompt rows vs padded: numerics, no training',
    'trainer/test_precision_guard.py::test_fp16_adamw_update_is_undone_bitwise_and_blamed':
        'one refused fp16 step: weights and optimizer state must stay as they were (a non-finite update undone); not two runs compared',
    'trainer/test_reference_sync.py::test_resume_of_a_run_saved_before_these_sections_existed':
        'config compatibility of an old config.yaml (check_resume_config); no training at all',
    'trainer/test_run_dir.py::test_library_resume_without_a_checkpoint_is_refused_unless_start_if_none':
        'refusal of a resume without a checkpoint, and start_if_none starting fresh; no comparison',
    'trainer/test_run_dir.py::test_resume_applies_lr_and_steps_and_says_so':
        'a resume with a new lr and step count: checks the logged lr, the steps and the log line; no comparison with another run',
    'trainer/test_run_dir.py::test_resume_refuses_other_changes_naming_the_fields':
        'a refused config change on --resume (one error line); no second run trains',
    'trainer/test_run_dir.py::test_reusing_an_output_dir_is_refused_then_overwrite_and_resume':
        "refusal of a reused output directory, then --overwrite and --resume: checks checkpoint names and logged steps; no runs' numbers or weights compared",
    'trainer/test_share_prompt.py::test_shared_logprobs_and_entropy_equal_padded':
        "one no-grad forward's log-probs and entropy of fixed inputs, shared-prompt vs padded: numerics, no training",
    'trainer/test_thread_count.py::test_the_engine_samples_the_same_bits_on_1_2_and_3_threads':
        "the engine's sampling of the fixed initial weights on 1, 2, 3 threads: decode numerics, no training (the trained run is the next test)",
    'trainer/test_train_run.py::test_rollout_and_trainer_log_probs_agree_on_cpu':
        "one step: the rollout's KV-cache log-probs vs the trainer's forward of the same in-process weights before the update; numerics, no sync",
    'trainer/test_write_failures.py::test_a_full_file_system_names_the_file_keeps_the_checkpoints_and_resumes':
        'a failing checkpoint write: checks the error line, the checkpoints kept and that the printed resume command finishes; no run compared with another',
    'vision/test_vlm_plan.py::test_tower_activations_follow_what_trains':
        "the memory plan's estimate of the vision tower's activations under settings: arithmetic on a config, no model runs",
    'vllm_engine/test_vllm_moe.py::test_moe_logprobs_match_the_trainer_after_each_sync':
        "no training run: syncs the initial weights, then a fixed random perturbation of every weight, and itself asserts the engine's outputs changed between the syncs; no gradient or advantage involved",
    'vllm_engine/test_vllm_rollout.py::test_weight_sync_changes_outputs':
        "no training run: syncs another seed's model over the engine's seed-0 weights and back, asserting the outputs change and match; the synced weights differ by construction",
    'vllm_engine/test_vllm_torchrun.py::test_each_rank_generates_its_own_groups_on_the_weights_just_synced':
        "counters only: each rank's weights_version at generate, prompt counts and disjoint seeds; the log-probs after each sync are checked (guarded) by test_each_engines_logprobs_equal_the_trainers_after_every_sync",
    'weight_sync/test_weight_sync.py::test_two_receivers_get_every_version_bitwise':
        "the wire protocol on synthetic versions (version_tensors(v): each version's tensors drawn from its own seed, so they differ by construction); no training",
    'weight_sync/test_wire_format.py::test_pack_then_unpack_is_bitwise':
        'the bucket codec on fixed tensors (special values, strides, dtypes): packing then unpacking is the identity; no training',
}
