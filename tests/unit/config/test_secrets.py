"""Secrets in the configuration: credentials taken out of the tracking URI, config errors
that never print a secret's value, ``--set`` values kept as written, and a password read from
a variable or a file. No Spark, no MLflow: the configuration alone."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from flowers_job.config import ConfigError, JobConfig, load_config, parse_overrides
from flowers_job.config.secrets import is_secret_name, redact_uri, split_userinfo

pytestmark = pytest.mark.tier("gate")

PLANTED = "pw-secret-c0nf1g-9f8e"
"""A password planted in the settings: found in no dump, repr or error message."""


def _load(tmp_path: Path, *overrides: str, path: Path | None = None) -> JobConfig:
    return load_config(path, list(overrides), **{"paths.output_dir": tmp_path / "out"})


def _error(tmp_path: Path, *overrides: str, path: Path | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, *overrides, path=path)
    return str(info.value)


def test_credentials_in_a_server_uri_move_to_username_and_password(tmp_path: Path) -> None:
    """``https://alice:<pw>@host`` is stored as ``https://host``; the user name and the
    password (percent-decoded) become the settings MLflow's variables are exported from, and
    nothing the job dumps, prints or hands to the ranks holds the password."""
    uri = f"https://alice:{PLANTED}%40x@mlflow.example.com:5000/base"
    cfg = _load(tmp_path, f"tracking.tracking_uri={uri}")
    assert cfg.tracking.tracking_uri == "https://mlflow.example.com:5000/base"
    assert cfg.tracking_uri == "https://mlflow.example.com:5000/base"
    assert cfg.tracking.username == "alice"
    assert cfg.tracking.password is not None
    assert cfg.tracking.password.get_secret_value() == f"{PLANTED}@x"
    dumped = cfg.model_dump(mode="json")  # the job sent to the ranks, MLflow's params
    assert PLANTED not in repr(dumped) and PLANTED not in repr(cfg) and PLANTED not in str(cfg)
    # the ranks rebuild the configuration from the dump: same URI, no password
    again = JobConfig.model_validate(dumped)
    assert again.tracking_uri == cfg.tracking_uri and again.tracking.password is None


def test_a_uri_without_credentials_is_kept_as_written(tmp_path: Path) -> None:
    for uri in ("http://127.0.0.1:5000", "databricks://scope:prefix", "postgresql://u@db/mlflow"):
        assert _load(tmp_path, f"tracking.tracking_uri={uri}").tracking.tracking_uri == uri


def test_a_password_in_a_database_store_uri_is_refused_without_echo(tmp_path: Path) -> None:
    """SQLAlchemy would need the password inside the URI the job stores and passes on: it is
    refused, the message shows the URI with ``***`` and names where the driver reads one."""
    text = _error(tmp_path, f"tracking.tracking_uri=postgresql://mlf:{PLANTED}@db:5432/mlflow")
    assert PLANTED not in text
    assert "tracking.tracking_uri:" in text and "postgresql://mlf:***@db:5432/mlflow" in text
    assert "PGPASSWORD" in text and ".pgpass" in text


def test_credentials_given_twice_are_refused(tmp_path: Path) -> None:
    uri = f"tracking.tracking_uri=https://alice:{PLANTED}@host"
    text = _error(tmp_path, uri, "tracking.username=bob")
    assert "tracking.username: differs" in text and PLANTED not in text
    text = _error(tmp_path, uri, "tracking.password=other-pw")
    assert "tracking.password: given both" in text and PLANTED not in text
    text = _error(tmp_path, uri, "tracking.password_env=SOME_VAR")
    assert "tracking.password: given both" in text


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["tracking.pasword=" + PLANTED], "tracking.pasword"),  # misspelt: a close match
        (["tracking.passwd=" + PLANTED], "tracking.passwd"),
        (["tracking.api_key=" + PLANTED], "tracking.api_key"),  # a secret's word
        (["tracking.client_secret=" + PLANTED], "tracking.client_secret"),
        (["trackin.password=" + PLANTED], "trackin"),  # a section holding a secret
        (["tracking.tokn=" + PLANTED], "tracking.tokn"),
    ],
)
def test_config_errors_name_a_secret_field_but_never_print_its_value(
    tmp_path: Path, overrides: list[str], field: str
) -> None:
    text = _error(tmp_path, *overrides)
    assert f"  {field}: " in text
    assert PLANTED not in text and "value not shown" in text


def test_a_secret_of_the_wrong_type_in_a_file_is_not_printed(tmp_path: Path) -> None:
    """``tracking.password: 12345678`` in YAML is an int: the error names the field only."""
    path = tmp_path / "job.yaml"
    path.write_text("tracking:\n  username: ann\n  password: 12345678\n")
    text = _error(tmp_path, path=path)
    assert "tracking.password: Input should be a valid string" in text
    assert "12345678" not in text


def test_other_config_errors_still_show_the_value(tmp_path: Path) -> None:
    """The hiding is for secrets only: a wrong epoch count is still quoted, and a URI in a
    value shows its password as ``***``."""
    assert "(got 'abc')" in _error(tmp_path, "train.epochs=abc")
    path = tmp_path / "job.yaml"
    path.write_text(f"tracking:\n  tracking_uri: [https://a:{PLANTED}@h]\n")
    text = _error(tmp_path, path=path)
    assert "https://a:***@h" in text and PLANTED not in text
    text = _error(tmp_path, f"tracking.tracking_uri=[https://a:{PLANTED}@h]")
    assert "tracking.tracking_uri: not a valid URI" in text and PLANTED not in text


@pytest.mark.parametrize("raw", ["Secret #1", "*abc", "@x", "!x", "~", "null", "'q'", " sp ", "3"])
def test_set_keeps_a_text_settings_value_as_written(tmp_path: Path, raw: str) -> None:
    """YAML would cut ``Secret #1`` at the comment, refuse ``*abc`` (an alias), read ``!x``
    as a tag, ``~``/``null`` as None and ``3`` as an int: a text setting keeps the text."""
    cfg = _load(tmp_path, "tracking.username=ann", f"tracking.password={raw}")
    assert cfg.tracking.password is not None
    assert cfg.tracking.password.get_secret_value() == raw
    assert _load(tmp_path, f"tracking.run_name={raw}").tracking.run_name == (
        None if raw == "null" else raw  # null unsets an optional setting that is no secret
    )


def test_set_still_parses_yaml_for_other_settings() -> None:
    tree = parse_overrides(["train.epochs=3", "distributed.local_mode=false", "cache.x=[1, 2]"])
    assert tree == {
        "train": {"epochs": 3},
        "distributed": {"local_mode": False},
        "cache": {"x": [1, 2]},
    }


def test_a_yaml_error_in_set_names_the_key_and_never_a_secret_value() -> None:
    with pytest.raises(ConfigError) as info:
        parse_overrides([f"tracking.api_key=*{PLANTED}"])  # unknown key: parsed as YAML
    assert str(info.value).startswith("--set tracking.api_key: the value is not valid YAML")
    assert PLANTED not in str(info.value)
    with pytest.raises(ConfigError) as info:
        parse_overrides([f"tracking.password:{PLANTED}"])  # no "=": the item is not echoed
    assert PLANTED not in str(info.value) and "expected KEY=VALUE" in str(info.value)
    with pytest.raises(ConfigError, match="found undefined alias 'x'"):
        parse_overrides(["train.epochs=*x"])  # not a secret: YAML's reason is shown


def test_a_yaml_error_in_a_config_file_quotes_no_secret_line(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(f"tracking:\n  username: ann\n  password: *{PLANTED}\n")
    text = _error(tmp_path, path=path)
    assert "not valid YAML at line 3" in text and PLANTED not in text


def test_a_password_on_the_command_line_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="flowers_job.config.load"):
        parse_overrides([f"tracking.password={PLANTED}", "tracking.password_env=PW"])
    (record,) = caplog.records
    assert "--set tracking.password:" in record.getMessage()
    assert PLANTED not in caplog.text


def test_the_password_comes_from_a_variable_or_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("H4_TRACKING_PW", PLANTED)
    cfg = _load(tmp_path, "tracking.username=ann", "tracking.password_env=H4_TRACKING_PW")
    resolved = cfg.tracking.resolved_password()
    assert resolved is not None and resolved.get_secret_value() == PLANTED
    assert PLANTED not in repr(cfg.model_dump(mode="json"))

    secret_file = tmp_path / "pw.txt"
    secret_file.write_text(f"{PLANTED} #1\n")
    cfg = _load(tmp_path, f"tracking.password_file={secret_file}")
    resolved = cfg.tracking.resolved_password()
    assert resolved is not None and resolved.get_secret_value() == f"{PLANTED} #1"

    cfg = _load(tmp_path, f"tracking.password_file={tmp_path / 'missing.txt'}")
    with pytest.raises(ConfigError, match=r"tracking.password_file: cannot read .*missing.txt"):
        cfg.tracking.resolved_password()
    secret_file.write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        _load(tmp_path, f"tracking.password_file={secret_file}").tracking.resolved_password()
    monkeypatch.delenv("H4_TRACKING_PW")
    with pytest.raises(ConfigError, match="H4_TRACKING_PW is not set"):
        _load(tmp_path, "tracking.password_env=H4_TRACKING_PW").tracking.resolved_password()
    text = _error(tmp_path, "tracking.password_env=A", f"tracking.password_file={secret_file}")
    assert "tracking.password_file: give one of" in text


def test_secret_names_and_uri_helpers() -> None:
    assert is_secret_name("tracking.pasword") and is_secret_name("x.aws_secret_access_key")
    assert not is_secret_name("tracking.username") and not is_secret_name("train.epochs")
    assert redact_uri("https://a:b@h:1/p?q=1") == "https://a:***@h:1/p?q=1"
    assert redact_uri("http://h/x") == "http://h/x"
    assert split_userinfo("http://a:b%2Fc@[::1]:5000/") == ("http://[::1]:5000/", "a", "b/c")
