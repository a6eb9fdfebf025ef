import dataclasses
import re
from pathlib import Path

import pytest

from sparkdl import ConfigError, SparkDLConfig, TorchEstimator, load_config
from sparkdl.apps.train_job import load_job_config
from sparkdl.config import (
    SECTIONS,
    Compression,
    DrillKind,
    FaultDrillSpec,
    PsMode,
    Strategy,
    flat_field_owners,
    parse_override,
)
from sparkdl.config.loading import section_owners
from sparkdl.strategies import check_settings

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_every_shipped_config_loads():
    from sparkdl.apps.etl_job import load_etl_config
    from sparkdl.apps.stream_job import load_stream_config

    paths = sorted((ROOT / "conf").glob("*.toml"))
    assert {p.name for p in paths} >= {"local.toml", "cluster.toml", "gpu.toml", "etl.toml", "stream.toml"}
    loaders = {"etl": load_etl_config, "stream": load_stream_config}
    for path in paths:
        config = loaders.get(path.stem, load_job_config)(path)
        assert config.sparkdl.training.num_workers >= 1, path


def test_file_values_land_in_typed_fields(tmp_path):
    path = write(
        tmp_path,
        '[training]\nbatch_size = 16\nstrategy = "allreduce"\n'
        '[runtime]\ncompression = "fp16"\ncollective_timeout_s = 5\n',
    )
    config = load_config(path)
    assert config.training.batch_size == 16
    assert config.training.strategy is Strategy.ALLREDUCE
    assert config.runtime.compression is Compression.FP16
    assert config.runtime.collective_timeout_s == 5.0 and isinstance(
        config.runtime.collective_timeout_s, float
    )


def test_unknown_key_names_the_file_section_and_key(tmp_path):
    path = write(tmp_path, "[training]\nbatch_sise = 16\n")
    with pytest.raises(
        ConfigError, match=r"c\.toml \[training\]: unknown key 'batch_sise'; did you mean 'batch_size'\?$"
    ):
        load_config(path)
    with pytest.raises(
        ConfigError,
        match=r"unknown key 'zzz'; valid keys: accumulate_steps, activation_checkpointing, batch_size, "
        r"compile, compile_backend, early_stop",
    ):
        load_config(write(tmp_path, "[training]\nzzz = 1\n"))


def test_a_misspelt_set_option_is_blamed_on_the_option_not_the_file():
    # issue 54 item 6: jobs/train.py --config conf/local.toml --set training.batchsize=3
    with pytest.raises(ConfigError) as info:
        load_job_config(ROOT / "conf/local.toml", ["training.batchsize=3"])
    message = str(info.value)
    assert message == (
        "--set training.batchsize=3: unknown key 'batchsize' in [training]; "
        "did you mean 'batch_size'? (--set training.batch_size=3)"
    )
    assert "local.toml" not in message


def test_each_error_names_where_its_setting_came_from(tmp_path):
    path = write(tmp_path, "[training]\nbatch_sise = 16\n")
    with pytest.raises(ConfigError, match=r"^\S*c\.toml \[training\]: unknown key 'batch_sise'"):
        load_config(path, ["training.epochs=2"])  # the file's key, whatever the command line adds
    path = write(tmp_path, "[training]\nepochs = 2\n")
    with pytest.raises(ConfigError, match=r"^--set trainig\.epochs=3: unknown section 'trainig'"):
        load_config(path, ["trainig.epochs=3"])
    with pytest.raises(
        ConfigError, match=r"^--set training\.epochs=three: training\.epochs = 'three' must be of type int$"
    ):
        load_config(path, ["training.epochs=three"])
    with pytest.raises(ConfigError) as info:
        load_config(path, ["training.batch_size=0"])
    assert str(info.value) == (
        "training.batch_size = 0 must be > 0 ([training] settings given by --set: "
        f"training.batch_size=0; the others come from {path})"
    )
    with pytest.raises(ConfigError, match=r"c\.toml \[training\] epochs = 'three' must be of type int$"):
        load_config(write(tmp_path, '[training]\nepochs = "three"\n'), ["training.batch_size=4"])


def test_unknown_section_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown section 'trainig'; did you mean 'training'\?"):
        load_config(write(tmp_path, "[trainig]\nepochs = 1\n"))


def test_a_job_file_given_to_the_library_loader_says_which_loader_reads_it():
    with pytest.raises(
        ConfigError, match=r"\[job\], \[spark\] belong to a job's config file.*load_job_config"
    ):
        load_config(ROOT / "conf/local.toml")


