"""The exchange: one door for every strategy's sums and broadcasts, chosen once per worker."""

import pytest
import torch

from sparkdl.comm.exchange import FlatExchange, Traffic
from sparkdl.config import SparkDLConfig
from sparkdl.training.strategy import StrategyContext
from tests.reference import make_tiny_net
from tests.workers import worker_context


def _context(world_size: int, exchange=None) -> StrategyContext:
    module = make_tiny_net()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    extra = {} if exchange is None else {"exchange": exchange}
    return StrategyContext(SparkDLConfig(), 0, world_size, torch.device("cpu"), module, optimizer, **extra)


def test_a_context_refuses_an_exchange_formed_for_another_world():
    assert _context(1).exchange.world_size == 1  # a single worker's, by default
    with pytest.raises(ValueError, match="the exchange serves 1 workers, the context 2"):
        _context(2)
    assert _context(2, FlatExchange(world_size=2)).exchange.world_size == 2


def test_one_workers_exchange_moves_nothing_and_counts_nothing():
    exchange = FlatExchange(world_size=1)
    weights = torch.arange(6, dtype=torch.float32)
    exchange.weighted_sum_([[("w", weights)]], own_weight=1.0)
    control = torch.tensor([3.0])
    exchange.sum_control_(control)
    assert weights.tolist() == list(range(6)) and control.item() == 3.0
    assert exchange.take_traffic() == Traffic()


def _two_workers(rank: int, path: str, compression: str, out, elsewhere: bool = False) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    try:
        runtime = SparkDLConfig().replace(compression=compression).runtime
        exchange = FlatExchange(2, None, runtime, successor_elsewhere=elsewhere and rank == 1)
        start = torch.zeros(1000)
        exchange.remember([("w", start.clone())])
        w = torch.full((1000,), float(rank + 1))  # rank 0 holds 1s, rank 1 holds 2s
        b = torch.full((10,), float(10 * (rank + 1)))
        exchange.weighted_sum_([[("w", w)], [("b", b)]], own_weight=[0.75, 0.25][rank])  # rows 3:1
        control = torch.tensor([float(rank + 1)])
        exchange.sum_control_(control)
        out.put((rank, w[:3].tolist(), b[:3].tolist(), control.item(), exchange.take_traffic()))
    finally:
        dist.destroy_process_group()


def _run_two(tmp_path, compression, elsewhere=False):
    ctx = worker_context()
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_two_workers, args=(r, str(tmp_path / "s"), compression, out, elsewhere))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    results = dict((r[0], r[1:]) for r in (out.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(30)
    return results


def test_a_weighted_sum_is_the_weighted_mean_on_both_workers_and_counts_a_ring_all_reduce(tmp_path):
    results = _run_two(tmp_path, "none")
    for rank in (0, 1):
        w, b, control, traffic = results[rank]
        assert w == [1.25] * 3 and b == [12.5] * 3 and control == 3.0  # 0.75 * 1 + 0.25 * 2, ...
        assert traffic == Traffic(bytes_sent=1010 * 4)  # ring of 2: each sends its whole payload once


def test_a_flat_ring_counts_what_a_rank_sends_to_a_successor_on_another_host_as_across_hosts(tmp_path):
    from sparkdl.comm.forming import Where, successor_elsewhere

    def where(rank: int, peers: tuple[str, ...]) -> Where:
        return Where(rank, len(peers), peers, torch.device("cpu"))

    two_hosts = ("10.0.0.1:7001", "10.0.0.1:7002", "10.0.0.2:7001", "10.0.0.2:7002")
    # the ring 0 -> 1 -> 2 -> 3 -> 0 crosses between hosts after ranks 1 and 3
    assert [successor_elsewhere(where(r, two_hosts)) for r in range(4)] == [False, True, False, True]
    assert not successor_elsewhere(where(0, ("10.0.0.1:7001", "10.0.0.1:7002")))  # one host
    assert not successor_elsewhere(where(0, ()))  # addresses unknown
    # rank 1 of 2 sends its ring share to rank 0 on another host: all of it leaves the host
    results = _run_two(tmp_path, "none", elsewhere=True)
    assert results[0][3] == Traffic(bytes_sent=1010 * 4)
    assert results[1][3] == Traffic(bytes_sent=1010 * 4, bytes_across_hosts=1010 * 4)


def test_a_compressed_weighted_sum_leaves_both_workers_with_the_same_bits_and_sends_less(tmp_path):
    results = _run_two(tmp_path, "1bit")
    (w0, b0, _, sent0), (w1, b1, _, sent1) = results[0], results[1]
    assert w0 == w1 and b0 == b1  # both decode the same payloads
    assert abs(w0[0] - 1.25) < 0.5  # 1 bit of a constant change keeps its size (a mean of magnitudes)
    assert 0 < sent0.bytes_sent == sent1.bytes_sent < 1010 * 4 / 16
