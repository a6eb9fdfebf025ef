from pathlib import Path

import pytest

from sparkdl import ConfigError, SparkDLConfig, TorchEstimator, load_config
from sparkdl.config import Compression, Strategy, parse_override
from sparkdl.job import load_job_config

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_every_shipped_config_loads():
    from sparkdl.etl import load_etl_config

    paths = sorted((ROOT / "conf").glob("*.toml"))
    assert {p.name for p in paths} >= {"local.toml", "cluster.toml", "gpu.toml", "etl.toml"}
    for path in paths:
        loader = load_etl_config if path.name.startswith("etl") else load_job_config
        config = loader(path)
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
        ConfigError, match=r"c\.toml \[training\]: unknown key\(s\) batch_sise; valid keys: .*batch_size"
    ):
        load_config(path)


def test_unknown_section_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown section.*trainig"):
        load_config(write(tmp_path, "[trainig]\nepochs = 1\n"))


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


def test_estimator_kwargs_and_config_describe_the_same_settings(tmp_path):
    path = write(tmp_path, "[training]\nepochs = 9\nbatch_size = 8\n")
    est = TorchEstimator(model_fn=lambda: None, config=str(path), batch_size=4)
    config = est.get_config()
    assert config.training.epochs == 9  # from the file
    assert config.training.batch_size == 4  # keyword beats file
    assert set(config.flat()) == {p.name for p in est.params}
    assert est.getOrDefault("batch_size") == 4


def test_estimator_rejects_unknown_settings_listing_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown setting.*batchsize.*valid settings: .*batch_size"):
        TorchEstimator(model_fn=lambda: None, batchsize=3)
    with pytest.raises(ConfigError, match="loss"):
        TorchEstimator(model_fn=lambda: None, loss_fn="hinge")
