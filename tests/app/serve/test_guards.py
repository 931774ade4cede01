"""The isolation guards (app/serve/guards.py): all on in every server built from settings, and each one
really skipped in a server assembled with it off."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import re
import types
from pathlib import Path

import anyio
import pytest
import torch
import xxhash

from front_keys import FRONT

from kvfence.app.cli import main
from kvfence.app.config.config import ServeConfig, load_config
from kvfence.app.config.settings import declared
from kvfence.app.serve.guards import Guards
from kvfence.app.serve.pairing import pair_workers, role_record
from kvfence.app.serve.server import serve
from kvfence.app.serve.workers import build_workers
from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.kv_pool import POISON_VALUE, SCRUB_MODES, UNSCRUBBED, KVPool
from kvfence.engine.protocol import PageGrant, RunStep, StepDone
from kvfence.engine.runner import SeqWork
from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.core.actions import StartTransfer
from kvfence.transports.core import digest
from kvfence.transports.core.front_key import FrontKey, FrontPublicKey
from kvfence.transports.core.secret import AuthenticationFailed, DeploymentSecret
from kvfence.transports.registry import create_transport
from kvfence.transports.wire import seal

A, B = (7 << 100) | 1, (9 << 90) | 5  # two 128-bit leases
ROOT = Path(__file__).resolve().parents[3]
# What a name of a setting or variable that switched a guard would contain.
GUARD_WORDS = re.compile(r"owner|tag|digest|capabilit|seal|scrub|guard|verif|encrypt|insecure", re.I)


def test_every_guard_is_on_unless_a_program_says_otherwise(caplog: pytest.LogCaptureFixture) -> None:
    names = [f.name for f in dataclasses.fields(Guards)]
    assert names == ["owner_tags", "digests", "capabilities", "sealing", "scrub"]
    assert Guards().off() == [] and Guards.none().off() == names
    assert inspect.signature(serve).parameters["guards"].default == Guards()
    assert Guards().endpoint_options() == {}  # a guarded server builds its endpoints as it always did
    with pytest.raises(dataclasses.FrozenInstanceError):
        Guards().sealing = False  # type: ignore[misc]
    caplog.set_level(logging.WARNING, logger="kvfence.app.serve.guards")
    Guards().warn()
    assert caplog.records == []
    Guards(scrub=False).warn()
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("ISOLATION GUARDS OFF: scrub.")


def test_no_setting_flag_variable_or_toml_key_names_a_guard() -> None:
    for d in declared(ServeConfig):
        names = (d.dest, d.flag, d.env, d.toml_key, *d.setting.env_aliases)
        if d.dest == "kv_scrub":  # it chooses how freed pages are scrubbed, never whether (below)
            continue
        assert not any(GUARD_WORDS.search(name) for name in names), names
    # the variables the package reads itself, beside the settings
    package = [p for folder in ("app", "engine", "scheduler", "transports", "kernels")
               for p in (ROOT / folder).rglob("*.py")]
    variables = {v for p in package for v in re.findall(r"KVFENCE_[A-Z_]+", p.read_text())}
    assert variables and not [v for v in variables if GUARD_WORDS.search(v)]
    # what reads settings never builds guards: only code that assembles a server does
    for module in ("cli.py", "config/config.py", "config/settings.py", "remote/worker_process.py", "remote/front.py"):
        assert "Guards" not in (ROOT / "app" / module).read_text(), module


def test_no_setting_leaves_freed_pages_unscrubbed(tmp_path: Path) -> None:
    assert UNSCRUBBED not in SCRUB_MODES
    toml = tmp_path / "kvfence.toml"
    toml.write_text('[pools]\nkv_scrub = "off"\n')
    for flags, environ, file in (({"kv_scrub": "off"}, {}, None), ({}, {"KVFENCE_KV_SCRUB": "off"}, None),
                                 ({}, {}, toml)):
        with pytest.raises(ValueError, match="--kv-scrub"):
            load_config(flags, environ, file)
    with pytest.raises(SystemExit):
        main(["serve", "--kv-scrub", "off"])


def test_guards_can_be_off_only_in_one_process_over_tcp(tiny: Checkpoint) -> None:
    for flags in ({"discovery": "static://127.0.0.1:1,127.0.0.1:2"}, {"transport": "inprocess"}):
        with pytest.raises(ValueError, match="only in one process, over tcp"):
            anyio.run(serve, load_config(flags, {}, None), tiny, "tiny", None, Guards.none())


@pytest.mark.parametrize("guards", [Guards(), Guards.none()], ids=["on", "off"])
def test_workers_check_owner_tags_and_scrub_unless_their_guards_are_off(tiny: Checkpoint, guards: Guards) -> None:
    config = load_config(dict(max_context=64, page_size_tokens=4, prefill_num_pages=32, decode_num_pages=32,
                              prefill_device="cpu", decode_device="cpu", dtype="float32"), {}, None)
    workers = build_workers(config, tiny, guards=guards)
    try:
        assert workers.decode is not None
        for worker in (workers.prefill, workers.decode):
            assert worker.runner.owner_check is guards.owner_tags
            assert worker.scrub == ("poison" if guards.scrub else UNSCRUBBED)
        worker = workers.decode
        compute = workers.compute_of(worker)
        # pages 0 and 1 are A's; B's table names them
        assert isinstance(compute.call(worker.execute, RunStep(step_id=1, seqs=[], grants=[PageGrant(A, [0, 1])])),
                          StepDone)
        out = compute.call(worker.runner.step, [SeqWork.local(token_ids=[5, 6, 7], context_tokens=0, page_table=[0, 1],
                                                        lease=B, sampling=SamplingParams(temperature=0))])
        assert (out.tokens[0] is None, len(out.violations)) == ((True, 1) if guards.owner_tags else (False, 0))
        # released pages are poisoned, or keep their bytes
        worker.pool.data[2].fill_(1.0)
        compute.call(worker.execute, RunStep(step_id=2, seqs=[], released=[2]))
        assert worker.pool.data[2].eq(POISON_VALUE if guards.scrub else 1.0).all()
    finally:
        workers.close()


@dataclasses.dataclass
class Calls:
    aes: int = 0  # AES-GCM records sealed or opened
    xxh3: int = 0  # page digests computed
    signed: int = 0  # capabilities minted
    verified: int = 0  # capabilities checked


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Calls:
    """Counts of what each transport guard does, from here on in this process."""
    counts = Calls()

    def counted(field: str, fn):  # type: ignore[no-untyped-def]
        @functools.wraps(fn)
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            setattr(counts, field, getattr(counts, field) + 1)
            return fn(*args, **kwargs)
        return call

    real_aesgcm = seal.AESGCM

    class CountingAESGCM:
        def __init__(self, key: bytes) -> None:
            aead = real_aesgcm(key)
            self.encrypt_into = counted("aes", aead.encrypt_into)
            self.decrypt_into = counted("aes", aead.decrypt_into)

    monkeypatch.setattr(seal, "AESGCM", CountingAESGCM)
    monkeypatch.setattr(digest, "xxhash", types.SimpleNamespace(
        xxh3_64=counted("xxh3", xxhash.xxh3_64), xxh3_64_hexdigest=counted("xxh3", xxhash.xxh3_64_hexdigest)))
    monkeypatch.setattr(FrontKey, "capability", counted("signed", FrontKey.capability))
    monkeypatch.setattr(FrontPublicKey, "capability_ok", counted("verified", FrontPublicKey.capability_ok))
    return counts


@pytest.mark.anyio
@pytest.mark.parametrize("guards", [Guards(), Guards.none()], ids=["on", "off"])
async def test_a_transfer_seals_digests_and_carries_a_capability_unless_their_guards_are_off(
        tiny: Checkpoint, guards: Guards, calls: Calls) -> None:
    prefill, decode = (KVPool(tiny.config, 8, 4, torch.float32) for _ in range(2))
    prefill.data.normal_()
    async with anyio.create_task_group() as tg:
        paired = await pair_workers(tg, "tcp", (prefill, role_record(prefill, "m", 16, guards)),
                                    (decode, role_record(decode, "m", 16, guards)), DeploymentSecret.generate(),
                                    FRONT, guards=guards)
        try:
            assert paired.peer.info.record.digest == ("xxh3_64" if guards.digests else "none")
            plan = StartTransfer(key=1, request_id="r", num_tokens=8, src_lease=A, src_pages=[0, 1], dst_lease=B,
                                 dst_pages=[5, 6])
            moved = await paired.link.move(plan, timeout_s=30)
            assert moved.ok, moved.reason
            assert torch.equal(decode.data[5:7], prefill.data[0:2])
        finally:
            for endpoint in paired.endpoints:
                await endpoint.aclose()
    done = dataclasses.asdict(calls)
    if guards == Guards():
        assert all(done.values()), done
    else:
        assert not any(done.values()), done


@pytest.mark.anyio
async def test_a_sealed_end_never_pairs_with_an_unsealed_one(tiny: Checkpoint) -> None:
    secret = DeploymentSecret.generate()
    pools = [KVPool(tiny.config, 4, 4, torch.float32) for _ in range(2)]
    async with anyio.create_task_group() as tg:
        sealed = create_transport("tcp", secret=secret, front_key=FRONT.public)
        unsealed = create_transport("tcp", secret=secret, front_key=FRONT.public, sealed=False)
        try:
            info = await sealed.start(tg, pools[0].data, role_record(pools[0], "m", 16))
            await unsealed.start(tg, pools[1].data, role_record(pools[1], "m", 16))
            with pytest.raises(AuthenticationFailed):
                await unsealed.pair(info)
        finally:
            for endpoint in (sealed, unsealed):
                await endpoint.aclose()
