"""Every command's options come from their declarations (app/config/command_options.py): each flag, its
KVFENCE_<COMMAND>_<NAME> variable and its key in the command's table of the --config file, in the
usual order (defaults < file < variables < flags); `serve` ignores the commands' tables."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfence.app.config import settings
from kvfence.app.config.command_options import COMMANDS, declared_root, load_options
from kvfence.app.config.config import load_config, read_config_file


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_comes_from_the_declarations(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    from kvfence.app.cli import main

    args = [command, "--help"]
    with pytest.raises(SystemExit):
        main(args)
    text = "".join(capsys.readouterr().out.split())  # argparse wraps lines, at hyphens too
    for d in settings.declared(declared_root(command)):
        assert d.flag in text and "".join(d.setting.help.split()) in text, d.toml_key


def test_a_file_a_variable_and_a_flag_each_set_an_option_in_that_order(tmp_path: Path) -> None:
    config = tmp_path / "kvfence.toml"
    config.write_text('[probe]\nkey = "from-file"\ntimeout_s = 5\ncontext = 900\n\n[generate]\nstop = ["a", "b"]\n')
    table = read_config_file(config)
    opts = load_options("probe", {}, {}, table, config)
    assert (opts.key, opts.timeout_s, opts.context, opts.progress) == ("from-file", 5.0, 900, True)
    opts = load_options("probe", {}, {"KVFENCE_PROBE_KEY": "from-env"}, table, config)
    assert opts.key == "from-env"
    opts = load_options("probe", {"probe_key": "from-flag", "probe_progress": False},
                        {"KVFENCE_PROBE_KEY": "from-env"}, table, config)
    assert (opts.key, opts.progress) == ("from-flag", False)
    assert load_options("generate", {}, {}, table, config).stop == ("a", "b")
    assert load_options("generate", {}, {"KVFENCE_GENERATE_STOP": '["x"]'}, table, config).stop == ("x",)
    assert load_options("generate", {}, {"KVFENCE_GENERATE_STOP": "end"}, {}, None).stop == ("end",)
    load_config({}, {}, config)  # serve reads the same file and leaves the commands' tables to them


def test_the_old_variables_still_name_their_options() -> None:
    opts = load_options("status", {}, {"KVFENCE_ADMIN_KEY": "k", "KVFENCE_TRANSPORT_SECRET_FILE": "/s"}, {}, None)
    assert (opts.admin_key, opts.transport_secret_file) == ("k", "/s")


@pytest.mark.parametrize(("command", "table", "message"), [
    ("probe", '[probe]\ntimeout_s = 0\n', "--timeout must be > 0"),
    ("probe", '[probe]\nkeys = "x"\n', "unknown setting 'probe.keys'"),
    ("worker", '[worker]\nrole = "colocated"\n', "--role must be 'prefill' or 'decode'"),
    ("generate", '[generate]\nstop = [1]\n', "--stop must be a list of strings"),
])
def test_a_bad_option_is_refused_by_its_name(command: str, table: str, message: str, tmp_path: Path) -> None:
    config = tmp_path / "kvfence.toml"
    config.write_text(table)
    with pytest.raises(ValueError, match=message):
        load_options(command, {}, {}, read_config_file(config), config)


def test_repeated_flags_add_up(capsys: pytest.CaptureFixture[str]) -> None:
    from kvfence.app.cli import _build_parser

    args = _build_parser().parse_args(["generate", "hi", "--stop", "a", "--stop", "b", "--no-json"])
    opts = load_options("generate", vars(args), {}, {}, None)
    assert (opts.stop, opts.json, opts.max_tokens) == (("a", "b"), False, 64)