def test_strategy_settings_live_in_the_section_named_after_their_strategy(tmp_path):
    path = write(
        tmp_path,
        "[weight_averaging]\nsync_every = 4\naverage_optimizer_state = false\n"
        '[parameter_server]\nps_mode = "ssp"\nstaleness = 3\nps_shards = 2\nps_timeout_s = 9\n',
    )
    config = load_config(path, ["parameter_server.push_every=5"])
    assert config.weight_averaging.sync_every == 4
    assert config.weight_averaging.average_optimizer_state is False
    assert config.parameter_server.ps_mode is PsMode.SSP
    assert (config.parameter_server.staleness, config.parameter_server.ps_shards) == (3, 2)
    assert config.parameter_server.ps_timeout_s == 9.0
    assert config.parameter_server.push_every == 5
    owners = flat_field_owners()
    assert {owners[n] for n in ("sync_every", "average_optimizer_state", "wa_backup_workers")} == {
        "weight_averaging"
    }
    moved = (
        "ps_mode",
        "staleness",
        "push_every",
        "pull_every",
        "ps_timeout_s",
        "ps_shards",
        "ps_max_frame_mb",
    )
    assert {owners[n] for n in moved} == {"parameter_server"}
    assert owners["compression"] == owners["bucket_cap_mb"] == owners["teardown_timeout_s"] == "runtime"


@pytest.mark.parametrize(
    ("override", "owner"),
    [
        ("training.sync_every=8", "weight_averaging"),
        ("training.average_optimizer_state=false", "weight_averaging"),
        ('training.ps_mode="async"', "parameter_server"),
        ("training.staleness=1", "parameter_server"),
        ("runtime.ps_timeout_s=5", "parameter_server"),
        ("runtime.ps_shards=2", "parameter_server"),
        ('parameter_server.compression="fp16"', "runtime"),
    ],
)
def test_a_key_in_the_wrong_section_names_the_section_it_belongs_in(tmp_path, override, owner):
    section, key = override.split("=")[0].split(".")
    value = override.split("=")[1]
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, ""), [override])
    assert str(info.value) == (
        f"--set {override}: {key} belongs in [{owner}]; write --set {owner}.{key}={value}"
    )
    with pytest.raises(ConfigError, match=rf"{section}\.{key}: {key} belongs in \[{owner}\]"):
        load_config(write(tmp_path, f"[{section}]\n{key} = {override.split('=')[1]}\n"))


def test_a_misspelt_key_is_matched_across_sections(tmp_path):
    with pytest.raises(
        ConfigError, match=r"unknown key 'ps_timout_s'; did you mean parameter_server\.ps_timeout_s"
    ):
        load_config(write(tmp_path, "[runtime]\nps_timout_s = 5\n"))


def test_the_flat_surface_is_unchanged_by_the_sections():
    config = SparkDLConfig().replace(sync_every=3, ps_mode="async", staleness=0, teardown_timeout_s=5)
    assert config.weight_averaging.sync_every == 3
    assert config.parameter_server.ps_mode is PsMode.ASYNC
    assert config.parameter_server.staleness == 0
    assert config.runtime.teardown_timeout_s == 5.0
    flat = config.flat()
    assert (flat["sync_every"], flat["ps_mode"], flat["teardown_timeout_s"]) == (3, "async", 5.0)
    assert set(flat) == set(flat_field_owners())
    assert len(flat) == sum(len(dataclasses.fields(cls)) for cls in SECTIONS.values())


def test_teardown_timeout_defaults_to_a_minute_and_must_be_positive():
    assert SparkDLConfig().runtime.teardown_timeout_s == 60.0
    with pytest.raises(ConfigError, match=r"runtime\.teardown_timeout_s = 0\.0 must be > 0"):
        SparkDLConfig().replace(teardown_timeout_s=0.0)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_bounded_setting_must_be_a_finite_number(value):
    with pytest.raises(
        ConfigError, match=rf"parameter_server\.ps_timeout_s = {value} must be a finite number > 0"
    ):
        SparkDLConfig().replace(ps_timeout_s=value)


