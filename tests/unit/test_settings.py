"""Settings explain themselves: one table, generated from the fields, shown everywhere."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from sparkdl import ConfigError, SparkDLConfig, TorchEstimator, load_config
from sparkdl.apps.settings import REGENERATE, job_settings, render_markdown, render_text
from sparkdl.config import SECTIONS
from sparkdl.config.loading import about
from sparkdl.config.table import library_settings, missing_meanings, toml_literal
from sparkdl.ml.estimator import choose_loss

ROOT = Path(__file__).resolve().parents[2]
ALL_NAMES = [s.name for s in library_settings()]


def _mse_by_hand(output, target):
    return ((output - target) ** 2).mean()


def test_the_table_has_one_row_per_field_of_every_section():
    rows = library_settings()
    assert [(s.section, s.name) for s in rows] == [
        (section, f.name) for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)
    ]
    by_name = {s.name: s for s in rows}
    assert by_name["sync_every"].section == "weight_averaging"
    assert (by_name["sync_every"].type, by_name["sync_every"].default_text) == ("int", "8")
    assert by_name["sync_every"].valid == "> 0"
    assert by_name["ps_mode"].valid == "one of sync, async, ssp"
    assert by_name["teardown_timeout_s"].default == 60.0
    assert by_name["feature_cols"].default_text == '["features"]'


def test_every_setting_has_a_meaning():
    assert missing_meanings(SECTIONS) == []
    assert all(s.meaning and s.valid for s in (*library_settings(), *job_settings()))


def test_a_setting_declared_without_a_meaning_is_caught():
    @dataclasses.dataclass(frozen=True)
    class Section:
        explained: int = dataclasses.field(default=1, metadata=about("Says what it does."))
        silent: int = 2

    assert missing_meanings({"new": Section}) == ["new.silent"]


def test_docs_settings_md_is_the_generated_table():
    text = (ROOT / "docs/settings.md").read_text()
    assert text == render_markdown(), f"docs/settings.md is out of step; regenerate it: {REGENERATE}"
    assert REGENERATE in text.splitlines()[2]  # the header says how


def test_python_m_sparkdl_settings_lists_every_setting():
    done = subprocess.run(
        [sys.executable, "-m", "sparkdl", "settings"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == render_text()
    for s in library_settings():
        assert re.search(rf"^  {s.name} = {re.escape(s.default_text)} ", done.stdout, re.M), s.name
    assert "\n[weight_averaging]\n" in done.stdout and "\n[parameter_server]\n" in done.stdout
    markdown = subprocess.run(
        [sys.executable, "-m", "sparkdl", "settings", "--format", "markdown"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert markdown.returncode == 0 and markdown.stdout == render_markdown()


def test_explain_params_gives_meaning_default_valid_values_and_section():
    text = TorchEstimator().explainParams()
    sync_every = next(line for line in text.splitlines() if line.startswith("sync_every:"))
    assert "Local optimizer steps between two averages of the weights" in sync_every
    assert "Default 8; valid: > 0" in sync_every and "[weight_averaging] sync_every" in sync_every
    assert "one of sync, async, ssp" in text


def test_the_estimator_docstring_lists_every_setting():
    doc = TorchEstimator.__doc__ or ""
    assert "Settings (keyword arguments" in doc
    for name in ALL_NAMES:
        assert re.search(rf"^\s+{name} \(", doc, re.M), name
    assert "[parameter_server]" in doc


@pytest.mark.parametrize(
    "attempt",
    [
        lambda: SparkDLConfig().replace(batch_sise=16),
        lambda: TorchEstimator(batch_sise=16),
    ],
    ids=["replace", "keyword"],
)
def test_a_misspelt_setting_says_did_you_mean_without_the_whole_list(attempt):
    with pytest.raises(ConfigError) as info:
        attempt()
    assert str(info.value) == "unknown setting 'batch_sise'; did you mean 'batch_size'?"


def test_a_misspelt_toml_key_or_override_says_did_you_mean(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[training]\nbatch_sise = 16\n")
    with pytest.raises(ConfigError, match=r"did you mean 'batch_size'\?$") as info:
        load_config(path)
    assert "epochs" not in str(info.value)
    path.write_text("")
    with pytest.raises(
        ConfigError,
        match=r"^--set training\.batch_sise=16: unknown key 'batch_sise' in \[training\]; "
        r"did you mean 'batch_size'\? \(--set training\.batch_size=16\)$",
    ):
        load_config(path, ["training.batch_sise=16"])


@pytest.mark.parametrize(
    ("loss_fn", "loss", "chosen"),
    [
        (None, "mse", "mse"),
        ("mse", "cross_entropy", "mse"),  # loss left at its default: loss_fn wins
        ("mse", "mse", "mse"),
        (_mse_by_hand, "cross_entropy", _mse_by_hand),
    ],
)
def test_loss_fn_wins_only_over_the_default_or_the_same_loss(loss_fn, loss, chosen):
    assert choose_loss(loss_fn, loss) == chosen


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "bce_with_logits", _mse_by_hand])
def test_loss_fn_and_a_different_loss_setting_is_an_error_naming_both(loss_fn):
    shown = loss_fn if isinstance(loss_fn, str) else "_mse_by_hand"
    with pytest.raises(ConfigError, match=rf"loss_fn = '{shown}' and the setting loss = 'mse'.*drop one"):
        TorchEstimator(model_fn=lambda: None, loss_fn=loss_fn, loss="mse")


def test_a_loss_from_the_config_file_conflicts_like_a_keyword(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[training]\nloss = "mse"\n')
    with pytest.raises(ConfigError, match=r"loss_fn = 'cross_entropy' and the setting loss = 'mse'"):
        TorchEstimator(model_fn=lambda: None, loss_fn="cross_entropy", config=str(path))


def test_a_named_loss_fn_becomes_the_loss_setting():
    est = TorchEstimator(model_fn=lambda: None, loss_fn="mse")
    assert est.getOrDefault("loss") == "mse" and est.loss_fn is None
    with_callable = TorchEstimator(model_fn=lambda: None, loss_fn=_mse_by_hand)
    assert with_callable.loss_fn is _mse_by_hand
    with_callable.set(with_callable.getParam("loss"), "bce_with_logits")  # e.g. a ParamGridBuilder
    with pytest.raises(ConfigError, match="name different losses"):
        with_callable._loss()


def _listed_settings(text: str) -> dict[str, dict[str, tuple[str, bool]]]:
    """Per section: each key of conf/local.toml, its value text and whether it is commented out."""
    listed: dict[str, dict[str, tuple[str, bool]]] = {}
    section = ""
    for line in text.splitlines():
        header = re.match(r"^\[([\w.]+)\]", line)
        key = re.match(r"^(#\s*)?([A-Za-z_]\w*)\s*=\s*(.*?)\s*(#.*)?$", line)
        if header:
            section = header.group(1)
        elif key:
            name = key.group(2)
            assert name not in listed.get(section, {}), f"[{section}] {name} listed twice"
            listed.setdefault(section, {})[name] = (key.group(3), bool(key.group(1)))
    return listed


def test_local_toml_lists_every_setting_and_its_comments_hold_the_defaults():
    text = (ROOT / "conf/local.toml").read_text()
    assert "main job's choice of values" in text.splitlines()[0]
    listed = _listed_settings(text)
    for s in (*library_settings(), *(s for s in job_settings() if s.section in ("job", "spark"))):
        value, commented = listed.get(s.section, {}).get(s.name, ("", False))
        if s.name == "conf":
            continue  # the [spark.conf] table
        assert value, f"conf/local.toml does not list [{s.section}] {s.name}"
        if commented:
            parsed = tomllib.loads(f"v = {value}")["v"]
            assert toml_literal(parsed) == s.default_text, f"# {s.name} = {value} is not the default"
