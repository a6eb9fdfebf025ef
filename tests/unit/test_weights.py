"""The weights channel without Spark: the codec, the driver's server and the task's client
on real loopback sockets, and building a module around received tensors."""

from __future__ import annotations

import dataclasses
import gc
import socket
import threading
from collections.abc import Mapping

import pytest
import torch

from sparkdl.errors import ProtocolError, WeightTransferError
from sparkdl.services.weights import codec, protocol
from sparkdl.services.weights.client import download, upload
from sparkdl.services.weights.codec import (
    StateAssembler,
    byte_chunks,
    decode_manifest,
    encode_manifest,
    manifest_of,
)
from sparkdl.services.weights.protocol import ENTRY_BYTES, MANIFEST_PARSE_FACTOR
from sparkdl.services.weights.server import (
    KEEP_RELEASED,
    MAX_UPLOADS_PER_SLOT,
    WeightServer,
    default_upload_budget,
)
from sparkdl.training.factory import module_with_state
from sparkdl.wire.refusals import close_quietly


class Owner:
    """Stands for a TorchModel: an offer lives as long as its owner."""


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("steps", torch.tensor(3))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def mixed_state() -> dict[str, torch.Tensor]:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    shared = torch.randn(5, 3)
    return {
        "matrix": torch.randn(3, 4),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 7),
        "half": torch.randn(6, dtype=torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
        "ids": torch.arange(5),
        "transposed": base.t(),  # not contiguous: sent as its contiguous copy
        "tied_a": shared,
        "tied_b": shared,
    }


def roundtrip(state, chunk_bytes: int) -> dict[str, torch.Tensor]:
    entries, tensors = manifest_of(state)
    assembler = StateAssembler(decode_manifest(encode_manifest(entries)))
    for data in byte_chunks(tensors, chunk_bytes):
        assembler.add(bytes(data))
    return assembler.finish()


@pytest.fixture
def server():
    server = WeightServer("127.0.0.1", timeout_s=10.0)
    yield server
    server.stop()


@pytest.mark.parametrize("chunk_bytes", [1, 7, 1 << 20])
def test_a_state_dict_of_every_kind_of_tensor_survives_the_codec_whatever_the_chunking(chunk_bytes):
    state = mixed_state()
    got = roundtrip(state, chunk_bytes)
    assert list(got) == list(state)
    for name, tensor in state.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert got["tied_a"] is got["tied_b"]  # one tensor, as sent


def test_a_tied_tensor_is_sent_once():
    entries, tensors = manifest_of(mixed_state())
    assert [e.alias for e in entries if e.alias] == ["tied_a"]
    assert len(tensors) == len(entries) - 1