def test_a_setting_name_declared_by_two_sections_fails_naming_both():
    @dataclasses.dataclass(frozen=True)
    class Averaging:
        sync_every: int = 8

    @dataclasses.dataclass(frozen=True)
    class Training:
        epochs: int = 1
        sync_every: int = 4

    with pytest.raises(ConfigError, match=r"'sync_every' is declared in both \[averaging\] and \[training\]"):
        section_owners({"averaging": Averaging, "training": Training})
    assert section_owners(SECTIONS) == flat_field_owners()  # the library's own sections pass


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rasie:1:5:/tmp/m", r"'rasie' is not a drill kind.*KIND one of raise, exit, hang, killjvm"),
        ("raise:one:5:/tmp/m", r"RANK = 'one' must be an integer >= 0"),
        ("exit:1:5.5:/tmp/m", r"STEP = '5\.5' must be an integer >= 0"),
        ("hang:1:-2:", r"STEP = '-2' must be an integer >= 0"),
        ("raise:1:5", r"the form is KIND:RANK:STEP:MARKER_FILE"),
    ],
)
def test_a_bad_fault_drill_fails_when_the_config_is_built(tmp_path, text, message):
    with pytest.raises(ConfigError, match=rf"reliability\.fault_injection = '{re.escape(text)}'.*{message}"):
        SparkDLConfig().replace(fault_injection=text)
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, f'[reliability]\nfault_injection = "{text}"\n'))


def test_the_fault_drill_is_parsed_into_a_typed_spec():
    assert SparkDLConfig().reliability.drill is None
    config = SparkDLConfig().replace(fault_injection="KillJVM:1:12:/tmp/fired:once")
    assert config.reliability.drill == FaultDrillSpec(DrillKind.KILLJVM, 1, 12, "/tmp/fired:once")
    assert FaultDrillSpec.parse("raise:0:3:") == FaultDrillSpec(DrillKind.RAISE, 0, 3, "")


def test_wrong_type_and_bad_choice_are_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"\[training\] epochs = .three. must be of type int"):
        load_config(write(tmp_path, '[training]\nepochs = "three"\n'))
    with pytest.raises(ConfigError, match="choose one of 'allreduce'"):
        load_config(write(tmp_path, '[training]\nstrategy = "gossip"\n'))


def test_overrides_beat_the_file(tmp_path):
    path = write(tmp_path, "[training]\nepochs = 7\nbatch_size = 8\n")
    config = load_config(path, ["training.epochs=3", 'data.feature_cols=["a", "b"]'])
    assert config.training.epochs == 3
    assert config.training.batch_size == 8
    assert config.data.feature_cols == ("a", "b")


def test_override_syntax_errors_show_the_form():
    with pytest.raises(ConfigError, match=r"section\.key=value"):
        parse_override("epochs=3")
    assert parse_override("data.label_col=y") == ("data", "label_col", "y")
    assert parse_override("training.shuffle=false") == ("training", "shuffle", False)


def test_cross_field_rules_give_the_fix():
    with pytest.raises(ConfigError, match="batch_size = 0 must be > 0"):
        SparkDLConfig().replace(batch_size=0)
    with pytest.raises(ConfigError, match="set backend = 'gloo' or 'auto'"):
        SparkDLConfig().replace(backend="nccl", use_gpu="false")
    with pytest.raises(ConfigError, match="is also a feature column"):
        SparkDLConfig().replace(feature_cols=["label"])


def test_weight_averaging_backups_must_leave_a_worker_to_end_each_period():
    with pytest.raises(
        ConfigError,
        match=r"^wa_backup_workers = 2 must be < num_workers = 2: .* set wa_backup_workers to at most 1 "
        r"\(0 waits for every worker\), or raise num_workers$",
    ):
        check_settings(
            SparkDLConfig().replace(strategy="weight_averaging", num_workers=2, wa_backup_workers=2)
        )
    with pytest.raises(ConfigError, match=r"weight_averaging\.wa_backup_workers = -1 must be >= 0"):
        SparkDLConfig().replace(wa_backup_workers=-1)
    config = check_settings(
        SparkDLConfig().replace(
            strategy="weight_averaging", num_workers=3, wa_backup_workers=2, compression="1bit"
        )
    )
    assert config.weight_averaging.wa_backup_workers == 2  # every worker still joins each average
    unused = check_settings(SparkDLConfig().replace(num_workers=1, wa_backup_workers=1))
    assert unused.training.num_workers == 1


