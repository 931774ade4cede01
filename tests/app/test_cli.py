"""`kvfence generate` as a user runs it: a real subprocess on the default model."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest


def kvfence(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvfence.app.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env, check=False)


def case(reference: dict, kind: str) -> dict:
    return next(c for c in reference["cases"] if c["kind"] == kind)


def test_generate_json_equals_reference(reference: dict, default_model_path: Path) -> None:
    c = case(reference, "completion")
    proc = kvfence("generate", "--model", str(default_model_path), "--json", "--max-tokens", "12",
                   "--ignore-eos", c["prompt"])
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["prompt_token_ids"] == c["prompt_token_ids"]
    assert out["generated_token_ids"] == c["greedy_ids"][:12]
    assert c["text_until_eos"].startswith(out["text"])


def test_generate_chat_wraps_the_prompt(reference: dict, default_model_path: Path) -> None:
    c = next(c for c in reference["cases"] if c["kind"] == "chat" and len(c["messages"]) == 1)
    proc = kvfence("generate", "--model", str(default_model_path), "--chat", "--json", "--max-tokens", "6",
                   c["messages"][0]["content"])
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["prompt_token_ids"] == c["prompt_token_ids"]
    assert out["generated_token_ids"] == c["greedy_ids"][:6]


def test_seeded_sampling_reproduces(default_model_path: Path) -> None:
    args = ("generate", "--model", str(default_model_path), "--json", "--max-tokens", "10",
            "--temperature", "0.9", "--seed", "7", "Once upon a time")
    first, second = kvfence(*args), kvfence(*args)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["generated_token_ids"] == json.loads(second.stdout)["generated_token_ids"]


@pytest.mark.parametrize("args, message", [
    (("--model", "/nonexistent/model.gguf", "hi"), "neither an existing path nor a known model"),
    (("--temperature", "-1", "hi"), "--temperature must be >= 0"),
    (("--max-tokens", "0", "hi"), "--max-tokens must be > 0"),
    (("--dtype", "int3", "hi"), "--dtype 'int3'"),
])
def test_bad_input_is_a_clear_error(args: tuple[str, ...], message: str, default_model_path: Path) -> None:
    proc = kvfence("generate", *args)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("transport", ["nixl", "mooncake"])
@pytest.mark.parametrize("command", [("serve",), ("worker", "--role", "decode", "--control", "127.0.0.1:9")])
def test_a_one_sided_transport_without_the_operators_consent_is_refused_before_anything_starts(
        command: tuple[str, ...], transport: str) -> None:
    """Its engine's own ports authenticate no one: the refusal says so, and what to do instead."""
    proc = kvfence(*command, "--transport", transport)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "authenticate no one" in proc.stderr and f"--{transport}-unauthenticated-ports-ok" in proc.stderr


def test_fetch_failure_names_the_step(tmp_path: Path) -> None:
    env = dict(os.environ, KVFENCE_HOME=str(tmp_path), PIP_INDEX_URL="http://127.0.0.1:9/simple",
               PIP_EXTRA_INDEX_URL="", PIP_FIND_LINKS="", PIP_NO_INDEX="0", PIP_RETRIES="0", PIP_TIMEOUT="2")
    proc = kvfence("fetch", env=env)
    assert proc.returncode == 2
    assert "step 'download'" in proc.stderr and "--model" in proc.stderr


@pytest.mark.parametrize("command", ["serve", "check"])
def test_help_comes_from_the_declarations(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    from kvfence.app.cli import main
    from kvfence.app.config import settings
    from kvfence.app.config.config import ServeConfig

    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for d in settings.declared(ServeConfig):
        assert d.flag in text and " ".join(d.setting.help.split()) in text, d.toml_key


def test_config_reference_prints_the_generated_table(capsys: pytest.CaptureFixture[str]) -> None:
    from kvfence.app.cli import main
    from kvfence.app.config.config import config_reference

    assert main(["config-reference"]) == 0
    assert capsys.readouterr().out == config_reference()


def test_front_key_writes_a_pair_once_and_a_worker_needs_its_public_half(tmp_path: Path) -> None:
    from kvfence.transports.core.front_key import FrontKey, FrontPublicKey

    key, public = tmp_path / "front.key", tmp_path / "front.pub"
    made = kvfence("front-key", "--key", str(key), "--public", str(public))
    assert made.returncode == 0, made.stderr
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert FrontKey.from_file(key).public.raw() == FrontPublicKey.from_file(public).raw()
    assert FrontPublicKey.from_file(public).fingerprint in made.stdout
    again = kvfence("front-key", "--key", str(key), "--public", str(tmp_path / "other.pub"))
    assert again.returncode == 2 and "never overwritten" in again.stderr
    secret = tmp_path / "secret"
    secret.write_text("s" * 64)
    secret.chmod(0o600)
    worker = ("worker", "--role", "decode", "--control", "127.0.0.1:9", "--transport-secret-file", str(secret))
    proc = kvfence(*worker)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--front-public-key-file" in proc.stderr and "kvfence front-key" in proc.stderr
    proc = kvfence(*worker, "--front-public-key-file", str(key))  # the private half is not a public key
    assert proc.returncode == 2 and "not an Ed25519 public key" in proc.stderr
