"""The shared layer beneath the services: what more than one of them needs, and nothing that
belongs to one of them.

    errors        exceptions bound to gRPC status codes; the one exception-to-status mapping
    server        gRPC server bootstrap (health, reflection, graceful stop) and client channels
    metrics       Prometheus plumbing
    allocator     glibc malloc settings for processes that stream adapter bytes
    wire          metadata keys and values the protos do not carry

Layers point down only: protos/ and common/ import no service; scheduler/, executor/ and
adapter_store/ import protos, common and their own package; kernels/ imports only torch and
triton; the applications (loraplex/: CLI, client, demo, launcher) import anything.
tests/test_layers.py holds the rule.
"""
