"""stalerl.config: schema defaults, YAML + override merging, validation messages, help, saving, backend strings."""

import dataclasses
import os
import warnings

import pytest
import yaml

from stalerl import config as C
from stalerl.config import (
    Backend,
    ConfigError,
    ConfigWarning,
    ExperimentConfig,
    apply_overrides,
    config_to_yaml,
    format_help,
    load_config,
    parse_args,
    parse_backend,
    run_dir,
    save_resolved_config,
    schema_keys,
)


def write_yaml(tmp_path, text, name="exp.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def error_of(argv):
    with pytest.raises(ConfigError) as info:
        load_config(argv)
    return str(info.value)


def leaf_keys():
    schema = C._schema(ExperimentConfig)
    return [k for k, (tp, _) in schema.items() if not dataclasses.is_dataclass(C._unwrap_optional(tp)[0])]


# ---------------------------------------------------------------------------------------------------------- defaults


def test_defaults_load_without_config_file():
    cfg = load_config([])
    assert isinstance(cfg, ExperimentConfig)
    assert cfg == ExperimentConfig()  # direct construction agrees with the OmegaConf path
    assert cfg.experiment_name == "gsm8k-grpo" and cfg.trial_name == "trial0"
    assert cfg.total_train_steps == 300 and cfg.torch_threads == 2
    assert cfg.scheduler.type == "local" and cfg.rollout.backend == "hf:d1" and cfg.actor.backend == "torch:d1"
    assert cfg.rollout.consumer_batch_size == cfg.train_dataset.batch_size == 32
    assert (cfg.train_dataset.split, cfg.train_dataset.shuffle) == ("train", True)
    assert (cfg.valid_dataset.split, cfg.valid_dataset.batch_size, cfg.valid_dataset.shuffle) == ("test", 256, False)
    assert cfg.eval_gconfig.greedy is True and cfg.eval_gconfig.n_samples == 1
    assert cfg.gconfig.greedy is False and cfg.gconfig.n_samples == 4
    assert cfg.actor.loss == "m2po" and cfg.actor.m2_threshold == 0.04
    assert cfg.actor.reward_norm is None
    assert cfg.actor.adv_norm == C.NormConfig(mean_level="group", std_level="group")
    assert cfg.scheduler.slurm.extra_sbatch_args == []
    assert cfg.effective_tokenizer_path == "tiny:qwen2"


def test_every_field_has_help_text():
    for key, (_, f) in C._schema(ExperimentConfig).items():
        assert f.metadata.get("help", "").strip(), f"{key} has no metadata['help']"


# ------------------------------------------------------------------------------------------------------- merging


def test_yaml_then_overrides_merge_in_order(tmp_path):
    path = write_yaml(tmp_path, """
experiment_name: exp1
gconfig:
  n_samples: 8
  temperature: 0.7
actor:
  optimizer: {lr: 3.0e-5, type: sgd}
train_dataset:
  batch_size: 16
""")
    cfg = load_config(["--config", path, "gconfig.temperature=0.9", "actor.optimizer.lr=1e-5"])
    assert cfg.experiment_name == "exp1"  # YAML over default
    assert cfg.gconfig.n_samples == 8
    assert cfg.gconfig.temperature == 0.9  # override over YAML
    assert cfg.actor.optimizer.lr == pytest.approx(1e-5)  # "1e-5" parses as a float
    assert cfg.actor.optimizer.type == "sgd"  # sibling kept from YAML
    assert cfg.actor.optimizer.beta2 == 0.99  # default kept
    assert cfg.rollout.consumer_batch_size == 16  # interpolated default follows the YAML


def test_absent_field_is_overridable_without_plus(tmp_path):
    path = write_yaml(tmp_path, "actor:\n  loss: vanilla\n")  # no c_clip in the file (AReaL rejects this case)
    cfg = load_config(["--config", path, "actor.c_clip=3.0"])
    assert cfg.actor.c_clip == 3.0 and cfg.actor.loss == "vanilla"


def test_every_schema_key_is_overridable_without_plus():
    default_tree = yaml.safe_load(config_to_yaml(ExperimentConfig()))
    overrides = []
    for key in leaf_keys():
        if key.startswith("actor.reward_norm."):
            continue  # a null section by default; setting its keys turns it on (test_optional_sections_...)
        node = default_tree
        for part in key.split("."):
            node = node[part]
        text = yaml.safe_dump(node, default_flow_style=True).strip().removesuffix("...").strip()
        overrides.append(f"{key}={text}")
    assert len(overrides) > 90
    assert load_config(overrides) == ExperimentConfig()
    # and each one really takes effect
    cfg = load_config(["scheduler.slurm.time=2:00:00", "valid_dataset.synthetic.test_size=7", "seed=9",
                       "scheduler.slurm.extra_sbatch_args=[--qos=high,--exclusive]", "tokenizer_path=gpt2"])
    assert cfg.scheduler.slurm.time == "2:00:00"  # kept verbatim, not YAML's base-60 integer
    assert cfg.valid_dataset.synthetic.test_size == 7 and cfg.train_dataset.synthetic.test_size == 256
    assert cfg.seed == 9 and cfg.scheduler.slurm.extra_sbatch_args == ["--qos=high", "--exclusive"]
    assert cfg.effective_tokenizer_path == "gpt2"


def test_plus_prefix_means_the_same():
    assert load_config(["+actor.c_clip=3.0", "+rollout.max_head_offpolicyness=4"]) == \
        load_config(["actor.c_clip=3.0", "rollout.max_head_offpolicyness=4"])
    assert load_config(["+actor.c_clip=3.0"]).actor.c_clip == 3.0


def test_interpolation(tmp_path):
    assert load_config(["train_dataset.batch_size=8"]).rollout.consumer_batch_size == 8
    path = write_yaml(tmp_path, """
tokenizer_path: ${actor.path}
rollout:
  consumer_batch_size: ${valid_dataset.batch_size}
  max_concurrent_rollouts: ${rollout.consumer_batch_size}
""")
    cfg = load_config(["--config", path, "actor.path=/models/qwen"])
    assert cfg.tokenizer_path == "/models/qwen"
    assert cfg.rollout.consumer_batch_size == 256 and cfg.rollout.max_concurrent_rollouts == 256
    assert load_config(["rollout.consumer_batch_size=${gconfig.n_samples}"]).rollout.consumer_batch_size == 4
    msg = error_of(["rollout.consumer_batch_size=${train_dataset.batchsize}"])
    assert "rollout.consumer_batch_size" in msg and "train_dataset.batch_size" in msg  # did you mean


def test_optional_sections_null_and_enable():
    cfg = load_config(["actor.adv_norm=null"])
    assert cfg.actor.adv_norm is None
    cfg = load_config(["actor.reward_norm.mean_level=batch"])  # setting a key of a null section creates it
    assert cfg.actor.reward_norm == C.NormConfig(mean_level="batch", std_level="group")
    cfg = load_config(["actor.adv_norm.std_level=null", "actor.adv_norm.mean_level=batch"])
    assert cfg.actor.adv_norm == C.NormConfig(mean_level="batch", std_level=None)
    assert load_config(["rollout.max_concurrent_rollouts=null"]).rollout.max_concurrent_rollouts is None
    assert load_config(["total_train_steps=null"]).total_train_steps is None


# ------------------------------------------------------------------------------------------------- unknown keys


def test_unknown_override_key_did_you_mean_same_section():
    msg = error_of(["rollout.max_head_ofpolicyness=4"])
    assert "'rollout.max_head_ofpolicyness'" in msg and "did you mean 'rollout.max_head_offpolicyness'" in msg


def test_unknown_override_key_suggests_across_sections():
    with pytest.raises(ConfigError) as info:
        load_config(["actor.max_head_offpolicyness=256"])
    assert isinstance(info.value, ValueError)
    assert info.value.keys == ["actor.max_head_offpolicyness"]
    assert "did you mean 'rollout.max_head_offpolicyness'" in str(info.value)
    assert "did you mean 'actor.optimizer.lr'" in error_of(["actor.lr=1e-5"])
    assert "'gconfig.n_samples'" in error_of(["gconfig.nsamples=2"])


def test_unknown_key_in_yaml_names_full_key_and_file(tmp_path):
    path = write_yaml(tmp_path, "cluster:\n  fileroot: /x\nactor:\n  optimizer:\n    lrr: 0.1\n  m2threshold: 0.1\n")
    msg = error_of(["--config", path])
    assert "actor.optimizer.lrr" in msg and "'actor.optimizer.lr'" in msg
    assert "actor.m2threshold" in msg and "'actor.m2_threshold'" in msg  # every unknown key reported at once
    assert path in msg


def test_areal_spelling_points_to_our_name():
    assert "actor.behavior_logp=recompute" in error_of(["actor.recompute_logprob=true"])


# -------------------------------------------------------------------------------------------------------- types


@pytest.mark.parametrize("override, key, expected", [
    ("rollout.max_head_offpolicyness=abc", "rollout.max_head_offpolicyness", "int"),
    ("gconfig.temperature=hot", "gconfig.temperature", "float"),
    ("actor.ppo_n_minibatches=1.5", "actor.ppo_n_minibatches", "int"),
    ("stats_logger.tensorboard=maybe", "stats_logger.tensorboard", "bool"),
    ("actor.optimizer={lr: abc}", "actor.optimizer.lr", "float"),
    ("seed=null", "seed", "int"),
])
def test_type_errors_name_key_value_and_type(override, key, expected):
    msg = error_of([override])
    assert key in msg and f"expected {expected}" in msg
    if "null" not in override:
        assert override.split("=", 1)[1].strip("{}").split(": ")[-1] in msg  # the offending value


def test_type_error_in_yaml(tmp_path):
    msg = error_of(["--config", write_yaml(tmp_path, "actor:\n  eps_clip: wide\n")])
    assert "actor.eps_clip" in msg and "'wide'" in msg and "float" in msg


def test_unquoted_slurm_time_in_yaml_is_caught(tmp_path):
    msg = error_of(["--config", write_yaml(tmp_path, "scheduler:\n  slurm:\n    time: 1:00:00\n")])
    assert "scheduler.slurm.time" in msg and "3600" in msg and "quote" in msg


# ------------------------------------------------------------------------------------------------------ choices


@pytest.mark.parametrize("key, bad", [
    ("scheduler.type", "kubernetes"),
    ("rollout.backend", "trtllm:d1"),
    ("rollout.backend", "sglang:x4"),
    ("rollout.backend", "hf:d1t2"),
    ("actor.backend", "megatron:d1"),
    ("actor.backend", "fsdp:d4p2"),
    ("actor.backend", "torch:d1t2"),
    ("actor.loss", "m2p0"),
    ("actor.loss_agg_mode", "mean"),
    ("actor.behavior_logp", "proximal"),
    ("actor.dtype", "fp8"),
    ("actor.device", "tpu"),
    ("actor.m2_scope", "global"),
    ("actor.optimizer.type", "adam"),
    ("actor.optimizer.lr_scheduler_type", "step"),
    ("actor.adv_norm.mean_level", "global"),
    ("recover.mode", "always"),
    ("rollout.weight_sync", "nccl"),
    ("train_dataset.synthetic.task", "mul"),
    ("actor.path", "tiny:gpt2"),
])
def test_choice_fields_reject_bad_values(key, bad):
    msg = error_of([f"{key}={bad}"])
    assert key in msg and repr(bad) in msg and "Fix" in msg


def test_choice_errors_list_allowed_values_and_suggest():
    msg = error_of(["scheduler.type=slurn"])
    assert "local, ray, slurm" in msg and "did you mean 'slurm'" in msg
    msg = error_of(["actor.loss=m2p0"])
    assert "m2po" in msg and "vanilla" in msg and "no_trust_region" in msg


@pytest.mark.parametrize("override, suggested, fix", [
    ("actor.loss=m2p0", "m2po", "Fix: set actor.loss=m2po,"),  # registry losses (schema.py)
    ("actor.loss_agg_mode=token-men", "token-mean", "Fix: set actor.loss_agg_mode=token-mean."),
    ("scheduler.type=slurn", "slurm", "Fix: set scheduler.type=slurm."),  # field choices (checks.py)
])
def test_fix_line_names_the_suggested_value(override, suggested, fix):
    # issue 28: "did you mean 'm2po'?" followed by "Fix: set actor.loss=fipo" contradicted itself
    msg = error_of([override])
    assert f"did you mean {suggested!r}?" in msg and fix in msg


def test_fix_line_without_a_suggestion_names_the_first_choice():
    msg = error_of(["actor.loss=zzzzzz"])
    assert "did you mean" not in msg and "Fix: set actor.loss=" in msg


def test_registered_losses_accepted():
    for loss in ("m2po", "vanilla", "no_trust_region"):
        assert load_config([f"actor.loss={loss}"]).actor.loss == loss


# ------------------------------------------------------------------------------------------------------- ranges


@pytest.mark.parametrize("override", [
    "actor.m2_threshold=-0.1", "actor.m2_threshold=inf", "actor.m2_threshold=nan", "actor.eps_clip=-0.2",
    "actor.c_clip=1.0", "actor.c_clip=0.5", "actor.optimizer.lr=0", "actor.optimizer.lr=-1e-4",
    "gconfig.n_samples=0", "gconfig.temperature=0", "gconfig.top_p=0", "gconfig.top_p=1.5",
    "gconfig.max_new_tokens=0", "rollout.max_head_offpolicyness=-1", "rollout.fixed_staleness=-1",
    "rollout.max_concurrent_rollouts=0", "train_dataset.batch_size=0", "valid_dataset.batch_size=0",
    "total_train_epochs=0", "total_train_steps=0", "actor.ppo_n_minibatches=0", "torch_threads=0",
    "actor.optimizer.warmup_steps_proportion=1.5", "actor.optimizer.beta2=1.0", "recover.freq_steps=0",
    "evaluator.freq_steps=0", "stats_logger.log_every=0", "warm_start.steps=-1", "actor.tiny.num_attention_heads=3",
    "actor.eps_clip_higher=-1", "scheduler.slurm.mem=lots", "scheduler.slurm.time=soon", "experiment_name=a/b",
])
def test_ranges(override):
    key, _, value = override.partition("=")
    msg = error_of([override])
    assert key in msg and ("Fix" in msg or "expected" in msg)


def test_range_edges_accepted():
    cfg = load_config(["actor.m2_threshold=0", "actor.eps_clip=0", "actor.c_clip=3", "gconfig.top_p=1",
                       "rollout.max_concurrent_rollouts=1", "warm_start.steps=0"])
    assert cfg.actor.m2_threshold == 0.0 and cfg.actor.c_clip == 3.0 and cfg.warm_start.steps == 0


def test_all_problems_reported_together():
    msg = error_of(["actor.eps_clip=-1", "gconfig.top_p=0", "scheduler.type=k8s"])
    assert "3 problems" in msg
    assert "actor.eps_clip" in msg and "gconfig.top_p" in msg and "scheduler.type" in msg


# --------------------------------------------------------------------------------------------------- cross field


def test_two_staleness_modes_rejected():
    msg = error_of(["rollout.fixed_staleness=2", "rollout.max_head_offpolicyness=4"])
    assert "rollout.fixed_staleness" in msg and "rollout.max_head_offpolicyness" in msg and "pick one" in msg
    assert load_config(["rollout.fixed_staleness=2"]).rollout.fixed_staleness == 2
    assert load_config(["rollout.max_head_offpolicyness=4"]).rollout.max_head_offpolicyness == 4


def test_minibatches_must_divide_batch_size():
    msg = error_of(["actor.ppo_n_minibatches=3"])
    assert "actor.ppo_n_minibatches" in msg and "train_dataset.batch_size=32" in msg
    assert load_config(["actor.ppo_n_minibatches=4"]).actor.ppo_n_minibatches == 4
    assert "rollout.consumer_batch_size=6" in error_of(["actor.ppo_n_minibatches=4",
                                                        "rollout.consumer_batch_size=6"])


def test_group_normalisation_needs_two_samples():
    msg = error_of(["gconfig.n_samples=1"])
    assert "gconfig.n_samples" in msg and "actor.adv_norm" in msg
    assert load_config(["gconfig.n_samples=1", "actor.adv_norm=null"]).gconfig.n_samples == 1
    assert load_config(["gconfig.n_samples=1", "actor.adv_norm.mean_level=batch",
                        "actor.adv_norm.std_level=batch"]).gconfig.n_samples == 1
    assert "actor.reward_norm" in error_of(["gconfig.n_samples=1", "actor.adv_norm=null",
                                            "actor.reward_norm.mean_level=group"])


def test_kl_not_supported_yet():
    assert "actor.kl_coef" in error_of(["actor.kl_coef=0.1"])


def test_gpu_backends_checked_against_cluster():
    msg = error_of(["rollout.backend=vllm:d1t2", "actor.backend=fsdp:d4", "cluster.n_gpus_per_node=4"])
    assert "6 GPUs" in msg and "= 4" in msg
    cfg = load_config(["rollout.backend=vllm:d1t2", "actor.backend=fsdp:d2", "cluster.n_gpus_per_node=4"])
    assert parse_backend(cfg.rollout.backend) == Backend("vllm", 1, 2, 1)


def test_sglang_is_refused_at_load_naming_the_verl_path():
    for argv in (["rollout.backend=sglang:d2"], ["rollout.backend=sglang:d2", "cluster.n_gpus_per_node=4"]):
        msg = error_of(argv)
        assert "rollout.backend" in msg and "verl" in msg and "sglang" in msg and "run_m2po_async.sh" in msg


@pytest.mark.parametrize("argv, key, words", [
    (["rollout.vllm.gpu_memory_utilization=1.5"], "rollout.vllm.gpu_memory_utilization", "<= 1.0"),
    (["rollout.vllm.gpu_memory_utilization=0"], "rollout.vllm.gpu_memory_utilization", "> 0.0"),
    (["rollout.vllm.kv_cache_memory_gb=-1"], "rollout.vllm.kv_cache_memory_gb", "> 0.0"),
    (["rollout.vllm.dtype=int8"], "rollout.vllm.dtype", "float32"),
    (["rollout.vllm.dtype=float16"], "rollout.vllm.dtype", "on CPU"),
    (["rollout.vllm.max_model_len=5"], "rollout.vllm.max_model_len", "max_new_tokens=10"),
    (["rollout.vllm.max_model_len=4096"], "rollout.vllm.max_model_len", "max_position_embeddings=256"),
    (["rollout.vllm.max_num_seqs=0"], "rollout.vllm.max_num_seqs", ">= 1"),
    (["rollout.vllm.enforce_eager=maybe"], "rollout.vllm.enforce_eager", "bool"),
    (["rollout.vllm.tensor_parallel_size=2"], "rollout.vllm.tensor_parallel_size", "vllm:d1t2"),
    (["rollout.backend=vllm:d1t2"], "rollout.backend", "on CPU"),
    (["rollout.backend=vllm:d1p2", "cluster.n_gpus_per_node=2"], "rollout.backend", "pipeline"),
    (["rollout.vllm.swap_space=4"], "rollout.vllm.swap_space", "unknown"),
])
def test_bad_vllm_options_rejected_at_load(argv, key, words):
    msg = error_of(["rollout.backend=vllm:d1", *argv] if not argv[0].startswith("rollout.backend") else argv)
    assert key in msg and words in msg, msg


def test_tiny_model_context_limit():
    assert "gconfig.max_new_tokens" in error_of(["gconfig.max_new_tokens=300"])
    assert load_config(["gconfig.max_new_tokens=300", "actor.tiny.max_position_embeddings=512"])


def test_suspicious_settings_warn():
    with pytest.warns(ConfigWarning, match="gconfig.greedy"):
        load_config(["gconfig.greedy=true"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config([])  # defaults are warning-free


@pytest.mark.parametrize("argv, key, words", [
    (["actor.fipo_decay_rate=0"], "actor.fipo_decay_rate", "> 0.0"),
    (["actor.fipo_clip_ratio_c=1.0"], "actor.fipo_clip_ratio_c", "> 1.0"),
    (["actor.fipo_influence_clip_ratio=-0.1"], "actor.fipo_influence_clip_ratio", ">= 0.0"),
    (["actor.fipo_safety_threshold=0"], "actor.fipo_safety_threshold", "> 0.0"),
    (["actor.fipo_influence_clip_high_only=maybe"], "actor.fipo_influence_clip_high_only", "bool"),
    (["actor.loss=fipo", "actor.fipo_clip_ratio_c=1.2", "actor.eps_clip_higher=0.28"], "actor.fipo_clip_ratio_c",
     "must be > 1 + eps_high = 1.28"),
    (["actor.loss=fipo", "actor.fipo_clip_ratio_c=1.1"], "actor.fipo_clip_ratio_c", "must be > 1 + eps_high = 1.2 "),
    (["actor.loss=fipo", "actor.fipo_influence_clip_high_only=false", "actor.fipo_influence_clip_ratio=1.0"],
     "actor.fipo_influence_clip_ratio", "must stay positive"),
])
def test_fipo_keys_validated_at_load(argv, key, words):
    msg = error_of(argv + ["rollout.fixed_staleness=2"])
    assert key in msg and words in msg


def test_fipo_cross_rule_only_for_fipo_and_defaults_load():
    # the c > 1 + eps_high rule concerns FIPO only; another loss ignores the key
    assert load_config(["actor.fipo_clip_ratio_c=1.1"]).actor.fipo_clip_ratio_c == 1.1
    a = load_config(["actor.loss=fipo", "rollout.fixed_staleness=4"]).actor
    assert (a.loss, a.fipo_decay_rate, a.fipo_clip_ratio_c, a.fipo_influence_clip_ratio,
            a.fipo_influence_clip_high_only, a.fipo_safety_threshold) == ("fipo", 32.0, 10.0, 0.2, True, 10.0)
    from stalerl.training.actor import loss_config
    from recipe.fipo import fipo_params_from_config

    p = fipo_params_from_config(loss_config(load_config(["actor.loss=fipo", "actor.ppo_n_minibatches=2",
                                                         "actor.fipo_decay_rate=8", "actor.eps_clip_higher=0.28",
                                                         "actor.fipo_influence_clip_high_only=false"]).actor))
    assert (p.decay_rate, p.eps_high, p.influence_clip_high_only) == (8.0, 0.28, False)


def test_fipo_without_drift_warns():
    with pytest.warns(ConfigWarning, match=r"actor.loss=fipo acts only through the drift.*fixed_staleness"):
        load_config(["actor.loss=fipo"])
    for drift in (["rollout.fixed_staleness=4"], ["rollout.max_head_offpolicyness=2"],
                  ["actor.ppo_n_minibatches=2"]):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            cfg = load_config(["actor.loss=fipo", *drift])
        assert C.fipo_has_drift(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(["actor.loss=vanilla"])  # only FIPO needs drift


def test_direct_construction_is_validated():
    with pytest.raises(ConfigError, match="eps_clip"):
        C.ActorConfig(eps_clip=-1.0)
    with pytest.raises(ConfigError, match="scheduler.type"):
        ExperimentConfig(scheduler=_unchecked(C.SchedulerConfig, type="k8s"))
    with pytest.raises(ConfigError, match="pick one"):
        ExperimentConfig(rollout=C.RolloutConfig(fixed_staleness=1, max_head_offpolicyness=1))
    cfg = ExperimentConfig(train_dataset=C.DatasetConfig(batch_size=8))
    assert cfg.rollout.consumer_batch_size == 8  # ${train_dataset.batch_size} resolved without OmegaConf


def _unchecked(cls, **kwargs):
    with C._deferred_checks():
        return cls(**kwargs)


# ----------------------------------------------------------------------------------------------- saving / paths


def test_save_resolved_config_round_trip(tmp_path):
    cfg = load_config(["train_dataset.batch_size=8", "actor.c_clip=3.0", "actor.adv_norm=null",
                       "scheduler.slurm.time=1:00:00", "scheduler.slurm.extra_sbatch_args=[--qos=high]"])
    out = save_resolved_config(cfg, tmp_path / "run" / "config.yaml")
    assert out == tmp_path / "run" / "config.yaml"
    assert os.listdir(tmp_path / "run") == ["config.yaml"]  # no temp file left behind
    text = out.read_text()
    assert "${" not in text and "consumer_batch_size: 8" in text
    assert text == config_to_yaml(cfg)
    assert load_config(["--config", str(out)]) == cfg


def test_save_is_atomic(tmp_path, monkeypatch):
    target = tmp_path / "config.yaml"
    target.write_text("old: contents\n")
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(C.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])

    def broken_replace(src, dst):
        assert os.path.dirname(src) == os.path.dirname(str(dst))  # temp file is in the same directory
        assert open(src).read() == config_to_yaml(ExperimentConfig())  # fully written before the rename
        raise OSError("disk gone")

    monkeypatch.setattr(C.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk gone"):
        save_resolved_config(ExperimentConfig(), target)
    assert synced  # data was fsynced before the rename
    assert target.read_text() == "old: contents\n"  # old file untouched
    assert os.listdir(tmp_path) == ["config.yaml"]  # temp file cleaned up


def test_run_dir():
    cfg = load_config(["cluster.fileroot=/data/runs", "experiment_name=e", "trial_name=t"])
    assert str(run_dir(cfg)) == "/data/runs/e/t"


def test_apply_overrides(tmp_path):
    base = load_config(["train_dataset.batch_size=8"])
    new = apply_overrides(base, ["actor.loss=vanilla", "+actor.c_clip=3.0"])
    assert new.actor.loss == "vanilla" and new.actor.c_clip == 3.0 and new.rollout.consumer_batch_size == 8
    assert base.actor.loss == "m2po" and base.actor.c_clip is None  # input untouched
    path = save_resolved_config(base, tmp_path / "c.yaml")
    assert apply_overrides(path, ["seed=5"]).seed == 5
    with pytest.raises(ConfigError, match="did you mean"):
        apply_overrides(base, ["actor.los=vanilla"])


# ------------------------------------------------------------------------------------------------------ command line


def test_parse_args():
    path, overrides, flags = parse_args(["train.py", "--config", "a.yaml", "--dry-run", "x.y=1", "+z=2"])
    assert path == "a.yaml" and overrides == ["x.y=1", "z=2"]
    assert flags == {"dry_run": True, "plot": False, "help": False}
    assert parse_args(["--config=b.yaml", "--plot"])[0::2] == ("b.yaml", {"dry_run": False, "plot": True,
                                                                           "help": False})
    assert parse_args([]) == (None, [], {"dry_run": False, "plot": False, "help": False})
    assert parse_args(["-h"])[2]["help"] is True
    assert parse_args(["experiment_name=a=b"])[1] == ["experiment_name=a=b"]


@pytest.mark.parametrize("argv, fragment", [
    (["--config"], "--config needs a file"),
    (["--config", "a.yaml", "--config", "b.yaml"], "given twice"),
    (["--dryrun"], "did you mean '--dry-run'"),
    (["--actor.lr=1"], "without dashes"),
    (["~actor.backend"], "deleting keys is not supported"),
    (["actor.lr"], "expected key=value"),
])
def test_parse_args_errors(argv, fragment):
    with pytest.raises(ConfigError, match=fragment):
        parse_args(argv)


def test_flags_accepted_by_load_config(tmp_path):
    path = write_yaml(tmp_path, "seed: 3\n")
    assert load_config(["--dry-run", "--config", path, "--plot"]).seed == 3


def test_missing_or_malformed_config_file(tmp_path):
    assert "not found" in error_of(["--config", str(tmp_path / "nope.yaml")])
    assert "must be a mapping" in error_of(["--config", write_yaml(tmp_path, "- 1\n- 2\n")])
    assert "cannot parse YAML" in error_of(["--config", write_yaml(tmp_path, "actor: [1\n")])
    assert load_config(["--config", write_yaml(tmp_path, "")]) == ExperimentConfig()


def test_help_lists_every_field_with_help_and_default(capsys):
    with pytest.raises(SystemExit) as info:
        load_config(["--help", "scheduler.type=whatever"])  # help wins, nothing is validated
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out == format_help() + "\n"
    for key in leaf_keys():
        assert f"  {key}: " in out, key
    assert "[actor.optimizer] OptimizerConfig" in out and "[scheduler.slurm] SlurmConfig" in out
    assert "actor.m2_threshold: float = 0.04" in out
    assert "squared log-ratio" in out  # the help text itself
    assert "scheduler.type: str = local  {local|ray|slurm}" in out
    assert "eval_gconfig.greedy: bool = true" in out  # section defaults from the parent's factory
    assert "valid_dataset.batch_size: int = 256" in out
    assert "rollout.consumer_batch_size: int = ${train_dataset.batch_size}" in out


# ---------------------------------------------------------------------------------------------------- backends


@pytest.mark.parametrize("text, expected", [
    ("hf:d1", Backend("hf", 1, 1, 1)),
    ("sglang:d2", Backend("sglang", 2, 1, 1)),
    ("vllm:d1t2", Backend("vllm", 1, 2, 1)),
    ("sglang:d4p1t1", Backend("sglang", 4, 1, 1)),  # AReaL order
    ("vllm:d2t2p2", Backend("vllm", 2, 2, 2)),
    ("torch:d4", Backend("torch", 4, 1, 1)),
    (" FSDP:D2 ", Backend("fsdp", 2, 1, 1)),
])
def test_parse_backend_valid(text, expected):
    assert parse_backend(text) == expected


def test_backend_world_size_and_str():
    b = parse_backend("vllm:d2t2p2")
    assert b.world_size == 8 and str(b) == "vllm:d2t2p2" and str(parse_backend("hf:d1")) == "hf:d1"


@pytest.mark.parametrize("text, fragment", [
    ("sglang", "missing '<engine>:'"),
    ("sglang:", "missing parallel dimensions"),
    (":d1", "missing '<engine>:'"),
    ("sglang:x4", "unknown dimension 'x'"),
    ("sglang:t2", "'d<X>' is required"),
    ("sglang:d0", "must be >= 1"),
    ("sglang:d2d2", "given twice"),
    ("sglang:dt2", "needs a size"),
    ("sglang:d2-", "cannot parse"),
    ("sglang.d4p1t1+d4p1t1", "combined allocation strings"),
])
def test_parse_backend_invalid(text, fragment):
    with pytest.raises(ConfigError, match=fragment) as info:
        parse_backend(text)
    assert "<engine>:d<X>[t<T>][p<P>]" in str(info.value)


def test_parse_backend_engine_restriction():
    with pytest.raises(ConfigError, match=r"unknown engine 'sglan' \(did you mean 'sglang'\?\)") as info:
        parse_backend("sglan:d1", engines=C.ROLLOUT_ENGINES, key="rollout.backend")
    assert info.value.keys == ["rollout.backend"] and "rollout.backend" in str(info.value)


def test_schema_keys_cover_sections_and_leaves():
    keys = schema_keys()
    assert "actor" in keys and "actor.optimizer.lr" in keys and "actor.reward_norm.mean_level" in keys
    assert "scheduler.slurm.extra_sbatch_args" in keys and len(keys) == len(set(keys))


@pytest.mark.parametrize("override, key, fix", [("gconfig.top_p=0.9", "gconfig.top_p", "Fix: set gconfig.top_p=1.0"),
                                                ("gconfig.top_k=5", "gconfig.top_k", "Fix: set gconfig.top_k=0")])
def test_truncated_sampling_for_training_rollouts_is_refused_in_one_line(override, key, fix):
    # Before: accepted (top_k with a warning), and the on-policy log-ratio was negative on every token.
    msg = error_of([override])
    assert msg.count("\n") == 0, msg
    assert msg.startswith(f"invalid config: {key}: got ") and "full tempered softmax" in msg and fix in msg


@pytest.mark.parametrize("override", ["eval_gconfig.top_p=0.9", "eval_gconfig.top_k=5", "gconfig.top_p=1.0",
                                      "gconfig.top_k=0"])
def test_evaluation_sampling_and_untruncated_training_sampling_load(override):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config([override, "eval_gconfig.greedy=false"])
