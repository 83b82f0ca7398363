from collections.abc import Callable
from backend_env import Variant
from conftest import only
from peer import Peer
from peers import hixl_peer
from test_hixl import Two, alloc, read_descs, write_descs, SCATTER
import hixl


@only("ascend-fake", "cpu-tcp")
def test_dbg(peers: Callable[..., Peer], variant: Variant) -> None:
    for op in ("READ", "WRITE"):
        two = Two(peers, variant)
        src, dst = two.buffers()
        dev = alloc(two.server, variant, "dev", 8192, "MEM_DEVICE", seed=3)
        assert two.server.call(hixl_peer.register, "dev", "MEM_DEVICE")[0] == hixl.SUCCESS
        assert two.client.call(hixl_peer.connect, two.server_id) == hixl.SUCCESS
        s0 = two.client.call(hixl_peer.snapshot, "dst")
        for name, descs in [("host only", read_descs(dst, src, SCATTER) if op == "READ" else write_descs(dst, src, SCATTER)),
                            ("dev only", [(dst + 13000, dev + 8000, 192)] if op == "READ" else [(dst + 100, dev + 7, 8185)]),
                            ("mixed", (read_descs(dst, src, SCATTER) if op == "READ" else write_descs(dst, src, SCATTER)) + ([(dst + 13000, dev + 8000, 192)] if op == "READ" else [(dst + 100, dev + 7, 8185)]))]:
            code = two.client.call(hixl_peer.transfer_sync, two.server_id, op, descs)
            s1 = two.client.call(hixl_peer.snapshot, "dst")
            srcs = two.server.call(hixl_peer.snapshot, "src")
            print(op, name, code, "dst changed bytes:", int((s1.regions[0] != s0.regions[0]).sum()))
            s0 = s1
