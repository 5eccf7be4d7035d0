"""The test S3 server's port choice: weed binds each port p and p + 10000."""

from tests.s3server import _free_ports, is_free_port


def test_no_port_is_another_ports_grpc_port():
    # CI once drew master 44195 and volume 54195: weed bound 54195 as the master's gRPC port
    # and the volume server died with "address already in use".
    base = next(p for p in range(40000, 45000, 7)
                if all(is_free_port(p + k) for k in (0, 1, 10000, 10001, 20000)))
    drawn = iter([base, base + 10000, base + 10000, base + 1, base + 1])
    ports = _free_ports(2, draw=lambda: next(drawn))
    assert ports == [base, base + 1]


def test_ports_drawn_from_the_kernel_never_overlap():
    for _ in range(50):
        ports = _free_ports(4)
        bound = [port for p in ports for port in (p, p + 10000)]
        assert len(set(bound)) == len(bound), ports