@pytest.mark.parametrize(
    ("manifest", "complaint"),
    [
        (b"not json", "not valid JSON"),
        (b'[["w", "float32", [2], ""], ["w", "float32", [2], ""]]', "repeated"),
        (b'[["w", "object", [2], ""]]', "dtype"),
        (b'[["w", "float32", [-1], ""]]', "shape"),
        (b'[["w", "float32", [2], "later"]]', "aliases"),
        (b'{"w": 1}', "list"),
        (b'[["w", "float32", [1000000000000000000000000000000], ""]]', "shape"),
        (b'[["w", "float32", [1099511627776, 1099511627776], ""]]', "shape"),
        (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
        (b'[["w", "float32", [2], ""], ["v", "int64", [7, 7], "w"]]', "another dtype or shape"),
    ],
)
def test_a_malformed_manifest_is_refused_with_what_is_wrong(manifest, complaint):
    with pytest.raises(ProtocolError, match=complaint):
        decode_manifest(manifest)


def test_the_assembler_refuses_a_stream_longer_or_shorter_than_its_manifest():
    entries, _ = manifest_of({"w": torch.zeros(4)})
    assembler = StateAssembler(entries)
    with pytest.raises(ProtocolError, match="announced 16"):
        assembler.add(bytes(17))
    assembler.add(bytes(8))
    with pytest.raises(ProtocolError, match="after 8 of the 16"):
        assembler.finish()


def test_a_task_downloads_an_offered_state_and_a_fit_uploads_one(server):
    owner, state = Owner(), mixed_state()
    got = download(server.offer(state, owner, "v1"))
    assert all(torch.equal(got[k], v) for k, v in state.items())
    inbox = server.expect_upload()
    sent = upload(inbox.endpoint, state)
    received = inbox.take()
    assert sent == sum(t.numel() * t.element_size() for t in manifest_of(state)[1])
    assert received is not None and all(torch.equal(received[k], v) for k, v in state.items())
    assert received["tied_a"] is received["tied_b"]
    assert not server.serves(inbox.endpoint.slot)  # taken: the slot is closed


def test_an_upload_over_its_slots_budget_is_refused_before_anything_is_allocated(server, monkeypatch, caplog):
    """Before, an authenticated task could announce up to the 1 TiB manifest cap per tensor
    and the driver allocated it all up front; now the slot's budget (half the free memory,
    or what the driver says) refuses the manifest, and a real upload still lands."""
    allocated = []
    real = codec.StateAssembler.__init__

    def watched(self, entries):
        allocated.append(sum(e.nbytes for e in entries))
        real(self, entries)

    monkeypatch.setattr(codec.StateAssembler, "__init__", watched)
    inbox = server.expect_upload(budget=4096 + ENTRY_BYTES)
    with pytest.raises(WeightTransferError):
        upload(inbox.endpoint, {"w": torch.zeros(2048)})  # 8 KiB announced
    assert allocated == []  # refused at the manifest
    refusal = (
        "an upload of 10240 bytes (8192 of tensors, 2048 for each of its 1 entries), with 0 bytes "
        "under way, is over the slot's budget of 6144 bytes"
    )
    assert refusal in caplog.text
    assert inbox.refusal().startswith(refusal)  # what fit adds to the worker's "Broken pipe"
    upload(inbox.endpoint, {"w": torch.ones(1024)})  # 4 KiB and its entry: within it
    received = inbox.take()
    assert received is not None and torch.equal(received["w"], torch.ones(1024))
    assert allocated == [4096]


def empty_tensors(count: int, name: str = "e") -> dict[str, torch.Tensor]:
    return {f"{name}{i}": torch.zeros(0, dtype=torch.bool) for i in range(count)}


def test_a_manifest_is_charged_its_parse_before_its_payload_is_read(server, monkeypatch):
    """Before, a 64 MiB manifest frame was read and parsed whatever the slot's budget (six
    such uploads held 380 MB on a 1 MiB budget). Now the length its authenticated header
    announces, times what parsing costs, is reserved first: over the budget, the payload is
    never read, let alone parsed."""
    parsed = []
    real = protocol.decode_manifest
    monkeypatch.setattr(
        protocol, "decode_manifest", lambda payload: parsed.append(len(payload)) or real(payload)
    )
    inbox = server.expect_upload(budget=1 << 20)
    attack = empty_tensors(30_000, "block.running_statistics.")  # a manifest of about 1.4 MB
    length = len(codec.encode_manifest(manifest_of(attack)[0]))
    with pytest.raises(WeightTransferError):
        upload(inbox.endpoint, attack)
    assert parsed == []
    assert inbox.refusal().startswith(
        f"a manifest of {length} bytes ({MANIFEST_PARSE_FACTOR} per byte to parse), with 0 bytes under "
        "way, is over the slot's budget of 1048576 bytes"
    )
    upload(inbox.endpoint, {"w": torch.ones(4)})  # a real model's manifest is parsed and lands
    assert len(parsed) == 1 and torch.equal(inbox.take()["w"], torch.ones(4))


def test_each_manifest_entry_is_charged_against_the_budget_even_an_empty_tensor(server):
    """Before, 300,000 empty tensors counted 0 bytes against the budget and held 269 MB of
    Python and torch objects on the driver (11 s of CPU); now each entry counts ENTRY_BYTES."""
    inbox = server.expect_upload(budget=1 << 20)
    with pytest.raises(WeightTransferError):
        upload(inbox.endpoint, empty_tensors(600))  # 600 entries: 1.2 MB, parsed within 1 MiB
    assert inbox.refusal().startswith(
        "an upload of 1228800 bytes (0 of tensors, 2048 for each of its 600 entries), with 0 bytes "
        "under way, is over the slot's budget of 1048576 bytes"
    )
    upload(inbox.endpoint, empty_tensors(400))  # 819,200 bytes: within it
    received = inbox.take()
    assert received is not None and len(received) == 400


class Stalled(Mapping):
    """A state dict whose upload stops after the driver's ACK, until ``go`` is set: the
    upload's connection stays open, as a slow (or hostile) sender's does."""

    def __init__(self, state: dict[str, torch.Tensor], started: threading.Semaphore, go: threading.Event):
        self._state, self._started, self._go = state, started, go

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._state[name]

    def __len__(self) -> int:
        return len(self._state)

    def __iter__(self):
        self._started.release()
        self._go.wait(10)
        return iter(self._state)


def test_a_slot_takes_two_uploads_at_once_and_refuses_a_third(server):
    """Before, as many uploads as the listener's 256 sessions could each hold the slot's budget
    at once; now a slot takes MAX_UPLOADS_PER_SLOT (a re-run stage's rank 0 beside a dying
    one), and a third is refused before its ACK, said in the slot's refusal."""
    inbox = server.expect_upload(budget=1 << 20)
    started, go = threading.Semaphore(0), threading.Event()
    results: list[object] = []

    def stalled_upload(value: float) -> None:
        try:
            results.append(upload(inbox.endpoint, Stalled({"w": torch.full((4,), value)}, started, go)))
        except WeightTransferError as exc:
            results.append(exc)

    threads = [threading.Thread(target=stalled_upload, args=(v,), daemon=True) for v in (1.0, 2.0)]
    for thread in threads:
        thread.start()
    assert all(started.acquire(timeout=10) for _ in threads)  # both were ACKed and stall
    with pytest.raises(WeightTransferError):
        upload(inbox.endpoint, {"w": torch.zeros(4)})
    assert inbox.refusal() == (
        f"an upload into slot {inbox.endpoint.slot} while 2 are under way; a slot takes "
        f"{MAX_UPLOADS_PER_SLOT} at once (a fit's rank 0, and a re-run stage's beside it)"
    )
    go.set()
    for thread in threads:
        thread.join(10)
    assert results == [16, 16]  # the two under way land
    upload(inbox.endpoint, {"w": torch.full((4,), 3.0)})  # and once they ended, another gets in
    assert torch.equal(inbox.take()["w"], torch.full((4,), 3.0))


def test_the_default_budget_is_half_the_available_memory_not_the_free(tmp_path):
    """Linux's page cache leaves little memory free on a busy host with much available: a
    budget of half the free memory refused an 805 MB model's upload in a CI run."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(
        "MemTotal:       24684000 kB\nMemFree:          400000 kB\nMemAvailable:   20000000 kB\n"
    )
    assert default_upload_budget(str(meminfo)) == 20_000_000 * 1024 // 2
    meminfo.write_text("MemTotal: 24684000 kB\nMemFree: 400000 kB\n")  # before Linux 3.14
    assert 0 < default_upload_budget(str(meminfo))  # the free memory, from sysconf
    assert default_upload_budget() > 0  # this host's


def test_the_same_unchanged_tensors_keep_their_slot_and_changed_ones_get_a_new_one(server):
    owner = Owner()
    state = {"w": torch.zeros(3)}
    first = server.offer(state, owner, "v1")
    assert server.offer(state, owner, "v1") == first
    second = server.offer(state, owner, "v2")
    assert second.slot != first.slot and second.key != first.key


def test_an_offer_outlives_its_model_only_among_the_newest_released_ones(server):
    kept = []
    endpoints = []
    for i in range(KEEP_RELEASED + 2):
        owner = Owner()
        endpoints.append(server.offer({"w": torch.full((2,), float(i))}, owner, i))
        kept.append(owner)
    alive = kept.pop()  # the newest model stays referenced
    kept.clear()
    gc.collect()
    server.expect_upload().close()  # released offers are pruned at the next offer or upload
    served = [server.serves(e.slot) for e in endpoints]
    assert served == [False] + [True] * KEEP_RELEASED + [True]
    with pytest.raises(WeightTransferError, match="Keep a reference to the model"):
        download(endpoints[0])
    assert torch.equal(download(endpoints[-1])["w"], torch.full((2,), float(KEEP_RELEASED + 1)))
    del alive


def test_a_slot_is_refused_under_another_slots_secret_or_for_the_other_direction(server):
    owner = Owner()
    offered = server.offer({"w": torch.ones(2)}, owner, 1)
    inbox = server.expect_upload()
    wrong_secret = dataclasses.replace(offered, secret=inbox.endpoint.secret)
    with pytest.raises(WeightTransferError):
        download(wrong_secret)
    as_download = dataclasses.replace(inbox.endpoint)
    with pytest.raises(WeightTransferError):
        download(as_download)  # an upload slot is not readable
    with pytest.raises(WeightTransferError):
        upload(offered, {"w": torch.zeros(2)})  # an offer is not writable
    assert inbox.take() is None
    assert torch.equal(download(offered)["w"], torch.ones(2))


def test_an_upload_altered_on_the_wire_is_refused_and_nothing_is_stored(server):
    """A relay flips one byte of the weights stream: the frame's tag fails, the driver
    keeps nothing and the uploading task gets an error."""
    inbox = server.expect_upload()
    relay = socket.create_server(("127.0.0.1", 0))
    relay_endpoint = dataclasses.replace(inbox.endpoint, port=relay.getsockname()[1])

    def forward() -> None:
        client, _ = relay.accept()
        upstream = socket.create_connection((server.host, server.port))
        seen = 0

        def back() -> None:
            try:
                while data := upstream.recv(65536):
                    client.sendall(data)
            except OSError:
                pass
            close_quietly(client)

        threading.Thread(target=back, daemon=True).start()
        try:
            while data := client.recv(65536):
                if seen < 2000 <= seen + len(data):  # inside the first chunk's tensor bytes
                    data = bytearray(data)
                    data[2000 - seen] ^= 0xFF
                seen += len(data)
                upstream.sendall(data)
        except OSError:
            pass
        close_quietly(upstream)

    thread = threading.Thread(target=forward, daemon=True)
    thread.start()
    with pytest.raises(WeightTransferError):
        upload(relay_endpoint, {"w": torch.randn(4096)})
    thread.join(10)
    relay.close()
    assert inbox.take() is None


def test_a_module_built_around_received_tensors_holds_them_and_keeps_tied_weights_tied():
    source = Tied()
    state = {k: v.detach().clone() for k, v in source.state_dict().items()}
    module = module_with_state(Tied, state)
    assert module.embed.weight is module.head.weight
    assert module.embed.weight.data_ptr() == state["embed.weight"].data_ptr()  # no copy
    assert module.embed.weight.requires_grad and int(module.steps) == 3
    assert torch.equal(module(torch.tensor([1, 2])), source(torch.tensor([1, 2])))


_PRETRAINED = {"weight": torch.full((2, 2), 7.0), "bias": torch.zeros(2)}


class _LoadsItsBody(torch.nn.Module):
    """A model_fn's model that loads pre-trained weights into its body itself."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(2, 2)
        self.body.load_state_dict(_PRETRAINED)


def test_a_module_built_on_the_meta_device_warns_nothing_of_the_weights_its_model_fn_loads(recwarn):
    state = {k: torch.ones_like(v) for k, v in _LoadsItsBody().state_dict().items()}
    recwarn.clear()
    module = module_with_state(_LoadsItsBody, state)
    assert torch.equal(module.body.weight, torch.ones(2, 2))  # the state given, not the body's own
    assert not [str(w.message) for w in recwarn if "meta parameter" in str(w.message)]


def test_a_module_with_tensors_the_state_lacks_is_built_normally_and_loaded():
    class WithTable(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(2, 2)
            self.register_buffer("table", torch.arange(3.0), persistent=False)

    state = {k: torch.ones_like(v) for k, v in WithTable().state_dict().items()}
    module = module_with_state(WithTable, state)
    assert torch.equal(module.table, torch.arange(3.0))
    assert torch.equal(module.linear.weight, torch.ones(2, 2))


def test_a_large_released_model_is_not_kept_beside_the_next_one(server, monkeypatch):
    from sparkdl.services.weights import server as serving

    monkeypatch.setattr(serving, "RELEASED_BYTES", 1024)
    big_owner, small_owner = Owner(), Owner()
    big = server.offer({"w": torch.zeros(512)}, big_owner, 1)  # 2 KB: over the budget
    del big_owner
    gc.collect()
    assert server.serves(big.slot)  # released, but still the newest offer: a lazy transform needs it
    small = server.offer({"w": torch.zeros(16)}, small_owner, 1)
    del small_owner
    gc.collect()
    server.expect_upload().close()  # prunes
    assert not server.serves(big.slot) and server.serves(small.slot)


def test_an_owner_collected_while_the_server_holds_its_lock_does_not_deadlock_it(server):
    """The collector may run an offer's finalizer inside any allocation, also one made while
    this very thread holds the server's lock (seen: offer() -> gc -> _release, stuck)."""
    owner = Owner()
    offered = server.offer({"w": torch.zeros(2)}, owner, 1)
    done = threading.Event()

    def release_under_the_lock() -> None:
        with server._lock:
            server._release(offered.slot)
        done.set()

    thread = threading.Thread(target=release_under_the_lock, daemon=True)
    thread.start()
    assert done.wait(5), "the finalizer blocked on the server's lock"
    server.offer({"w": torch.ones(2)}, Owner(), 1)  # the next offer prunes: still served, newest-but-one
    assert server.serves(offered.slot)


def test_fits_side_by_side_share_the_server_and_each_gets_its_own_weights(server):
    """The one process-wide weights server under eight fits at once from threads (issue 58):
    each offers its model, uploads its trained weights and reads both back, all interleaved;
    every thread gets its own, and every slot is its own."""
    from concurrent.futures import ThreadPoolExecutor

    def fit(index: int) -> tuple[bool, bool, int, int]:
        owner, state = Owner(), {"w": torch.full((64,), float(index)), "b": torch.arange(index + 1.0)}
        offered = server.offer(state, owner, f"v{index}")
        inbox = server.expect_upload()
        upload(inbox.endpoint, {"w": state["w"] * 2})
        got, trained = download(offered), inbox.take()
        return (
            all(torch.equal(got[k], v) for k, v in state.items()),
            trained is not None and torch.equal(trained["w"], state["w"] * 2),
            offered.slot,
            inbox.endpoint.slot,
        )

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(fit, range(8)))
    assert all(own_offer and own_upload for own_offer, own_upload, _, _ in results)
    slots = [slot for _, _, offer, inbox in results for slot in (offer, inbox)]
    assert len(set(slots)) == 16