def test_a_strategys_rules_stop_the_estimator_and_the_job_before_any_worker_starts(tmp_path):
    # The config layer checks each section's values; what a strategy cannot combine with
    # is that strategy's rule (sparkdl.strategies), applied wherever a fit's settings are made.
    combination = {
        "strategy": "weight_averaging",
        "sync_every": 4,
        "checkpoint_every": 6,
        "checkpoint_dir": str(tmp_path),
    }
    assert SparkDLConfig().replace(**combination).reliability.checkpoint_every == 6
    refusal = r"^checkpoint_every = 6 is not a multiple of sync_every = 4; weight averaging checkpoints"
    with pytest.raises(ConfigError, match=refusal):
        check_settings(SparkDLConfig().replace(**combination))
    with pytest.raises(ConfigError, match=refusal):
        TorchEstimator(model_fn=lambda: None, **combination)
    estimator = TorchEstimator(
        model_fn=lambda: None, strategy="weight_averaging", sync_every=4, checkpoint_dir=str(tmp_path)
    )
    with pytest.raises(ConfigError, match=refusal):
        estimator.copy({estimator.checkpoint_every: 6}).get_config()  # Spark's Params do not check
    path = write(tmp_path, '[training]\nstrategy = "fsdp"\n[runtime]\ncompression = "fp16"\n')
    with pytest.raises(ConfigError, match=r"compression = 'fp16' is not available with strategy = 'fsdp'"):
        load_job_config(path)


def test_estimator_kwargs_and_config_describe_the_same_settings(tmp_path):
    path = write(tmp_path, "[training]\nepochs = 9\nbatch_size = 8\n")
    est = TorchEstimator(model_fn=lambda: None, config=str(path), batch_size=4)
    config = est.get_config()
    assert config.training.epochs == 9  # from the file
    assert config.training.batch_size == 4  # keyword beats file
    assert set(config.flat()) == {p.name for p in est.params}
    assert est.getOrDefault("batch_size") == 4


def test_estimator_rejects_unknown_settings_naming_the_close_one():
    with pytest.raises(ConfigError, match=r"^unknown setting 'batchsize'; did you mean 'batch_size'\?$"):
        TorchEstimator(model_fn=lambda: None, batchsize=3)
    with pytest.raises(ConfigError, match=r"unknown setting\(s\) 'qqq'; valid settings: .*batch_size"):
        TorchEstimator(model_fn=lambda: None, qqq=3)
    with pytest.raises(ConfigError, match="loss"):
        TorchEstimator(model_fn=lambda: None, loss_fn="hinge")


def test_pulls_come_in_fp32_or_bf16_never_fp16():
    assert (
        SparkDLConfig().replace(ps_pull_precision="bf16").parameter_server.ps_pull_precision.value == "bf16"
    )
    with pytest.raises(ConfigError, match=r"ps_pull_precision = 'fp16' could overflow .* use 'bf16'"):
        SparkDLConfig().replace(ps_pull_precision="fp16")


def test_the_parameter_server_refuses_fp16_before_any_worker_starts():
    with pytest.raises(
        ConfigError, match=r"precision = 'fp16' needs a gradient scaler .* use precision = 'bf16'"
    ):
        check_settings(SparkDLConfig().replace(strategy="parameter_server", precision="fp16"))


def test_the_parameter_servers_backups_must_leave_a_pusher_to_make_each_step():
    with pytest.raises(ConfigError, match=r"^backup_workers = 2 must be < num_workers = 2: .* at most 1 "):
        check_settings(SparkDLConfig().replace(strategy="parameter_server", num_workers=2, backup_workers=2))
    check_settings(SparkDLConfig().replace(strategy="allreduce", num_workers=2, backup_workers=2))  # unused


def test_a_url_for_the_memory_mapped_cache_is_refused_naming_the_scheme():
    """An ``hdfs://`` cache_dir was taken for a relative path; the cache memory-maps its
    files, which no object store serves, so it must be local."""
    with pytest.raises(ConfigError, match=r"cache_dir = 'hdfs://nn/cache' is a URL.*which hdfs:// cannot"):
        SparkDLConfig().replace(cache_dir="hdfs://nn/cache")
    with pytest.raises(ConfigError, match=r"give the path itself, without file://"):
        SparkDLConfig().replace(cache_dir="file:///mnt/run")
    assert SparkDLConfig().replace(cache_dir="/dbfs/runs/a").flat()["cache_dir"] == "/dbfs/runs/a"


def test_a_checkpoint_url_is_taken_where_its_filesystem_is_installed_and_refused_naming_it_where_not():
    pytest.importorskip("s3fs")
    assert (
        SparkDLConfig().replace(checkpoint_dir="s3://bucket/run").flat()["checkpoint_dir"]
        == "s3://bucket/run"
    )
    assert (
        SparkDLConfig().replace(checkpoint_dir="file:///mnt/run").flat()["checkpoint_dir"]
        == "file:///mnt/run"
    )
    with pytest.raises(ConfigError, match=r"checkpoint_dir = 'gs://b/r': gs:// needs the gcsfs package"):
        SparkDLConfig().replace(checkpoint_dir="gs://b/r")
